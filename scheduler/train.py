"""`boosttune train-scheduler RUN_DIR`: labels → costs → fit → evaluate → scheduler.json + report.

Writes::

    RUN_DIR/scheduler/scheduler.json     the scheduler (persist.py format), loaded at serve time
    RUN_DIR/scheduler/complete.json      written last (`boosttune export` ships this directory)
    RUN_DIR/scheduler_report.json        every policy's τ, tokens/s and draft cost on eval requests
    RUN_DIR/scheduler_report.png         tokens/s by policy
    RUN_DIR/scheduler_labels.jsonl       the labelled requests (features, per-step acceptances)

Steps: load the run's LLM and SSMs; label the train and eval prompts (every SSM merged at the
label depth, full information); time every (SSM, depth) and plain decoding (cost model); fit the
acceptance model on the train requests; replay every policy on the eval requests and run the
``real_policies`` through the engine, interleaved per request.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from boosttune.core.files import MARKER, atomic_write_json, atomic_write_text, mark_complete
from boosttune.core.models import eos_token_ids, load_llm_and_ssms, model_vocab_size
from boosttune.core.prompts import encode_prompt, read_prompts
from boosttune.core.rundir import RunDir
from boosttune.draft_ranking import ensure_draft_ranking
from boosttune.scheduler.config import SchedulerConfig
from boosttune.scheduler.costs import calibrate
from boosttune.scheduler.evaluate import best_fixed, fixed_policies, real_policies, replay_policies, summarize
from boosttune.scheduler.features import FeatureSpec
from boosttune.scheduler.labels import RequestRecord, collect_labels
from boosttune.scheduler.model import fit_linear
from boosttune.scheduler.plot import plot_tokens_per_s
from boosttune.scheduler.policy import Scheduler
from boosttune.scheduler.stepwise import fit_ngram_depths
from boosttune.scheduler.subsets import members, union_survival
from boosttune.serving.builders import TreeConfig
from boosttune.serving.draft_vocab import load_ranking
from boosttune.serving.engine import SpeculativeEngine
from boosttune.serving.lookup import LOOKUP_NAME
from boosttune.serving.stops import StopCriteria

REPORT_FORMAT = 1
SPECINFER_WIDTHS = (1, 1, 3, 1, 1, 1, 1, 1)
OVERHEAD_TARGET = 0.02  # the scheduler may cost at most 2 % of a request's latency


def resolve_widths(cfg: SchedulerConfig, tree: dict | None) -> tuple[int, ...]:
    """The expansion widths: the config's, else the run's expansion tree's, else SpecInfer's."""
    if cfg.widths is not None:
        return cfg.widths
    if tree and tree.get("kind", "expansion") == "expansion" and tree.get("widths"):
        return tuple(int(w) for w in tree["widths"])
    return SPECINFER_WIDTHS


def split_prompts(cfg: SchedulerConfig) -> tuple[list, list]:
    """(train, eval) prompts: a seeded split of ``prompts``, or ``prompts`` and ``eval_prompts``."""
    if cfg.prompts is None:
        raise ValueError(
            "scheduler.prompts is not set: give a JSONL/text file of prompts held out from SSM "
            "training (e.g. MT-bench's question.jsonl) in the config's scheduler: section or --prompts"
        )
    prompts = read_prompts(cfg.prompts)[: cfg.limit or None]
    if cfg.eval_prompts is not None:
        return prompts, read_prompts(cfg.eval_prompts)[: cfg.eval_limit or None]
    order = list(range(len(prompts)))
    random.Random(cfg.seed).shuffle(order)
    n_train = round(len(prompts) * cfg.train_fraction)
    return [prompts[i] for i in order[:n_train]], [prompts[i] for i in order[n_train:]]


@dataclass
class _Setup:
    """The loaded models and encoded requests of one training run."""

    engine: SpeculativeEngine
    names: list[str]
    spec: FeatureSpec
    widths: tuple[int, ...]
    meta: dict
    train_req: list[tuple[str, list[int]]]
    eval_req: list[tuple[str, list[int]]]
    stop: StopCriteria


def _setup(run: RunDir, cfg: SchedulerConfig) -> _Setup:
    """Check the run and the prompts, load the LLM and SSMs, encode the requests, warm up."""
    report = run.read_report()
    ssm_paths = run.ssm_dirs()
    if not ssm_paths:
        raise ValueError(f"{run}: no complete SSMs under ssms/; the scheduler needs trained SSMs")
    train_prompts, eval_prompts = split_prompts(cfg)
    if len(train_prompts) < 3 or not eval_prompts:
        raise ValueError(
            f"scheduler: {len(train_prompts)} train and {len(eval_prompts)} eval prompts; need >= 3 "
            "and >= 1 (raise scheduler.limit or change scheduler.train_fraction)"
        )
    widths = resolve_widths(cfg, report.get("tree"))
    dtype = cfg.dtype or report["llm"].get("dtype") or "fp32"
    ssm_dtype = cfg.ssm_dtype or dtype
    llm, ssms = load_llm_and_ssms(report["llm"]["ref"], [str(p) for p in ssm_paths], dtype, ssm_dtype)
    ranking = None
    if cfg.draft_vocab:
        ranking = load_ranking(ensure_draft_ranking(run, model_vocab_size(llm.model)))
    label_tree = TreeConfig(widths=widths[: cfg.label_depth], draft_vocab=cfg.draft_vocab)
    lookup = cfg.label_depth if cfg.prompt_lookup else 0
    engine = SpeculativeEngine.from_models(
        llm.model, [s.model for s in ssms], label_tree, ranking=ranking, lookup=lookup
    )
    hidden = int(llm.model.get_output_embeddings().weight.shape[1])
    encoded = [(p.id, encode_prompt(llm.tokenizer, p, chat=cfg.chat)) for p in train_prompts + eval_prompts]
    eos = eos_token_ids(llm)
    _warm_up(engine, encoded[0][1], eos)
    names = [p.name for p in ssm_paths] + ([LOOKUP_NAME] if cfg.prompt_lookup else [])
    return _Setup(
        engine=engine,
        names=names,
        spec=FeatureSpec(hidden_size=hidden, ngram_buckets=cfg.ngram_buckets, lookup=cfg.prompt_lookup),
        widths=widths,
        meta={"llm": report["llm"]["ref"], "dtype": dtype, "ssm_dtype": ssm_dtype, "ssms": names,
              "draft_vocab": cfg.draft_vocab, "prompt_lookup": cfg.prompt_lookup},
        train_req=encoded[: len(train_prompts)],
        eval_req=encoded[len(train_prompts) :],
        stop=StopCriteria(max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos),
    )


@contextlib.contextmanager
def _timed(clock: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    clock[key] = time.perf_counter() - start


def train_scheduler(
    run_dir: str | Path, cfg: SchedulerConfig, log: Callable[[str], None] | None = None
) -> dict:
    """Train and evaluate the scheduler of a run; writes its files and returns the report.

    Args:
        run_dir: a `boosttune train` run directory (report.json with the LLM and complete SSMs).
        cfg: what to do (see ``SchedulerConfig``).
        log: progress lines (default: stderr).
    """
    say = log or (lambda s: print(f"[train-scheduler] {s}", file=sys.stderr, flush=True))
    run, clock = RunDir(run_dir), {}
    (run.scheduler_dir / MARKER).unlink(missing_ok=True)  # a retrain is incomplete until it finishes
    with _timed(clock, "load_s"):
        st = _setup(run, cfg)
    with _timed(clock, "labels_s"):
        say(
            f"labelling {len(st.train_req)} train + {len(st.eval_req)} eval requests "
            f"with {len(st.names)} drafters ({', '.join(st.names)}) "
            f"at depth {cfg.label_depth}"
        )
        tick = _ticker(say, len(st.train_req) + len(st.eval_req), "labelled")
        train_rec = collect_labels(st.engine, st.train_req, st.stop, cfg.chat, st.spec, lambda i, _: tick(i))
        eval_rec = collect_labels(
            st.engine, st.eval_req, st.stop, cfg.chat, st.spec, lambda i, _: tick(len(st.train_req) + i)
        )
    with _timed(clock, "calibration_s"):
        say(
            f"timing {len(st.names)} drafters x {len(cfg.depths)} depths and plain decoding "
            f"on {cfg.calib_prompts} prompts"
        )
        merged = [(r.result, r.prompt_tokens) for r in train_rec if r.result is not None]
        costs = calibrate(
            st.engine,
            [ids for _, ids in st.train_req[: cfg.calib_prompts]],
            st.widths,
            cfg.depths,
            cfg.calib_tokens,
            merged_runs=merged,
            draft_vocab=cfg.draft_vocab,
        )
    with _timed(clock, "fit_s"):
        scheduler = fit_scheduler(train_rec, costs, st.spec, st.widths, cfg)
        scheduler.meta.update({**st.meta, "created": time.time()})
        scheduler.save(run.scheduler_file)
        scheduler = Scheduler.load(run.scheduler_file)  # evaluate what serving will load
    with _timed(clock, "replay_s"):
        fixed = fixed_policies(train_rec, costs, st.names)
        replayed = replay_policies(eval_rec, [ids for _, ids in st.eval_req], scheduler, fixed, cfg.seed)
    with _timed(clock, "real_s"):
        say(f"real engine runs of {list(cfg.real_policies)} on {len(st.eval_req)} eval requests")
        real, choices = real_policies(
            st.engine,
            [ids for _, ids in st.eval_req],
            st.stop,
            cfg.real_policies,
            scheduler,
            fixed,
            cfg.chat,
            _ticker(say, len(st.eval_req), "evaluated"),
        )
    out = build_report(run, cfg, scheduler, fixed, replayed, real, choices, train_rec, eval_rec, clock)
    _write_labels(run.scheduler_labels, train_rec, eval_rec)
    atomic_write_json(run.scheduler_report, out)
    plot_tokens_per_s(out, run.scheduler_plot)
    mark_complete(run.scheduler_dir, {"scheduler": run.scheduler_file.name, "report": f"../{run.scheduler_report.name}"})
    say(format_table(out))
    return out


def fit_scheduler(
    train: list[RequestRecord], costs, spec: FeatureSpec, widths: tuple[int, ...], cfg: SchedulerConfig
) -> Scheduler:
    """Fit the acceptance model on labelled requests and wrap it with the costs and fallback."""
    n, depth = costs.n_ssms, cfg.label_depth
    x = np.stack([r.features.vector() for r in train])
    y = np.stack([union_survival(r.accepts, n, depth).reshape(-1) for r in train])
    model = fit_linear(x, y, cfg.pca_components, cfg.ridge_alphas, passthrough=spec.head)
    fallback = best_fixed(train, costs)
    lookup = n - 1 if cfg.prompt_lookup else -1
    table: tuple[int, ...] = ()
    if cfg.stepwise_lookup and lookup >= 0:
        with_lookup = fallback if lookup in members(fallback.mask) else best_fixed(train, costs, containing=lookup)
        table = fit_ngram_depths(train, costs, with_lookup.mask, with_lookup.depth, lookup)
    return Scheduler(
        spec=spec,
        model=model,
        costs=costs,
        widths=tuple(widths[:depth]),
        expected_new_tokens=float(np.mean([r.new_tokens for r in train])),
        z_max=cfg.z_max,
        fallback=fallback,
        meta={"label_depth": depth, "train_requests": len(train)},
        margin=cfg.margin,
        draft_vocab=cfg.draft_vocab,
        prompt_lookup=cfg.prompt_lookup,
        lookup_depths=table,
    )


def build_report(run, cfg, scheduler, fixed, replayed, real, choices, train_rec, eval_rec, clock) -> dict:
    """The scheduler_report.json mapping."""
    policies = {}
    for name in ["learned", "learned_per_request", "oracle", "random", *fixed]:
        policies[name] = {
            "replay": summarize(replayed[name]),
            "real": summarize(real[name]) if name in real else None,
        }
        if name in fixed:
            policies[name]["candidate"] = fixed[name].name
    fixed_names = list(fixed)
    best_name = max(fixed_names, key=lambda n: policies[n]["replay"]["tokens_per_s"])
    learned = policies["learned"]["replay"]["tokens_per_s"]
    real_fixed = [n for n in fixed_names if n in real]
    best_real = max(real_fixed, key=lambda n: policies[n]["real"]["tokens_per_s"]) if real_fixed else None
    learned_real = policies["learned"]["real"]["tokens_per_s"] if "learned" in real else None
    headline = {
        "best_fixed_policy_replay": best_name,
        "learned_vs_best_fixed_replay": learned / policies[best_name]["replay"]["tokens_per_s"],
        "learned_vs_oracle_replay": learned / policies["oracle"]["replay"]["tokens_per_s"],
        "learned_per_request_vs_best_fixed_replay": (
            policies["learned_per_request"]["replay"]["tokens_per_s"] / policies[best_name]["replay"]["tokens_per_s"]
        ),
        "best_fixed_policy_real": best_real,
        "learned_vs_best_fixed_real": (
            learned_real / policies[best_real]["real"]["tokens_per_s"] if best_real and learned_real else None
        ),
    }
    same = [o.candidate == fixed["best_fixed"] for o in replayed["learned"]]
    headline["learned_agrees_with_best_fixed"] = sum(same) / max(1, len(same))
    # the real comparison settles the claim only if the replay-best fixed choice was run for real
    twins = [n for n in real_fixed if fixed[n] == fixed[best_name]]
    headline["real_runs_include_best_fixed"] = bool(twins)
    real_ok = not twins or learned_real is None or learned_real > policies[twins[0]]["real"]["tokens_per_s"]
    headline["learned_beats_best_fixed"] = headline["learned_vs_best_fixed_replay"] > 1.0 and real_ok
    headline["learned_vs_best_fixed_replay_ci95"] = paired_ratio_ci(replayed["learned"], replayed[best_name])
    if twins and "learned" in real:
        headline["learned_vs_best_fixed_real_ci95"] = paired_ratio_ci(real["learned"], real[twins[0]])
    return {
        "format": REPORT_FORMAT,
        "run_dir": str(run.root),
        "llm": {
            "ref": scheduler.meta.get("llm"),
            "dtype": scheduler.meta.get("dtype"),
            "ssm_dtype": scheduler.meta.get("ssm_dtype"),
            "draft_vocab": scheduler.draft_vocab,
        },
        "ssms": scheduler.meta.get("ssms"),
        "widths": list(scheduler.widths),
        "depths": list(scheduler.costs.depths),
        "config": cfg.to_dict(),
        "requests": {
            "train": len(train_rec),
            "eval": len(eval_rec),
            "mean_new_tokens_eval": float(np.mean([r.new_tokens for r in eval_rec])),
        },
        "method": (
            "replay: every policy walked step by step over the eval requests' full-information labels (per "
            "output position and drafter, the tokens it alone would have had accepted by a step starting there) "
            "with the measured cost model; learned_per_request: the learned choices without the per-match "
            "prompt-lookup lengths; real: the "
            f"engine run with the policy's choices ({', '.join(real)}), interleaved per request; tokens/s is "
            "the mean over requests of new tokens / wall time, prefill included; tau = tokens / LLM forwards"
        ),
        "policies": policies,
        "headline": headline,
        "scheduler_overhead": overhead(
            real.get("learned", []), [o for n, r in real.items() if n != "learned" for o in r]
        ),
        "fallbacks": _fallbacks(choices),
        "label_runs": {
            "eval_tau_all_merged": float(
                sum(r.new_tokens for r in eval_rec) / sum(len(r.result.records) for r in eval_rec)
            )
            if eval_rec and all(r.result is not None and r.result.records for r in eval_rec)
            else None
        },
        "threads": torch.get_num_threads(),
        "cost_model": {k: v for k, v in scheduler.costs.to_json().items() if k != "type"},
        "model": {
            "alpha": scheduler.model.alpha,
            "pca_components": int(scheduler.model.components.shape[0]),
            "features": scheduler.spec.dim,
            "fallback": scheduler.fallback.name,
            "lookup_depths": list(scheduler.lookup_depths),
        },
        "seconds": clock,
    }


def paired_ratio_ci(a, b, draws: int = 2000, seed: int = 0) -> dict:
    """Mean tokens/s of ``a`` over that of ``b`` on the same requests, with a 95 % bootstrap interval
    (requests resampled with replacement, pairs kept together) and the share of requests ``a`` won."""
    x = np.array([o.tokens_per_s for o in a])
    y = np.array([o.tokens_per_s for o in b])
    if not len(x) or len(x) != len(y) or y.mean() <= 0:
        return {}
    idx = np.random.default_rng(seed).integers(0, len(x), size=(draws, len(x)))
    ratios = x[idx].mean(axis=1) / np.maximum(y[idx].mean(axis=1), 1e-12)
    lo, hi = np.quantile(ratios, [0.025, 0.975])
    return {"ratio": float(x.mean() / y.mean()), "low": float(lo), "high": float(hi),
            "share_faster": float(np.mean(x > y))}


def overhead(outcomes, others=()) -> dict:
    """The scheduler's share of request latency in real learned-policy runs (``others``: the real
    runs of fixed policies, whose prefill does not return hidden states, for comparison)."""
    if not outcomes:
        return {"measured": False}
    frac = [o.plan_s / o.wall_s for o in outcomes if o.wall_s > 0]
    return {
        "prefill_s_learned": float(np.mean([o.prefill_s for o in outcomes])),
        "prefill_s_fixed": float(np.mean([o.prefill_s for o in others])) if others else None,
        "measured": True,
        "mean_ms": 1e3 * float(np.mean([o.plan_s for o in outcomes])),
        "max_ms": 1e3 * float(np.max([o.plan_s for o in outcomes])),
        "mean_fraction_of_latency": float(np.mean(frac)),
        "max_fraction_of_latency": float(np.max(frac)),
        "target_fraction": OVERHEAD_TARGET,
        "within_target": float(np.mean(frac)) < OVERHEAD_TARGET,
        "includes": "feature extraction (pooling, n-gram hashing), acceptance model, candidate scoring",
    }


def _fallbacks(choices) -> dict:
    reasons: dict[str, int] = {}
    for c in choices:
        if c.fallback:
            key = c.reason.split(" (")[0][:80]
            reasons[key] = reasons.get(key, 0) + 1
    return {"real_runs": sum(c.fallback for c in choices), "of": len(choices), "reasons": reasons}


def format_table(report: dict) -> str:
    """The report's policies as a text table."""
    rows = [("policy", "choice", "tau", "tok/s replay", "tok/s real", "draft s/req")]
    for name, p in report["policies"].items():
        real = p.get("real")
        rows.append(
            (
                name,
                p.get("candidate", "per request"),
                f"{p['replay']['tau']:.2f}",
                f"{p['replay']['tokens_per_s']:.2f}",
                f"{real['tokens_per_s']:.2f}" if real else "-",
                f"{p['replay']['draft_s_per_request']:.3f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    h, o = report["headline"], report["scheduler_overhead"]
    lines.append(
        f"learned/best fixed ({h['best_fixed_policy_replay']}) "
        f"replay {h['learned_vs_best_fixed_replay']:.3f}; "
        f"real {_fmt(h['learned_vs_best_fixed_real'])}{_ci(h.get('learned_vs_best_fixed_real_ci95'))}; "
        f"learned/oracle {h['learned_vs_oracle_replay']:.3f}; "
        f"scheduler overhead {_fmt(100 * o['mean_fraction_of_latency']) if o.get('measured') else '-'} %"
    )
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ci(c: dict | None) -> str:
    return f" (95 % CI {c['low']:.3f}-{c['high']:.3f}, faster on {100 * c['share_faster']:.0f} %)" if c else ""


def _warm_up(engine: SpeculativeEngine, ids: list[int], eos: frozenset[int]) -> None:
    """First calls pay for lazy initialisation; keep them out of every timing."""
    stop = StopCriteria(max_new_tokens=4, eos_token_ids=eos)
    engine.generate(ids, stop, record=True)
    engine.generate(ids, stop, active=[], record=True)


def _ticker(say: Callable[[str], None], total: int, verb: str) -> Callable[[int], None]:
    start = time.perf_counter()
    step = max(1, total // 10)

    def tick(i: int) -> None:
        if (i + 1) % step == 0 or i + 1 == total:
            say(f"{verb} {i + 1}/{total} ({time.perf_counter() - start:.0f} s)")

    return tick


def _write_labels(path: Path, train: list[RequestRecord], evals: list[RequestRecord]) -> None:
    import json

    lines = [
        json.dumps({"split": s, **r.to_json()})
        for s, recs in (("train", train), ("eval", evals))
        for r in recs
    ]
    atomic_write_text(path, "\n".join(lines) + "\n")
