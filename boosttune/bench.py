"""`boosttune bench`: incremental decoding, HF assisted generation and our engine, side by side.

All methods run in one process, one after another on each question, after a warm-up, on the same
prompt ids; speedups are ratios of tokens/s measured in this run (the machine is noisy). Per-question
answers follow Spec-Bench's schema (``new_tokens``, ``wall_time``, ``accept_lengths`` per turn;
Xia et al. 2024, arXiv 2401.07851) in ``DIR/<method>.jsonl``; ``DIR/summary.json`` holds the totals.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from boosttune.assemble import engine_from_models
from boosttune.core.models import LoadedModel, eos_token_ids, load_llm_and_ssms, parse_dtype
from boosttune.core.prompts import Prompt, encode_prompt, read_prompts
from boosttune.serving.builders import TreeConfig
from boosttune.serving.decode import incremental_generate
from boosttune.serving.draft_vocab import find_ranking, ranking_for
from boosttune.serving.engine import GenerationResult
from boosttune.serving.stops import StopCriteria

METHODS = ("baseline", "hf_assisted", "hf_lookup", "ours")


@dataclass
class BenchConfig:
    """What `boosttune bench` runs.

    Attributes:
        llm: LLM reference ("default", a local path or a hub id).
        ssms: SSM references; the first is also HF assisted generation's assistant.
        questions: JSONL/text file of prompts (MT-bench's question.jsonl: first turns are used).
        out: output directory.
        limit: use the first ``limit`` questions (0 = all).
        max_new_tokens: tokens generated per question.
        dtype: dtype of the LLM in every method, and of the SSMs unless ``ssm_dtype`` is set.
        ssm_dtype: dtype of the SSMs (None: ``dtype``). Only the LLM's numerics decide the output,
            so a bf16 SSM under an fp32 LLM stays token-identical to fp32 decoding.
        tree: the tree each SSM drafts.
        draft_ranking: the token ranking file (or its run directory) for ``tree.draft_vocab`` > 0;
            None: found next to the first SSM or in its run directory.
        chat: apply the LLM's chat template.
        methods: which of baseline, hf_assisted, hf_lookup (HF's prompt lookup decoding, the
            peer of ``prompt_lookup``), ours to run.
        prompt_lookup: > 0 adds a prompt-lookup drafter (``serving/lookup.py``) proposing up to
            this many tokens to ours, after the SSMs (0: off).
    """

    llm: str
    ssms: list[str]
    questions: str
    out: str
    limit: int = 0
    max_new_tokens: int = 128
    dtype: str = "fp32"
    ssm_dtype: str | None = None
    tree: TreeConfig = field(default_factory=TreeConfig)
    chat: bool = True
    methods: tuple[str, ...] = METHODS
    draft_ranking: str | None = None
    prompt_lookup: int = 0

    def validate(self) -> None:
        if not self.ssms and "hf_assisted" in self.methods:
            raise ValueError("--ssm is required for the 'hf_assisted' method (its assistant is the first SSM)")
        if not self.ssms and not self.prompt_lookup and "ours" in self.methods:
            raise ValueError("the 'ours' method needs a drafter: give --ssm (at least one) or --prompt-lookup N")
        if self.prompt_lookup < 0:
            raise ValueError(f"--prompt-lookup must be >= 0 (0 = off), got {self.prompt_lookup}")
        if "hf_lookup" in self.methods and not self.prompt_lookup:
            raise ValueError("the 'hf_lookup' method needs --prompt-lookup N (its draft length)")
        if not Path(self.questions).is_file():
            raise ValueError(f"--questions: no such file: {self.questions}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.limit < 0:
            raise ValueError(f"--limit must be >= 0, got {self.limit}")
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"--methods: unknown {sorted(unknown)}; choose from {list(METHODS)}")
        parse_dtype(self.dtype)
        if self.ssm_dtype is not None:
            parse_dtype(self.ssm_dtype)
        if self.tree.draft_vocab:
            find_ranking(self.draft_ranking, self.ssms)


def _hf_generate(llm: LoadedModel, ids: list[int], stop: StopCriteria, **assist) -> GenerationResult:
    """HF transformers greedy ``generate`` with ``assist`` (an assistant model or prompt lookup): the peers."""
    start = time.perf_counter()
    inp = torch.tensor([ids], device=llm.model.device)
    out = llm.model.generate(
        inp, attention_mask=torch.ones_like(inp), do_sample=False, **assist,
        max_new_tokens=stop.max_new_tokens, eos_token_id=sorted(stop.eos_token_ids) or None,
        pad_token_id=llm.tokenizer.pad_token_id or llm.tokenizer.eos_token_id,
    )
    new, finish = stop.cut([], out[0, len(ids):].tolist())
    return GenerationResult(new, [], time.perf_counter() - start, finish or "length")


def _answer_record(prompt: Prompt, res: GenerationResult, text: str, model_id: str) -> dict:
    return {
        "question_id": prompt.id, "category": prompt.category, "model_id": model_id,
        "answer_id": f"{model_id}-{prompt.id}", "tstamp": time.time(),
        "choices": [{
            "index": 0, "turns": [text], "new_tokens": [len(res.tokens)], "wall_time": [res.wall_time],
            "accept_lengths": res.accept_lengths,
        }],
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Runs the benchmark, writes DIR/*.jsonl and DIR/summary.json, returns the summary."""
    cfg.validate()
    dtype = parse_dtype(cfg.dtype)
    prompts = read_prompts(cfg.questions)
    if cfg.limit:
        prompts = prompts[: cfg.limit]
    if not prompts:
        raise ValueError(f"--questions: no prompts found in {cfg.questions}")
    ranking = ranking_for(cfg.tree.draft_vocab, cfg.draft_ranking, cfg.ssms)
    llm, ssms = load_llm_and_ssms(cfg.llm, cfg.ssms, dtype, parse_dtype(cfg.ssm_dtype or cfg.dtype))
    tok = llm.tokenizer
    eos = eos_token_ids(llm)
    stop = StopCriteria(max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos)
    engine = engine_from_models(
        llm.model, [s.model for s in ssms], cfg.tree, ranking=ranking, lookup=cfg.prompt_lookup
    )

    def runners(stop: StopCriteria) -> dict[str, Callable[[list[int]], GenerationResult]]:
        return {
            "baseline": lambda ids: incremental_generate(llm.model, ids, stop),
            "hf_assisted": lambda ids: _hf_generate(llm, ids, stop, assistant_model=ssms[0].model),
            "hf_lookup": lambda ids: _hf_generate(llm, ids, stop, prompt_lookup_num_tokens=cfg.prompt_lookup),
            "ours": lambda ids: engine.generate(ids, stop),
        }

    methods = [m for m in METHODS if m in cfg.methods]
    encoded = [encode_prompt(tok, p, chat=cfg.chat) for p in prompts]
    warm_up = runners(StopCriteria(max_new_tokens=8, eos_token_ids=eos))
    for m in methods:  # first calls pay for lazy initialisation
        warm_up[m](encoded[0])
    run = runners(stop)

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[GenerationResult]] = {m: [] for m in methods}
    files = {m: open(out / f"{m}.jsonl", "w") for m in methods}
    try:
        for prompt, ids in tqdm(list(zip(prompts, encoded, strict=True)), desc="bench", disable=not progress):
            for m in methods:
                res = run[m](ids)
                results[m].append(res)
                text = tok.decode(res.tokens, skip_special_tokens=True)
                files[m].write(json.dumps(_answer_record(prompt, res, text, m)) + "\n")
                files[m].flush()
    finally:
        for f in files.values():
            f.close()
    summary = summarize(results, cfg)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def summarize(results: dict[str, list[GenerationResult]], cfg: BenchConfig) -> dict:
    """Spec-Bench style totals: tokens/s is the mean over questions of new tokens / wall time."""
    def tps(m: str) -> float:
        return _mean([len(r.tokens) / r.wall_time for r in results.get(m, [])])

    ours = results.get("ours", [])
    base = results.get("baseline", [])
    hf = results.get("hf_assisted", [])
    hfl = results.get("hf_lookup", [])
    steps = sum(r.steps for r in ours)
    summary = {
        "total": len(next(iter(results.values()))),
        "tau": sum(len(r.tokens) for r in ours) / steps if steps else float("nan"),
        "tokens_per_s": tps("ours"),
        "baseline_tokens_per_s": tps("baseline"),
        "hf_assisted_tokens_per_s": tps("hf_assisted"),
        "greedy_identical": sum(a.tokens == b.tokens for a, b in zip(ours, base, strict=True)) if base else None,
        "hf_assisted_identical": sum(a.tokens == b.tokens for a, b in zip(hf, base, strict=True)) if base and hf else None,
        "hf_lookup_tokens_per_s": tps("hf_lookup"),
        "hf_lookup_identical": sum(a.tokens == b.tokens for a, b in zip(hfl, base, strict=True)) if base and hfl else None,
        "prompt_lookup": cfg.prompt_lookup,
        "dtype": cfg.dtype,
        "ssm_dtype": cfg.ssm_dtype or cfg.dtype,
        "llm": cfg.llm,
        "ssms": cfg.ssms,
        "tree": asdict(cfg.tree),
        "max_new_tokens": cfg.max_new_tokens,
        "mean_new_tokens": _mean([len(r.tokens) for r in ours or base]),
        "threads": torch.get_num_threads(),
    }
    summary["speedup_vs_baseline"] = summary["tokens_per_s"] / summary["baseline_tokens_per_s"] if base and ours else None
    summary["speedup_vs_hf_assisted"] = summary["tokens_per_s"] / summary["hf_assisted_tokens_per_s"] if hf and ours else None
    return summary


def format_table(summary: dict) -> str:
    """The summary as a small text table."""
    rows = [
        ("method", "tokens/s", "tau", "speedup"),
        ("baseline (incremental)", f"{summary['baseline_tokens_per_s']:.2f}", "1.00", "1.00"),
        ("hf_assisted", f"{summary['hf_assisted_tokens_per_s']:.2f}", "-",
         _ratio(summary["hf_assisted_tokens_per_s"], summary["baseline_tokens_per_s"])),
        ("hf_lookup", f"{summary['hf_lookup_tokens_per_s']:.2f}", "-",
         _ratio(summary["hf_lookup_tokens_per_s"], summary["baseline_tokens_per_s"])),
        ("ours (token tree)", f"{summary['tokens_per_s']:.2f}", f"{summary['tau']:.2f}",
         _ratio(summary["tokens_per_s"], summary["baseline_tokens_per_s"])),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        f"dtype={summary['dtype']} (SSMs {summary['ssm_dtype']})  questions={summary['total']}  greedy_identical={summary['greedy_identical']}"
        f"  speedup_vs_hf_assisted={_fmt(summary['speedup_vs_hf_assisted'])}"
    )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a == a and b == b and b else "-"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
