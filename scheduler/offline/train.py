"""`boosttune train-scheduler RUN_DIR`: labels → costs → fit → evaluate → scheduler.json + report.

Writes::

    RUN_DIR/scheduler/scheduler.json     the scheduler (persist.py format), loaded at serve time
    RUN_DIR/scheduler/complete.json      written last (`boosttune export` ships this directory)
    RUN_DIR/scheduler_report.json        every policy's τ, tokens/s and draft cost on eval requests
    RUN_DIR/scheduler_report.png         tokens/s by policy
    RUN_DIR/scheduler_labels.jsonl       the labelled requests (features, per-step acceptances)
    RUN_DIR/scheduler_costs.json         the measured cost table, with what it was measured for

Steps: load the run's LLM and SSMs (and its feature head, ``scheduler.feature_head``); label the train and eval prompts (every SSM merged at the
label depth, full information); time every (SSM, depth) and plain decoding (cost model); fit the
acceptance model on the train requests; replay every policy on the eval requests and run the
``real_policies`` through the engine, interleaved per request.

Costs are wall-clock timings, so two measurements differ and so may the choices fitted on them: the
table is saved as soon as it is measured, and a later fit with the same settings (a resumed
`boosttune train` whose scheduler was interrupted, or a retrain) uses that first table instead of
timing again. The report says which (``costs.reused``); delete scheduler_costs.json to time again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from boosttune.assemble import engine_from_models
from boosttune.config import SchedulerConfig
from boosttune.core.files import MARKER, atomic_write_json, atomic_write_text, is_complete, mark_complete
from boosttune.core.models import (
    LoadedModel,
    eos_token_ids,
    load_llm_and_ssms,
    load_ssms,
    model_vocab_size,
    parse_dtype,
)
from boosttune.core.prompts import encode_prompt, read_prompts
from boosttune.core.rundir import RunDir
from boosttune.scheduler.calibrate import calibrate
from boosttune.scheduler.costs import CostModel
from boosttune.scheduler.features import FeatureSpec
from boosttune.scheduler.model import MIN_FIT_REQUESTS, fit_linear
from boosttune.scheduler.offline.crossval import FoldReplay, Verdict, cross_validate, verdict
from boosttune.scheduler.offline.evaluate import (
    best_of,
    fixed_policies,
    real_policies,
    replay,
    replay_policies,
    replayed,
)
from boosttune.scheduler.offline.labels import RequestRecord, collect_labels
from boosttune.scheduler.offline.plot import plot_tokens_per_s
from boosttune.scheduler.offline.report import build_report, format_table
from boosttune.scheduler.offline.stepwise import fit_ngram_depths
from boosttune.scheduler.policy import Candidate, Scheduler, candidates, default_drafters
from boosttune.scheduler.subsets import members, union_survival
from boosttune.serving.draft_vocab import load_ranking
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.lookup import LOOKUP_NAME
from boosttune.serving.phrases import load_phrases
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig


def resolve_widths(cfg: SchedulerConfig, tree: dict | None) -> tuple[int, ...]:
    """The expansion widths: the config's, else the run's expansion tree's, else the default tree's."""
    if cfg.widths is not None:
        return cfg.widths
    if tree and tree.get("kind", "expansion") == "expansion" and tree.get("widths"):
        return tuple(int(w) for w in tree["widths"])
    return TreeConfig().widths


def split_prompts(cfg: SchedulerConfig) -> tuple[list, list]:
    """(train, eval) prompts: a seeded split of ``prompts``, or ``prompts`` and ``eval_prompts``."""
    if cfg.prompts is None:
        raise ValueError(
            "scheduler.prompts is not set: give a JSONL/text file of prompts held out from SSM "
            "training (e.g. MT-bench's question.jsonl) in the config's scheduler: section or --prompts"
        )
    prompts = read_prompts(cfg.prompts)[cfg.skip :][: cfg.limit or None]
    if cfg.eval_prompts is not None:
        return prompts, read_prompts(cfg.eval_prompts)[: cfg.eval_limit or None]
    order = list(range(len(prompts)))
    random.Random(cfg.seed).shuffle(order)
    n_train = round(len(prompts) * cfg.train_fraction)
    return [prompts[i] for i in order[:n_train]], [prompts[i] for i in order[n_train:]]


@dataclass
class RunModels:
    """What the scheduler takes of a training run: `boosttune train` hands it over (with the LLM it
    holds), `boosttune train-scheduler` reads it from the run's report (:meth:`of_run`)."""

    llm_ref: str
    """The LLM's reference (``llm.ref``)."""
    llm_dtype: str
    """The run's LLM dtype (report.json's ``llm.dtype``): the scheduler's unless ``scheduler.dtype``."""
    tree: dict | None
    """The run's tree (report.json's ``tree``): its widths unless ``scheduler.widths``."""
    ssm_dirs: list[Path]
    """The trained SSMs, in stage order."""
    llm: Callable[[torch.dtype], LoadedModel] | None = None
    """The LLM in a dtype, from a process that holds it (None: loaded from ``llm_ref``)."""
    device: str = "cpu"
    """Where ``llm_ref`` loads, with the drafters beside it, so the costs are timed on that device (a
    handed-over ``llm``: its own device)."""

    @classmethod
    def of_run(cls, run: RunDir, device: str = "cpu") -> RunModels:
        """A finished run's, from its report.json, to be loaded on ``device``."""
        report = run.read_report()
        return cls(llm_ref=report["llm"]["ref"], llm_dtype=report["llm"].get("dtype") or "fp32",
                   tree=report.get("tree"), ssm_dirs=run.ssm_dirs(), device=device)


