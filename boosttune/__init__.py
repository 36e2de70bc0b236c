"""boosttune: collectively boost-tuned SSMs and lossless token-tree speculative inference."""

__version__ = "0.1.0"
