"""`boosttune bench`: incremental decoding, HF assisted generation and our engine, side by side.

All methods run in one process, one after another on each question, after a warm-up, on the same
prompt ids; speedups are ratios of tokens/s measured in this run (the machine is noisy). Per-question
answers follow Spec-Bench's schema (``new_tokens``, ``wall_time``, ``accept_lengths`` per turn;
Xia et al. 2024, arXiv 2401.07851) in ``DIR/<method>.jsonl``; ``DIR/summary.json`` holds the totals.

The llama.cpp methods (``llama``, ``llama_draft``, ``llama_eagle3``, ``llama_ngram``; ``boosttune/llama_cpp.py``) run
`llama-server` on the LLM's GGUF, one process per method for the whole run, on the same prompt ids.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from boosttune import assemble, llama_cpp
from boosttune.core.device import resolve_device
from boosttune.core.models import LoadedModel, eos_token_ids, parse_dtype
from boosttune.core.prompts import Prompt, encode_prompt, read_prompts
from boosttune.core.table import text_table
from boosttune.serving.decode import incremental_generate
from boosttune.serving.draft_vocab import find_ranking
from boosttune.serving.engine import GenerationResult, Plan
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig

METHODS = ("baseline", "hf_plain", "hf_assisted", "hf_lookup", "ours", *llama_cpp.PEER_METHODS)
DEFAULT_METHODS = ("baseline", "hf_assisted", "ours")
BUNDLE_METHODS = ("baseline", "ours")
# what a bundle may be benched beside: plain decoding, ours, and HF's own plain decoding
_WITH_BUNDLE = (*BUNDLE_METHODS, "hf_plain")
# llama-server's context: the longest prompt, the answer, and room for one draft beyond it.
_CTX_MARGIN = 128


@dataclass
class BenchConfig:
    """What `boosttune bench` runs.

    Attributes:
        questions: JSONL/text file of prompts (MT-bench's question.jsonl: first turns are used).
        out: output directory.
        llm: LLM reference ("default", a local path or a hub id; None: "default"); with ``bundle``,
            where the bundle's LLM is (None: as the bundle names it).
        ssms: SSM references; the first is also HF assisted generation's assistant.
        bundle: a bundle to bench exactly as `boosttune serve` serves it (its drafters, trees, draft
            vocabulary and learned scheduler) beside plain decoding; None: ``llm`` and ``ssms``.
        use_scheduler: with ``bundle``, plan every request with its learned scheduler (if it has one).
        limit: use the first ``limit`` questions (0 = all).
        max_new_tokens: tokens generated per question.
        dtype: dtype of the LLM in every method, and of the SSMs unless ``ssm_dtype`` is set.
        ssm_dtype: dtype of the SSMs (None: ``dtype``). Only the LLM's numerics decide the output,
            so a bf16 SSM under an fp32 LLM stays token-identical to fp32 decoding.
        tree: the tree each SSM drafts (None: the bundle's, else ``TreeConfig()``).
        draft_ranking: the token ranking file (or its run directory) for a draft vocabulary > 0;
            None: the bundle's, or found next to the first SSM or in its run directory.
        chat: apply the LLM's chat template.
        methods: which of baseline (plain decoding, one token per forward, through the same LLM runner
            ours verifies with: speed-ups measure speculation alone), hf_plain (plain decoding through
            transformers' own forward), hf_assisted, hf_lookup (HF's prompt lookup decoding, the
            peer of ``prompt_lookup``), ours to run (None: baseline, hf_assisted, ours; with a bundle,
            baseline and ours).
        prompt_lookup: > 0 adds a prompt-lookup drafter (``serving/lookup.py``) proposing up to
            this many tokens to ours, after the SSMs (None: the bundle's default, else 0 = off);
            also llama_ngram's draft length unless ``llama_draft_max``.
        llama_server: the llama-server binary for the llama.cpp methods (None: $BOOSTTUNE_LLAMA_SERVER,
            else where scripts/build_llama_server.sh puts it).
        llm_gguf: the LLM as GGUF for the llama.cpp methods (None: the default LLM's own GGUF).
        draft_gguf: the draft model of ``llama_draft`` (a GGUF from `boosttune export RUN --format gguf`).
        eagle3_gguf: the EAGLE-3 head of ``llama_eagle3`` (``eagle3.<type>.gguf`` from the same export).
        llama_draft_max: the most tokens llama.cpp drafts per step (None: llama.cpp's default for
            llama_draft; ``prompt_lookup`` or 8 for llama_ngram).
        device: where the LLM and the drafters run in every method (``core/device.py``: auto, cpu,
            cuda, cuda:N); each method's inputs go to the LLM's device. The llama.cpp methods ignore
            it (llama-server runs where its build runs).
        compile: compile the CPU forward of the LLM and the drafters (``serving/compiled.py``)
            before any method runs; baseline and ours then both run the compiled LLM.
        quantize: "int8", "int4" or "w8a8": the LLM's products quantized
            (``serving/quantize.py``) for baseline and ours alike (and the drafters'); None keeps its
            dtype's weights.
        recost: time the learned scheduler's costs again on the forward being served and take its fixed
            choice again (``assemble.recost_served``, 15-40 s at the first start on a forward and machine, then
            read from ``recost_cache``); the commands set it
            with --quantize unless told otherwise (``flags.wants_recost``).
        stack_ssms: "auto", "on" or "off": whether the SSMs draft stacked (``assemble.stacks``).
        phrases: with ``bundle``, prompt lookup drafts with its phrase table too (``serving/phrases.py``).
        phrase_table: without ``bundle``, the phrase table prompt lookup drafts with (its file or run
            directory, ``assemble.phrases_file``).
    """

    questions: str
    out: str
    llm: str | None = None
    ssms: list[str] = field(default_factory=list)
    bundle: str | None = None
    use_scheduler: bool = True
    phrases: bool = True
    phrase_table: str | None = None
    limit: int = 0
    max_new_tokens: int = 128
    dtype: str = "fp32"
    ssm_dtype: str | None = None
    tree: TreeConfig | None = None
    chat: bool = True
    methods: tuple[str, ...] | None = None
    draft_ranking: str | None = None
    prompt_lookup: int | None = None
    llama_server: str | None = None
    llm_gguf: str | None = None
    draft_gguf: str | None = None
    eagle3_gguf: str | None = None
    llama_draft_max: int | None = None
    device: str = "auto"
    compile: bool = False
    quantize: str | None = None
    recost: bool = False
    stack_ssms: str = "auto"

    def __post_init__(self) -> None:
        if self.methods is None:
            self.methods = BUNDLE_METHODS if self.bundle is not None else DEFAULT_METHODS

    def validate(self) -> None:
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"--methods: unknown {sorted(unknown)}; choose from {list(METHODS)}")
        if self.bundle is not None:
            if self.ssms:
                raise ValueError("--ssm cannot be combined with --bundle: the bundle's SSMs are used")
            peers = sorted(set(self.methods) - set(_WITH_BUNDLE) - set(llama_cpp.PEER_METHODS))
            if peers:
                raise ValueError(f"--methods {peers}: with --bundle, bench runs what the bundle serves (ours) "
                                 "beside plain decoding (baseline); HF's peers take --llm/--ssm")
        else:
            lookup = self.prompt_lookup or 0
            if not self.ssms and "hf_assisted" in self.methods:
                raise ValueError("--ssm is required for the 'hf_assisted' method (its assistant is the first SSM)")
            if not self.ssms and not lookup and "ours" in self.methods:
                raise ValueError("the 'ours' method needs a drafter: give --ssm (at least one) or --prompt-lookup N")
            if "hf_lookup" in self.methods and not lookup:
                raise ValueError("the 'hf_lookup' method needs --prompt-lookup N (its draft length)")
            if (self.tree or TreeConfig()).draft_vocab:
                find_ranking(self.draft_ranking, self.ssms)
        if self.prompt_lookup is not None and self.prompt_lookup < 0:
            raise ValueError(f"--prompt-lookup must be >= 0 (0 = off), got {self.prompt_lookup}")
        if not Path(self.questions).is_file():
            raise ValueError(f"--questions: no such file: {self.questions}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.limit < 0:
            raise ValueError(f"--limit must be >= 0, got {self.limit}")
        device = resolve_device(self.device)
        parse_dtype(self.dtype, device)
        if self.ssm_dtype is not None:
            parse_dtype(self.ssm_dtype, device)
        self.llama_paths()

    def llama_methods(self) -> list[str]:
        """The llama.cpp methods asked for, in METHODS order."""
        return [m for m in METHODS if m in llama_cpp.PEER_METHODS and m in self.methods]

    def llama_paths(self) -> tuple[Path, Path, Path | None, Path | None] | None:
        """The llama-server binary, the LLM's GGUF, the draft GGUF and the EAGLE-3 GGUF the llama.cpp
        methods use (checked, without loading anything); None when no llama.cpp method is asked for."""
        peers = self.llama_methods()
        if self.draft_gguf is not None and "llama_draft" not in peers:
            raise ValueError("--draft-gguf is used by the 'llama_draft' method only: add it to --methods")
        if self.eagle3_gguf is not None and "llama_eagle3" not in peers:
            raise ValueError("--eagle3-gguf is used by the 'llama_eagle3' method only: add it to --methods")
        if "llama_eagle3" in peers and self.eagle3_gguf is None:
            raise ValueError("the 'llama_eagle3' method needs --eagle3-gguf PATH (an EAGLE-3 head's GGUF: "
                             "`boosttune export RUN --format gguf` writes eagle3.<type>.gguf for a run trained with "
                             "eagle3.enabled)")
        if not peers:
            return None
        if self.llama_draft_max is not None and self.llama_draft_max < 1:
            raise ValueError(f"--llama-draft-max must be >= 1, got {self.llama_draft_max}")
        if "llama_draft" in peers and self.draft_gguf is None:
            raise ValueError("the 'llama_draft' method needs --draft-gguf PATH (a draft model's GGUF: "
                             "`boosttune export RUN --format gguf` writes one; the LLM's own GGUF works for a test)")
        binary = llama_cpp.find_server(self.llama_server)
        bundle_llm = None
        if self.bundle is not None:
            from boosttune.serving.manifest import read_manifest

            bundle_llm = read_manifest(self.bundle).llm.ref
        gguf = llama_cpp.resolve_llm_gguf(self.llm_gguf, self.llm, bundle_llm)
        draft = llama_cpp.check_gguf(self.draft_gguf, "--draft-gguf") if self.draft_gguf is not None else None
        eagle3 = llama_cpp.check_gguf(self.eagle3_gguf, "--eagle3-gguf") if self.eagle3_gguf is not None else None
        return binary, gguf, draft, eagle3


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


@dataclass
class PeerGeneration(GenerationResult):
    """A llama.cpp answer: no per-step accept lengths, but llama.cpp's own ``timings`` block."""

    timings: dict = field(default_factory=dict)


def _llama_generate(server: llama_cpp.LlamaServer, ids: list[int], stop: StopCriteria) -> PeerGeneration:
    res = server.complete(ids, stop.max_new_tokens)
    return PeerGeneration(res.tokens, [], res.wall_time, res.finish_reason, timings=res.timings)


def _start_servers(cfg: BenchConfig, encoded: list[list[int]], out: Path, stack: ExitStack) -> dict[str, llama_cpp.LlamaServer]:
    """One llama-server per llama.cpp method, each stopped when ``stack`` closes (errors and Ctrl-C too)."""
    paths = cfg.llama_paths()
    if paths is None:
        return {}
    binary, gguf, draft, eagle3 = paths
    ctx = max(len(ids) for ids in encoded) + cfg.max_new_tokens + _CTX_MARGIN
    ctx = -(-ctx // 256) * 256
    servers = {}
    for m in cfg.llama_methods():
        extra = llama_cpp.method_args(m, draft, cfg.llama_draft_max, cfg.prompt_lookup, eagle3)
        server = llama_cpp.LlamaServer(binary, gguf, torch.get_num_threads(), ctx, extra, out / f"{m}.llama-server.log")
        servers[m] = stack.enter_context(server)
    return servers


def _answer_record(prompt: Prompt, res: GenerationResult, text: str, model_id: str) -> dict:
    choice = {
        "index": 0, "turns": [text], "new_tokens": [len(res.tokens)], "wall_time": [res.wall_time],
        "accept_lengths": res.accept_lengths,
    }
    if isinstance(res, PeerGeneration):
        choice["llama_timings"] = [res.timings]
    if res.plan is not None:  # what this request drafted with (a learned scheduler's choice, per question)
        choice["plan"] = {name: asdict(tree) for name, tree in res.plan.trees.items()}
        choice["proposer_hits"] = res.proposer_hits
    return {
        "question_id": prompt.id, "category": prompt.category, "model_id": model_id,
        "answer_id": f"{model_id}-{prompt.id}", "tstamp": time.time(), "choices": [choice],
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _tokens_per_s(rs: Sequence[GenerationResult]) -> float:
    """Spec-Bench's tokens/s: the mean over questions of new tokens / wall time (nan: no question)."""
    return _mean([len(r.tokens) / r.wall_time for r in rs])


def _tau(rs: Sequence[GenerationResult]) -> float:
    """τ: tokens committed per LLM step over all of ``rs`` (nan: no step recorded)."""
    steps = sum(r.steps for r in rs)
    return sum(len(r.tokens) for r in rs) / steps if steps else float("nan")


def by_category(results: dict[str, list[GenerationResult]], categories: Sequence[str]) -> dict[str, dict]:
    """Per category (first-appearance order; "" counts as ``"uncategorised"``): its question count and,
    for each method, tokens/s and τ (None for a method that records no LLM steps: HF's and llama.cpp's).

    Args:
        results: each method's results, one per question in question order.
        categories: (Q,) each question's category.
    """
    groups: dict[str, list[int]] = {}
    for q, c in enumerate(categories):
        groups.setdefault(c or "uncategorised", []).append(q)
    out = {}
    for cat, qs in groups.items():
        methods = {}
        for m, rs in results.items():
            assert len(rs) == len(categories), (m, len(rs), len(categories))
            picked = [rs[q] for q in qs]
            methods[m] = {"tokens_per_s": _tokens_per_s(picked),
                          "tau": _tau(picked) if any(r.steps for r in picked) else None}
        out[cat] = {"questions": len(qs), "methods": methods}
    return out


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Runs the benchmark, writes DIR/*.jsonl and DIR/summary.json, returns the summary."""
    cfg.validate()
    prompts = read_prompts(cfg.questions)
    if cfg.limit:
        prompts = prompts[: cfg.limit]
    if not prompts:
        raise ValueError(f"--questions: no prompts found in {cfg.questions}")
    served = assemble.load(
        bundle=cfg.bundle, llm=cfg.llm, ssms=cfg.ssms, dtype=cfg.dtype, ssm_dtype=cfg.ssm_dtype, tree=cfg.tree,
        draft_ranking=cfg.draft_ranking, lookup=cfg.prompt_lookup, use_scheduler=cfg.use_scheduler, device=cfg.device,
        stack_ssms=cfg.stack_ssms, phrases=cfg.phrases, phrase_table=cfg.phrase_table,
    )
    if cfg.quantize:
        assemble.quantize_served(served.engine, cfg.quantize)
    compile_s = assemble.compile_served(served) if cfg.compile else None
    recost_s = assemble.recost_served(served, keep=True) if cfg.recost else None
    llm, ssms = served.llm, list(served.models.values())
    tok = llm.tokenizer
    eos = eos_token_ids(llm)
    stop = StopCriteria(max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos)

    methods = [m for m in METHODS if m in cfg.methods]
    encoded = [encode_prompt(tok, p, chat=cfg.chat) for p in prompts]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[GenerationResult]] = {m: [] for m in methods}
    with ExitStack() as stack:  # llama-servers and answer files: closed on errors and Ctrl-C too
        servers = _start_servers(cfg, encoded, out, stack)

        def runners(stop: StopCriteria) -> dict[str, Callable[[list[int]], GenerationResult]]:
            return {
                "baseline": lambda ids: served.engine.generate(ids, stop, plan=Plan()),  # no drafter
                "hf_plain": lambda ids: incremental_generate(llm.model, ids, stop),
                "hf_assisted": lambda ids: _hf_generate(llm, ids, stop, assistant_model=ssms[0].model),
                "hf_lookup": lambda ids: _hf_generate(llm, ids, stop, prompt_lookup_num_tokens=served.lookup),
                "ours": lambda ids: served.generate(ids, stop, chat=cfg.chat),
                **{m: (lambda ids, s=s: _llama_generate(s, ids, stop)) for m, s in servers.items()},
            }

        warm_up = runners(StopCriteria(max_new_tokens=8, eos_token_ids=eos))
        for m in methods:  # first calls pay for lazy initialisation
            warm_up[m](encoded[0])
        run = runners(stop)
        files = {m: stack.enter_context(open(out / f"{m}.jsonl", "w")) for m in methods}
        for prompt, ids in tqdm(list(zip(prompts, encoded, strict=True)), desc="bench", disable=not progress):
            for m in methods:
                res = run[m](ids)
                results[m].append(res)
                text = tok.decode(res.tokens, skip_special_tokens=True)
                files[m].write(json.dumps(_answer_record(prompt, res, text, m)) + "\n")
                files[m].flush()
        llama = _llama_summary(cfg, servers, results, eos) if servers else None
    summary = summarize(results, cfg, served, llama, [p.category for p in prompts])
    summary["compile_s"] = None if compile_s is None else round(compile_s, 1)
    summary["recost_s"] = None if recost_s is None else round(recost_s, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _llama_summary(cfg: BenchConfig, servers: dict[str, llama_cpp.LlamaServer],
                   results: dict[str, list[GenerationResult]], eos: frozenset[int]) -> dict:
    """How the llama.cpp methods ran (binary, GGUFs, flags) and llama.cpp's own timings per method."""
    first = next(iter(servers.values()))
    per_method = {}
    for m, server in servers.items():
        rs = [r for r in results[m] if isinstance(r, PeerGeneration)]
        per_method[m] = {
            "args": server.extra,
            "server_tokens_per_s": _mean([r.timings.get("predicted_per_second", float("nan")) for r in rs]),
            "prompt_ms": _mean([r.timings.get("prompt_ms", float("nan")) for r in rs]),
            "predicted_n": sum(r.timings.get("predicted_n", 0) for r in rs),
            "draft_n": sum(r.timings.get("draft_n", 0) for r in rs),
            "draft_n_accepted": sum(r.timings.get("draft_n_accepted", 0) for r in rs),
            "prompt_cache_n": sum(r.timings.get("cache_n", 0) for r in rs),
            "stopped": sum(r.finish_reason == "stop" for r in rs),
            # llama.cpp stops at every end-of-generation token of the GGUF's vocabulary; ours at eos_token_ids
            "stopped_outside_our_eos": sum(r.finish_reason == "stop" and r.tokens[-1] not in eos for r in rs if r.tokens),
        }
    return {"server": str(first.binary), "llm_gguf": str(first.model), "draft_gguf": cfg.draft_gguf,
            "eagle3_gguf": cfg.eagle3_gguf,
            "ctx_size": first.ctx_size, "threads": first.threads, "methods": per_method}


def summarize(results: dict[str, list[GenerationResult]], cfg: BenchConfig, served: assemble.Served,
              llama: dict | None = None, categories: Sequence[str] | None = None) -> dict:
    """Spec-Bench style totals: tokens/s is the mean over questions of new tokens / wall time.

    ``categories``: (Q,) each question's category; ``categories`` then holds :func:`by_category`'s
    per-category figures (None: not given).

    ``llama``: the llama.cpp methods' run details (``_llama_summary``); each such method ``m`` also
    gets ``m_tokens_per_s``, ``m_identical`` (answers token-identical to the baseline's; llama.cpp
    runs the quantised GGUF with its own kernels, so this is information, not a requirement) and
    ``m_acceptance`` (draft_n_accepted / draft_n; None when it drafted nothing).
    """
    def tps(m: str) -> float:
        return _tokens_per_s(results.get(m, []))

    def same(m: str, ref: str = "baseline") -> int | None:
        """Answers of ``m`` token-identical to ``ref``'s (None: one of them did not run)."""
        a, b = results.get(m, []), results.get(ref, [])
        return sum(x.tokens == y.tokens for x, y in zip(a, b, strict=True)) if a and b else None

    ours = results.get("ours", [])
    base = results.get("baseline", [])
    hf = results.get("hf_assisted", [])
    summary = {
        "total": len(next(iter(results.values()))),
        "tau": _tau(ours),
        "tokens_per_s": tps("ours"),
        "baseline_tokens_per_s": tps("baseline"),
        "llm_runner": type(served.engine.llm).__name__,  # baseline's and ours' LLM forward
        "llm_compiled": getattr(served.engine.llm, "compiled", None) is not None,
        "llm_quantized": getattr(served.engine.llm, "quantized", None),
        "hf_plain_tokens_per_s": tps("hf_plain"),
        "hf_plain_identical": same("hf_plain"),
        "hf_assisted_tokens_per_s": tps("hf_assisted"),
        "greedy_identical": same("ours"),
        "hf_assisted_identical": same("hf_assisted"),
        "hf_lookup_tokens_per_s": tps("hf_lookup"),
        "hf_lookup_identical": same("hf_lookup"),
        "prompt_lookup": served.lookup,
        "phrases": served.phrases,
        "phrase_file": None if served.phrase_file is None else str(served.phrase_file),
        "dtype": cfg.dtype,
        "device": str(served.llm.model.device),
        "ssm_dtype": cfg.ssm_dtype or cfg.dtype,
        "llm": served.llm.ref,
        "ssms": list(served.models) if cfg.bundle is not None else cfg.ssms,
        "bundle": cfg.bundle,
        "scheduler": served.scheduler is not None,
        "tree": asdict(next((served.engine.plan.trees[n] for n in served.models), cfg.tree or TreeConfig())),
        "plan": {name: asdict(tree) for name, tree in served.engine.plan.trees.items()},
        # what the requests drafted with, by how many questions (the learned scheduler's choices)
        "plans": dict(Counter(r.plan.label for r in ours if r.plan is not None).most_common()),
        "methods": [m for m in METHODS if m in results],
        "max_new_tokens": cfg.max_new_tokens,
        "mean_new_tokens": _mean([len(r.tokens) for r in ours or base]),
        "threads": torch.get_num_threads(),
    }
    summary["speedup_vs_baseline"] = summary["tokens_per_s"] / summary["baseline_tokens_per_s"] if base and ours else None
    summary["speedup_vs_hf_assisted"] = summary["tokens_per_s"] / summary["hf_assisted_tokens_per_s"] if hf and ours else None
    for m, info in (llama or {}).get("methods", {}).items():
        summary[f"{m}_tokens_per_s"] = tps(m)
        summary[f"{m}_identical"] = same(m)
        summary[f"{m}_acceptance"] = info["draft_n_accepted"] / info["draft_n"] if info["draft_n"] else None
        if m != "llama" and "llama" in results:  # llama.cpp's speculation against its own plain decoding
            info["identical_to_llama"] = same(m, "llama")
    summary["llama_cpp"] = llama
    summary["categories"] = by_category(results, categories) if categories is not None else None
    return summary


def format_table(summary: dict) -> str:
    """The summary as a small text table, one row per method that ran; "accept" is llama.cpp's draft
    acceptance, "= baseline" counts the answers token-identical to the baseline's."""
    base = summary["baseline_tokens_per_s"]
    ran = summary.get("methods", METHODS)
    rows = [("method", "tokens/s", "tau", "accept", "speedup", "= baseline")]
    if "baseline" in ran:
        rows.append(("baseline (incremental)", f"{base:.2f}", "1.00", "-", "1.00", "-"))
    if "hf_plain" in ran:
        rows.append(("hf_plain (transformers)", f"{summary['hf_plain_tokens_per_s']:.2f}", "1.00", "-",
                     _ratio(summary["hf_plain_tokens_per_s"], base), _fmt_int(summary["hf_plain_identical"])))
    if "hf_assisted" in ran:
        rows.append(("hf_assisted", f"{summary['hf_assisted_tokens_per_s']:.2f}", "-", "-",
                     _ratio(summary["hf_assisted_tokens_per_s"], base), _fmt_int(summary["hf_assisted_identical"])))
    if "hf_lookup" in ran:
        rows.append(("hf_lookup", f"{summary['hf_lookup_tokens_per_s']:.2f}", "-", "-",
                     _ratio(summary["hf_lookup_tokens_per_s"], base), _fmt_int(summary["hf_lookup_identical"])))
    if "ours" in ran:
        rows.append(("ours (token tree)", f"{summary['tokens_per_s']:.2f}", f"{summary['tau']:.2f}", "-",
                     _ratio(summary["tokens_per_s"], base), _fmt_int(summary["greedy_identical"])))
    for m in (summary.get("llama_cpp") or {}).get("methods", {}):
        rows.append((f"{m} (llama.cpp)", f"{summary[f'{m}_tokens_per_s']:.2f}", "-", _fmt(summary[f"{m}_acceptance"]),
                     _ratio(summary[f"{m}_tokens_per_s"], base), _fmt_int(summary[f"{m}_identical"])))
    lines = text_table(rows)
    runner = (f"{summary.get('llm_runner')}{' compiled' if summary.get('llm_compiled') else ''}"
              f"{' ' + summary['llm_quantized'] if summary.get('llm_quantized') else ''}")
    footer = (f"dtype={summary['dtype']} (SSMs {summary['ssm_dtype']})  LLM runner={runner}  "
              f"questions={summary['total']}  "
              f"threads={summary['threads']}  greedy_identical={summary['greedy_identical']}")
    if summary["speedup_vs_hf_assisted"] is not None:
        footer += f"  speedup_vs_hf_assisted={_fmt(summary['speedup_vs_hf_assisted'])}"
    lines.append(footer)
    if summary.get("plans"):
        lines.append("ours drafted with: " + "; ".join(f"{label} x{n}" for label, n in summary["plans"].items()))
    return "\n".join(lines)


def format_category_table(summary: dict) -> str:
    """The per-category figures as a compact text table: questions, each method's tokens/s, τ where a
    speculative method recorded it (plain decoding's is 1), ours' speedup over the baseline; "" when
    the questions have fewer than two categories."""
    cats = summary.get("categories") or {}
    if len(cats) < 2:
        return ""
    methods = list(next(iter(cats.values()))["methods"])
    taus = [m for m in methods if m != "baseline" and any(c["methods"][m]["tau"] is not None for c in cats.values())]
    speedup = "baseline" in methods and "ours" in methods
    rows = [("category", "n", *(f"{m} tok/s" for m in methods), *(f"{m} tau" for m in taus),
             *(["speedup"] if speedup else []))]
    for cat, c in cats.items():
        f = c["methods"]
        rows.append((cat, str(c["questions"]), *(f"{f[m]['tokens_per_s']:.2f}" for m in methods),
                     *(_fmt(f[m]["tau"]) for m in taus),
                     *([_ratio(f["ours"]["tokens_per_s"], f["baseline"]["tokens_per_s"])] if speedup else [])))
    return "\n".join(text_table(rows))


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a == a and b == b and b else "-"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt_int(x: int | None) -> str:
    return "-" if x is None else str(x)