def _drafter_dirs(run: RunDir, cfg: SchedulerConfig, models: RunModels) -> list[Path]:
    """The complete SSMs, then the feature heads when they take part (``scheduler.feature_head``)."""
    dirs = [d for d in models.ssm_dirs if is_complete(d)]
    if cfg.feature_head:
        dirs += run.feature_dirs()
    return dirs


def scheduler_settings(run: RunDir, cfg: SchedulerConfig, models: RunModels) -> dict:
    """What a scheduler is fitted from besides its drafters' weights (JSON types). Its completion marker
    records them; `boosttune train` keeps a finished scheduler only when they are the same."""
    return json.loads(json.dumps({"config": cfg.to_dict(), "widths": list(resolve_widths(cfg, models.tree)),
                                  "dtype": cfg.dtype or models.llm_dtype, "llm": models.llm_ref,
                                  "drafters": [d.name for d in _drafter_dirs(run, cfg, models)]}))


def finished_scheduler(run: RunDir, cfg: SchedulerConfig, models: RunModels) -> dict | None:
    """The report of the run's scheduler if it is complete and was fitted with these settings (None:
    none, or another)."""
    marker = run.scheduler_dir / MARKER
    if not marker.is_file() or not run.scheduler_report.is_file():
        return None
    if json.loads(marker.read_text()).get("settings") != scheduler_settings(run, cfg, models):
        return None
    return json.loads(run.scheduler_report.read_text())


COSTS_FILE = "scheduler_costs.json"
"""The measured cost table in the run directory (beside scheduler_report.json)."""


def _costs_key(run: RunDir, cfg: SchedulerConfig, models: RunModels) -> dict:
    """What a cost table was measured for: the scheduler's settings, the threads timing ran with and,
    off the CPU, the device (left out on the CPU so that tables measured before it was recorded still match)."""
    key = {**scheduler_settings(run, cfg, models), "threads": torch.get_num_threads()}
    if models.llm is None and models.device != "cpu":
        key["device"] = models.device
    return key


def saved_costs(run: RunDir, key: dict) -> CostModel | None:
    """The cost table an earlier fit measured for ``key`` (None: none, another, or an unreadable file)."""
    try:
        saved = json.loads((run.root / COSTS_FILE).read_text())
        return CostModel.from_json(saved["costs"]) if saved.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


