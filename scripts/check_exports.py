"""Sizes, load times and logit differences of a run's SSMs in every export format.

    python scripts/check_exports.py RUN_DIR [--ssm ssm-1] [--llm-gguf PATH] [--tokens 64]

Exports the run once per format into a temporary directory (hf, gguf f32 / f16 / q8_0), loads the
chosen SSM back with transformers (``from_pretrained``; for GGUF with ``gguf_file=``), and prints a
table: size on disk, export seconds, load seconds, and against the run's own SSM (fp32) on one
random sequence of ``--tokens`` ids, the largest absolute logit difference, the relative RMS
difference, and the share of positions whose greedy token agrees.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from boosttune.core.rundir import RunDir
from boosttune.export.gguf import export_gguf, gguf_file_name
from boosttune.export.hf import export_hf


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()  # (1, T, V)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--ssm", default=None, help="which SSM to compare (default: the run's first)")
    p.add_argument("--llm-gguf", default=None, help="the LLM's GGUF (default: the embedded SmolLM2's)")
    p.add_argument("--tokens", type=int, default=64, help="length of the random test sequence")
    args = p.parse_args()
    torch.set_flush_denormal(True)

    run = RunDir(args.run_dir)
    src = run.root / "ssms" / args.ssm if args.ssm else run.ssm_dirs()[0]
    t0 = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ref_load = time.perf_counter() - t0
    vocab = ref.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))  # (1, T)
    want = _logits(ref, ids)
    src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    rows = [("run (safetensors)", src_bytes, 0.0, ref_load, 0.0, 0.0, 1.0)]
    with tempfile.TemporaryDirectory() as tmp:
        formats = [("hf", None), ("gguf f32", "f32"), ("gguf f16", "f16"), ("gguf q8_0", "q8_0")]
        for label, gguf_type in formats:
            out = Path(tmp) / label.replace(" ", "-")
            t0 = time.perf_counter()
            if gguf_type is None:
                export_hf(run, out)
                target, kwargs = out / src.name, {}
                size = sum(f.stat().st_size for f in target.glob("*.safetensors"))
            else:
                export_gguf(run, out, gguf_type=gguf_type, llm_gguf=args.llm_gguf)
                name = gguf_file_name(src.name, gguf_type)
                target, kwargs = out, {"gguf_file": name}
                size = (out / name).stat().st_size
            export_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, **kwargs).eval()
            load_s = time.perf_counter() - t0
            got = _logits(model, ids)
            diff = (got - want).abs().max().item()
            rel = ((got - want).norm() / want.norm()).item()
            agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            rows.append((label, size, export_s, load_s, diff, rel, agree))
            del model
    print(f"SSM {src} ({sum(p.numel() for p in ref.parameters()) / 1e6:.1f} M parameters), "
          f"{args.tokens} random tokens, fp32 logits")
    print(f"{'format':<18} {'weights MB':>10} {'export s':>9} {'load s':>7} {'max|Δlogit|':>12} {'rel RMS':>9} {'argmax =':>9}")
    for label, size, export_s, load_s, diff, rel, agree in rows:
        print(f"{label:<18} {size / 1e6:>10.1f} {export_s:>9.1f} {load_s:>7.1f} {diff:>12.3g} {rel:>9.2g} {agree:>9.3f}")


if __name__ == "__main__":
    main()
