"""`boosttune export`: a training run's SSMs written for serving, one module per output format.

- ``bundle``: boosttune's own servable bundle (manifest, tokenizer, SSMs, scheduler);
- ``hf``: each SSM as a Hugging Face model folder (vLLM, SGLang, transformers assisted generation);
- ``gguf``: each SSM as a llama.cpp GGUF draft model;
- ``gguf_compat``: llama.cpp's draft/target vocabulary rules, checked on two GGUF files;
- ``common``: what the exporters share: the run's SSMs, checked once (``checked_ssm_dir``), and
  the atomic output directory.

Callers import the module they need (``from boosttune.export.bundle import export_bundle``): this
file imports nothing, so naming one format never loads the others' dependencies (numpy, gguf,
the serving stack).
"""