def _setup(run: RunDir, cfg: SchedulerConfig, models: RunModels) -> _Setup:
    """Check the run and the prompts, load the SSMs (and the LLM unless handed over), encode the requests,
    warm up."""
    if not any(is_complete(d) for d in models.ssm_dirs):
        raise ValueError(f"{run}: no complete SSMs under ssms/; the scheduler needs trained SSMs")
    widths = resolve_widths(cfg, models.tree)
    ssm_paths = _drafter_dirs(run, cfg, models)
    if set(run.feature_dirs()) & set(ssm_paths) and len(widths[: cfg.label_depth]) > 2:
        raise ValueError(f"scheduler.widths: the run's feature head is labelled on trees of at most two levels, "
                         f"got {list(widths[: cfg.label_depth])}; set scheduler.widths (e.g. [3]) or "
                         "scheduler.feature_head: false")
    train_prompts, eval_prompts = split_prompts(cfg)
    if len(train_prompts) < 3 or not eval_prompts:
        raise ValueError(
            f"scheduler: {len(train_prompts)} train and {len(eval_prompts)} eval prompts; need >= 3 "
            "and >= 1 (raise scheduler.limit or change scheduler.train_fraction)"
        )
    dtype = cfg.dtype or models.llm_dtype
    ssm_dtype = cfg.ssm_dtype or dtype
    if models.llm is None:
        llm, ssms = load_llm_and_ssms(models.llm_ref, [str(p) for p in ssm_paths], dtype, ssm_dtype, models.device)
    else:
        llm = models.llm(parse_dtype(dtype))
        ssms = load_ssms(llm, ssm_paths, ssm_dtype)
    ranking = None
    if cfg.draft_vocab:
        if not run.draft_vocab_path.is_file():
            raise ValueError(f"scheduler.draft_vocab {cfg.draft_vocab}: {run} has no token ranking "
                             f"({run.draft_vocab_path.name}); `boosttune train-scheduler` counts it from the run's "
                             "teacher outputs, or use the whole vocabulary (draft_vocab 0)")
        ranking = load_ranking(run.draft_vocab_path)
    label_tree = TreeConfig(widths=widths[: cfg.label_depth], draft_vocab=cfg.draft_vocab)
    lookup = cfg.label_depth if cfg.prompt_lookup else 0
    # prompt lookup drafts the run's phrase table as the bundle will serve it (export ships the table)
    phrases = (load_phrases(run.phrases_path, model_vocab_size(llm.model))
               if lookup and run.phrases_path.is_file() else None)
    named = {path.name: s.model for path, s in zip(ssm_paths, ssms, strict=True)}
    engine = engine_from_models(llm.model, named, label_tree, ranking=ranking, lookup=lookup, phrases=phrases,
                                kinds={path.name: s.kind for path, s in zip(ssm_paths, ssms, strict=True)})
    hidden = int(llm.model.get_output_embeddings().weight.shape[1])
    def encoded_of(prompts: list) -> list[tuple[str, list[int]]]:
        pairs = [(p.id, encode_prompt(llm.tokenizer, p, chat=cfg.chat)) for p in prompts]
        return [(i, ids) for i, ids in pairs if not cfg.max_prompt_tokens or len(ids) <= cfg.max_prompt_tokens]

    train_req, eval_req = encoded_of(train_prompts), encoded_of(eval_prompts)
    if len(train_req) < 3 or not eval_req:
        raise ValueError(f"scheduler.max_prompt_tokens: {len(train_req)} train and {len(eval_req)} eval prompts "
                         "are short enough; need >= 3 and >= 1 (raise it or scheduler.limit)")
    encoded = train_req + eval_req
    eos = eos_token_ids(llm)
    _warm_up(engine, encoded[0][1], eos)
    names = list(engine.drafters)
    return _Setup(
        engine=engine,
        names=names,
        spec=FeatureSpec(hidden_size=hidden, ngram_buckets=cfg.ngram_buckets, lookup=cfg.prompt_lookup),
        widths=widths,
        meta={"llm": models.llm_ref, "dtype": dtype, "ssm_dtype": ssm_dtype, "device": str(llm.model.device), "ssms": names,
              "draft_vocab": cfg.draft_vocab, "prompt_lookup": cfg.prompt_lookup},
        train_req=train_req,
        eval_req=eval_req,
        stop=StopCriteria(max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos),
    )


