"""Tree-attention kernels: Triton on GPU, a PyTorch path on CPU (one file per kernel)."""
