"""`boosttune export RUN_DIR --format hf --out DIR`: each SSM as a plain Hugging Face model folder.

``DIR/<ssm name>/`` holds what ``AutoModelForCausalLM.from_pretrained`` and the engines that take a
standalone draft model read: config.json, the safetensors weights (the SSM's own, copied byte for
byte; its head covers the LLM's whole vocabulary, tied to the embeddings as ``ssm_init`` builds
it), generation_config.json, the LLM's tokenizer files, and a README.md model card saying what the
SSM is, how it was trained, and how to use it as a draft in vLLM, SGLang and transformers assisted
generation. Every folder is loaded back once before the export is published: no missing or
unexpected weights, and a head as wide as the LLM's vocabulary.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from boosttune.core.files import is_complete
from boosttune.export.common import RunInfo, RunSSM, atomic_dir, check_out, read_run, tree_bytes, weight_files

README = "README.md"
_GEN_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class HFExportResult:
    """What ``export_hf`` wrote: the output directory, one model folder per SSM, total bytes, and the
    EAGLE-3 head's folder (None: the run has none)."""

    out: Path
    models: list[Path]
    total_bytes: int
    eagle3: Path | None = None


def _llm_vocab_size(llm_dir: Path) -> int:
    config = json.loads((llm_dir / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int):
        raise ValueError(f"{llm_dir / 'config.json'}: no integer 'vocab_size'; cannot check the SSM's head against it")
    return size


def _verify(folder: Path, vocab_size: int) -> dict:
    """Load the written folder as a user would; returns a few facts for the model card."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise ValueError(f"{folder}: transformers loads it with {bad}; the SSM's weights do not match its config.json")
    rows = int(model.get_output_embeddings().weight.shape[0])
    if rows != vocab_size:
        raise ValueError(f"{folder}: the SSM's head has {rows} rows but the LLM's vocabulary has {vocab_size}; "
                         "a standalone draft model must score the LLM's whole vocabulary")
    cfg = model.config
    return {
        "architecture": type(model).__name__, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
        "params": sum(p.numel() for p in model.parameters()), "vocab": rows,
        "tied": bool(getattr(cfg, "tie_word_embeddings", False)),
    }


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _stat_rows(ssm: RunSSM) -> list[tuple[str, str]]:
    """The scalar training and evaluation figures of one SSM (nested profiles left out)."""
    rows: list[tuple[str, str]] = []
    seen = set()
    for source in (ssm.stats, ssm.report):
        for k, v in source.items():
            if k not in seen and isinstance(v, (int, float, str, bool)) and k != "ssm_dir":
                rows.append((k, _fmt(v)))
                seen.add(k)
    for k in ("tau", "tokens_per_s", "speedup", "c"):
        if k in ssm.evaluation:
            rows.append((f"evaluation.{k}", _fmt(ssm.evaluation[k])))
    return rows


def model_card(info: RunInfo, ssm: RunSSM, facts: dict) -> str:
    """The README.md of one exported SSM folder."""
    llm = str(info.llm_dir.resolve())
    n_stages = len(info.report.get("stages") or []) or len(info.ssms)
    stats = _stat_rows(ssm)
    table = "\n".join(f"| {k} | {v} |" for k, v in stats) if stats else "| (no statistics recorded) | |"
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- speculative-decoding
- draft-model
- boosttune
---

# {ssm.name}: a draft model for `{info.llm_ref}`

A small speculative model (SSM), trained by boosttune's boost-tuning to predict what an LLM
writes, for use as the draft model of speculative decoding. The LLM verifies every drafted token, so
the output follows the LLM's distribution whatever the draft proposes; a better draft only makes
decoding faster.

- LLM (the target): `{info.llm_ref}`; weights used in training: `{llm}`
- boost-tuning stage: {ssm.stage} of {n_stages}
- model: {facts['architecture']}, {facts['layers']} layers, width {facts['hidden']}, {facts['params'] / 1e6:.1f} M parameters
- vocabulary: the LLM's tokenizer; the head scores all {facts['vocab']} tokens{' (tied to the input embeddings)' if facts['tied'] else ''}
- source run: `{info.run.root.resolve()}`

## Training and evaluation

| figure | value |
|---|---|
{table}

## Use as a draft model

Below, `LLM` is the target model (the one above) and `DRAFT` this folder.

### vLLM

```python
from vllm import LLM, SamplingParams

llm = LLM(
    model="{llm}",
    # name the method: vLLM otherwise guesses it from the draft folder's name
    speculative_config={{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 4}},
)
print(llm.generate(["Hello"], SamplingParams(max_tokens=64))[0].outputs[0].text)
```

### SGLang

```bash
python -m sglang.launch_server --model-path {llm} \\
    --speculative-algorithm STANDALONE --speculative-draft-model-path DRAFT \\
    --speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5
```

### transformers (assisted generation)

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("{llm}")
target = AutoModelForCausalLM.from_pretrained("{llm}")
draft = AutoModelForCausalLM.from_pretrained("DRAFT")
inputs = tok("Hello", return_tensors="pt")
out = target.generate(**inputs, assistant_model=draft, max_new_tokens=64)
print(tok.decode(out[0], skip_special_tokens=True))
```

For llama.cpp, export the GGUF instead: `boosttune export RUN_DIR --format gguf --out DIR`, then
`llama-server -m LLM.gguf --model-draft DIR/{ssm.name}.f16.gguf --spec-type draft-simple` (recent
llama.cpp speculates only when `--spec-type` asks; older builds, without that flag, do with
`--model-draft` alone).
"""


def export_hf(run_dir: str | Path, out: str | Path, force: bool = False) -> HFExportResult:
    """Write every complete SSM of a run as a Hugging Face model folder ``out/<ssm name>/``, and the run's
    EAGLE-3 head (``eagle3.enabled``) as ``out/eagle3/``.

    Args:
        run_dir: a `boosttune train` run directory (report.json and at least one complete SSM).
        out: the directory to create; must not exist (or be empty) unless ``force``.
        force: replace an existing ``out``.
    """
    from transformers import AutoTokenizer

    from boosttune.core.eagle3_head import SPEC_FILE, WEIGHTS_FILE

    info = read_run(run_dir)
    out = Path(out)
    check_out(out, info.run, force)
    vocab_size = _llm_vocab_size(info.llm_dir)
    tokenizer = AutoTokenizer.from_pretrained(info.llm_dir)
    eagle3 = info.run.eagle3_dir if is_complete(info.run.eagle3_dir) else None
    with atomic_dir(out) as tmp:
        for ssm in info.ssms:
            dest = tmp / ssm.name
            dest.mkdir()
            for name in ["config.json", *weight_files(ssm.dir)]:
                shutil.copyfile(ssm.dir / name, dest / name)
            gen = next((d / _GEN_CONFIG for d in (ssm.dir, info.llm_dir) if (d / _GEN_CONFIG).is_file()), None)
            if gen is not None:
                shutil.copyfile(gen, dest / _GEN_CONFIG)
            tokenizer.save_pretrained(dest)
            facts = _verify(dest, vocab_size)
            (dest / README).write_text(model_card(info, ssm, facts))
        if eagle3 is not None:  # already in the HF EAGLE-3 layout (core/eagle3_head.py): vLLM's and SGLang's
            dest = tmp / eagle3.name
            dest.mkdir()
            for name in ["config.json", WEIGHTS_FILE, SPEC_FILE]:
                shutil.copyfile(eagle3 / name, dest / name)
            tokenizer.save_pretrained(dest)
    return HFExportResult(out=out, models=[out / s.name for s in info.ssms], total_bytes=tree_bytes(out),
                          eagle3=out / eagle3.name if eagle3 is not None else None)