@contextlib.contextmanager
def _timed(clock: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    clock[key] = time.perf_counter() - start


def train_scheduler(
    run_dir: str | Path, cfg: SchedulerConfig, log: Callable[[str], None] | None = None,
    models: RunModels | None = None,
) -> dict:
    """Train and evaluate the scheduler of a run; writes its files and returns the report as written.

    Args:
        run_dir: a `boosttune train` run directory (complete SSMs).
        cfg: what to do (see ``SchedulerConfig``).
        log: progress lines (default: stderr).
        models: the run's LLM and SSMs (default: read from its report.json, the LLM loaded here).
    """
    say = log or (lambda s: print(f"[train-scheduler] {s}", file=sys.stderr, flush=True))
    run, clock = RunDir(run_dir), {}
    models = models or RunModels.of_run(run)
    (run.scheduler_dir / MARKER).unlink(missing_ok=True)  # a retrain is incomplete until it finishes
    with _timed(clock, "load_s"):
        st = _setup(run, cfg, models)
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
        key = _costs_key(run, cfg, models)
        costs = saved_costs(run, key)
        reused = costs is not None
        if reused:
            say(f"costs: the table measured before, {run.root / COSTS_FILE} (the same settings; delete it to time again)")
        else:
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
            atomic_write_json(run.root / COSTS_FILE, {"key": key, "costs": costs.to_json(), "measured": time.time()})
            costs = CostModel.from_json(costs.to_json())  # as a later fit reads it: both fit on the same numbers
    with _timed(clock, "fit_s"):
        scheduler = fit_scheduler(train_rec, costs, st.spec, st.widths, cfg, st.names)
        scheduler.meta.update({**st.meta, "created": time.time()})
        scheduler.save(run.scheduler_file)
        scheduler = Scheduler.load(run.scheduler_file)  # evaluate what serving will load
    with _timed(clock, "replay_s"):
        fixed = fixed_policies(train_rec, costs, st.names, cfg.margin)
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
    out["costs"] = {"file": COSTS_FILE, "reused": reused}  # reused: measured by an earlier, interrupted fit
    _write_labels(run.scheduler_labels, train_rec, eval_rec)
    atomic_write_json(run.scheduler_report, out)
    plot_tokens_per_s(out, run.scheduler_plot)
    mark_complete(run.scheduler_dir, {"scheduler": run.scheduler_file.name, "report": f"../{run.scheduler_report.name}",
                                      "settings": scheduler_settings(run, cfg, models)})
    say(format_table(out))
    return json.loads(json.dumps(out))  # as the file holds it (tuples as lists), so a reader gets the same


def fit_scheduler(
    train: list[RequestRecord], costs, spec: FeatureSpec, widths: tuple[int, ...], cfg: SchedulerConfig,
    drafters: Sequence[str] = (),
) -> Scheduler:
    """Fit the acceptance model and the per-match lookup table on labelled requests, wrap them with
    the costs and fallback, and keep each learned part only where ``cfg.cv_folds``-fold
    cross-validation shows it pays (``crossval.py``; the evidence goes to ``meta["crossval"]``);
    ``drafters``: the names of the labels' columns (empty: ``default_drafters``)."""
    names = tuple(drafters) or default_drafters(costs.n_ssms, cfg.prompt_lookup)
    k, n = cfg.cv_folds, len(train)
    fixed = _FixedChoices(train, costs, cfg.margin)
    full = _fit(train, costs, spec, widths, cfg, names, cfg.stepwise_lookup, fixed, range(n))
    if not k:
        return full
    per_request = verdict(*cross_validate(n, k, _per_request_replay(train, costs, fixed, spec, widths, cfg, names),
                                         min_fit=MIN_FIT_REQUESTS), cfg.margin)
    table = Verdict(adopted=False)
    if full.lookup_depths:
        table = verdict(*cross_validate(n, k, _table_replay(train, costs, fixed, full.lookup_index)), cfg.margin)
    meta = {**full.meta, "crossval": {"folds": min(k, n), "per_request": per_request.to_json(),
                                      "lookup_depths": table.to_json(), "fitted_lookup_depths": list(full.lookup_depths)}}
    return dataclasses.replace(full, per_request=per_request.adopted, meta=meta,
                               lookup_depths=full.lookup_depths if table.adopted else ())


def _fit(
    train: Sequence[RequestRecord], costs, spec: FeatureSpec, widths: tuple[int, ...], cfg: SchedulerConfig,
    names: tuple[str, ...], stepwise: bool, fixed: _FixedChoices, rows: Sequence[int],
) -> Scheduler:
    """The scheduler fitted on ``train`` (the requests ``rows`` of ``fixed``), every learned part
    served (the per-match table if ``stepwise``)."""
    n, depth = costs.n_ssms, cfg.label_depth
    x = np.stack([r.features.vector() for r in train])
    y = np.stack([union_survival(r.accepts, n, depth).reshape(-1) for r in train])
    model = fit_linear(x, y, cfg.pca_components, cfg.ridge_alphas, passthrough=spec.head)
    fallback = fixed.best(rows)
    lookup = names.index(LOOKUP_NAME) if LOOKUP_NAME in names else -1
    table: tuple[int, ...] = ()
    if stepwise and lookup >= 0:
        cand = fixed.lookup_base(rows, fallback, lookup)
        table = fit_ngram_depths(train, costs, cand.mask, cand.depth, lookup)
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
        drafters=names,
        fixed_tau=fixed.tau(rows),
    )


class _FixedChoices:
    """The best fixed choices and their mean τ on any subset of the training requests, from one replay
    of each request under each candidate (``evaluate.replayed``): folds refit them without replaying again."""

    def __init__(self, train: Sequence[RequestRecord], costs, margin: float = 0.0) -> None:
        self.cands = candidates(costs.n_ssms, costs.depths)
        self.rates, self.taus = replayed(train, self.cands, costs)
        self.margin = margin

    def tau(self, rows: Sequence[int]) -> tuple[float, ...]:
        """Every candidate's mean replayed τ on the requests ``rows`` (``Scheduler.fixed_tau``)."""
        return tuple(float(t) for t in self.taus[list(rows)].mean(axis=0))

    def best(self, rows: Sequence[int]) -> Candidate:
        """``evaluate.best_fixed`` on the requests ``rows``."""
        return best_of(self.rates[list(rows)], self.cands, margin=self.margin)

    def lookup_base(self, rows: Sequence[int], fallback: Candidate, lookup: int) -> Candidate:
        """What the per-match table refines on ``rows``: ``fallback`` if it drafts with prompt
        lookup, else the best fixed choice that does."""
        return (fallback if lookup in members(fallback.mask)
                else best_of(self.rates[list(rows)], self.cands, lookup, self.margin))


def _per_request_replay(train, costs, fixed: _FixedChoices, spec, widths, cfg, names) -> FoldReplay:
    """Held out: the per-request choice (no per-match table) of a fit without the fold, beside that
    fit's fallback."""

    def run(rest: list[int], held: list[int]):
        fold = _fit([train[i] for i in rest], costs, spec, widths, cfg, names, False, fixed, rest)
        # the choice reads only the prompt's length; labels keep its length, not its tokens
        chosen = [fold.choose(range(train[i].prompt_tokens), train[i].features).candidate for i in held]
        return ([replay(train[i], c, costs) for i, c in zip(held, chosen, strict=True)],
                [replay(train[i], fold.fallback, costs) for i in held])

    return run


def _table_replay(train, costs, fixed: _FixedChoices, lookup: int) -> FoldReplay:
    """Held out: the per-match table fitted without the fold, beside the fixed chain it refines."""

    def run(rest: list[int], held: list[int]):
        cand = fixed.lookup_base(rest, fixed.best(rest), lookup)
        table = fit_ngram_depths([train[i] for i in rest], costs, cand.mask, cand.depth, lookup)
        return ([replay(train[i], Candidate(cand.mask, cand.depth, table), costs) for i in held],
                [replay(train[i], cand, costs) for i in held])

    return run


def _warm_up(engine: SpeculativeEngine, ids: list[int], eos: frozenset[int]) -> None:
    """First calls pay for lazy initialisation; keep them out of every timing."""
    stop = StopCriteria(max_new_tokens=4, eos_token_ids=eos)
    engine.generate(ids, stop, record=True)
    engine.generate(ids, stop, plan=Plan(), record=True)


def _ticker(say: Callable[[str], None], total: int, verb: str) -> Callable[[int], None]:
    start = time.perf_counter()
    step = max(1, total // 10)

    def tick(i: int) -> None:
        if (i + 1) % step == 0 or i + 1 == total:
            say(f"{verb} {i + 1}/{total} ({time.perf_counter() - start:.0f} s)")

    return tick


def _write_labels(path: Path, train: list[RequestRecord], evals: list[RequestRecord]) -> None:
    lines = [
        json.dumps({"split": s, **r.to_json()})
        for s, recs in (("train", train), ("eval", evals))
        for r in recs
    ]
    atomic_write_text(path, "\n".join(lines) + "\n")
