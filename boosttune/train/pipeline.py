"""`boosttune train`: prompts -> teacher shards -> N boost-tuned SSMs -> evaluation -> scheduler.

:func:`train` reads top to bottom: each phase takes what the earlier ones returned (the prompt set and
teacher samples as :class:`TeacherData`, the stages' summaries, the LLM as one :class:`RunLLM`). Every
phase also leaves files in the run directory (layout in :mod:`boosttune.core.rundir`) and skips work
whose files are already complete, so re-running the same command after any interruption continues
where it stopped; those files are a cache a phase checks, not the way phases talk. Multi-process runs (torchrun, SLURM, or ``optim.devices > 1`` on one machine)
run this same function on every rank (:mod:`boosttune.dist`).

Boost-tuning (SpecInfer, arXiv 2305.09781 §4.2): SSM 1 trains on every training sample; after
each stage, the samples that SSM matches (:mod:`boosttune.train.matching`) leave the pool and the next
SSM trains on the rest (``boost.mode: match``). ``quantile`` drops each pool's best-covered share
instead, ``weighted`` keeps every sample and weighs down the tokens the earlier SSMs already cover
(:mod:`boosttune.train.coverage`), ``independent`` trains every SSM on all samples (the ablation). Every
SSM starts from the same initialisation (``ssm.*``) with its own seed. Each stage caches its SSM's ranks
of the LLM's tokens, so its summary's ``union_coverage`` of SSMs 1..k costs one SSM's forward.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import shutil
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from boosttune.config import (
    BoostConfig,
    ConfigError,
    FeatureConfig,
    TrainConfig,
    dump_yaml,
    load_config,
    to_dict,
)
from boosttune.core.files import (
    MARKER,
    atomic_write_json,
    atomic_write_text,
    is_complete,
    mark_complete,
    writing,
)
from boosttune.core.kind_file import declare_kind
from boosttune.core.low_rank import Factors, cut_to_rank, save_factors
from boosttune.core.models import (
    LoadedModel,
    dtype_name,
    eos_token_ids,
    load_model,
    model_vocab_size,
    parse_dtype,
    resolve_model_path,
)
from boosttune.core.rundir import REPORT_FORMAT, RunDir, feature_name
from boosttune.serving.kinds import FeatureKind, SSMKind
from boosttune.train import dist
from boosttune.train.coverage import (
    coverage_summary,
    lookup_rank_rows,
    remove_best_covered,
    sample_union_coverage,
    token_weights,
    union_rank_rows,
)
from boosttune.train.distill import Sample, samples_from_teacher
from boosttune.train.draft_ranking import ensure_counted
from boosttune.train.faults import crash_point
from boosttune.train.matching import is_match, summarize_agreement, teacher_forced_scores
from boosttune.train.sources import TrainPrompt, collect_prompts, default_seeds
from boosttune.train.teacher.backends import backend_for, run_teacher
from boosttune.train.teacher.shards import load_features, load_teacher, remove_shard_temporaries

# Fields that may differ when a run is resumed (how it runs, not what it computes).
_RESUMABLE_CHANGES = ("optim.devices", "optim.num_nodes", "optim.accelerator", "optim.strategy", "optim.logger",
                      "optim.checkpoint_every", "optim.max_minutes", "llm.device", "eval.", "tree.", "scheduler.",
                      "teacher.endpoint", "teacher.concurrency", "teacher.api_key_env", "feature.", "eagle3.")
# Teacher fields that say where and how the continuations are asked for, not what they are.
_TEACHER_HOW = ("teacher.reuse_from", "teacher.endpoint", "teacher.concurrency", "teacher.api_key_env")
PROFILE_DEPTHS = 8


def _log(msg: str) -> None:
    if dist.is_main():
        print(f"[boosttune train] {msg}", flush=True)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_or_save_config(cfg: TrainConfig, run: RunDir) -> None:
    """First run: save the resolved config. Resume: refuse changes that would alter the results, and
    write the file only when it changes (a finished run can be re-opened read-only)."""
    path = run.config_path
    text = dump_yaml(cfg)
    if path.exists():
        if path.read_text(encoding="utf-8") == text:
            return
        old = load_config(path)
        a, b = _flatten(to_dict(old)), _flatten(to_dict(cfg))
        changed = [k for k in sorted(a.keys() | b.keys())
                   if a.get(k) != b.get(k) and not k.startswith(_RESUMABLE_CHANGES)]
        if changed:
            k = changed[0]
            raise ConfigError(
                f"{k}: this run directory was started with {k}={a.get(k)!r}, now {b.get(k)!r}; resume with the "
                f"same settings or use a new --run-dir ({len(changed)} field(s) differ: {', '.join(changed[:5])})")
    if dist.is_main():
        atomic_write_text(path, text)


def preflight(cfg: TrainConfig) -> None:
    """Checks that need no model weights: models resolvable, optional packages present."""
    import importlib.util

    paths = {}
    for where, ref in (("llm.ref", cfg.llm.ref), ("ssm.init", cfg.ssm.init if cfg.ssm.init != "derived" else None)):
        if ref is not None:
            try:
                paths[where] = resolve_model_path(ref)
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from None
    if "ssm.init" in paths:  # tokenizers only: a vocabulary mismatch fails before any weights load
        from transformers import AutoConfig, AutoTokenizer

        from boosttune.core.models import check_same_vocabulary

        toks = {w: AutoTokenizer.from_pretrained(p) for w, p in paths.items()}
        sizes = {w: AutoConfig.from_pretrained(p).vocab_size for w, p in paths.items()}
        try:
            check_same_vocabulary(toks["llm.ref"], toks["ssm.init"], sizes["llm.ref"], sizes["ssm.init"], cfg.ssm.init)
        except ValueError as e:
            raise ConfigError(f"ssm.init: {e}") from None
    if cfg.optim.strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(f"optim.strategy: {cfg.optim.strategy} needs DeepSpeed: pip install 'boosttune[deepspeed]'")
    if cfg.lora.enabled and importlib.util.find_spec("peft") is None:
        raise ConfigError("lora.enabled: needs PEFT: pip install 'boosttune[peft]'")
    if cfg.teacher.reuse_from:
        check_reuse(cfg)
    if cfg.scheduler.prompts and not Path(cfg.scheduler.prompts).is_file():
        raise ConfigError(f"scheduler.prompts: file not found: {cfg.scheduler.prompts}")


def check_reuse(cfg: TrainConfig) -> None:
    """``teacher.reuse_from`` needs a run made with the same LLM, prompt and teacher settings."""
    src = RunDir(cfg.teacher.reuse_from)
    theirs = _flatten(to_dict(load_config(src.config_path)))
    ours = _flatten(to_dict(cfg))
    for k in sorted(ours):
        if k.startswith(("llm.ref", "llm.teacher_dtype", "prompts.", "teacher.")) and k not in _TEACHER_HOW \
                and theirs.get(k) != ours[k]:
            raise ConfigError(f"teacher.reuse_from: {src} was made with {k}={theirs.get(k)!r}, this run has {ours[k]!r}")


def reuse_teacher(cfg: TrainConfig, run: RunDir) -> None:
    """Hard-link another run's prompt set and teacher shards into ``run``."""
    src = RunDir(cfg.teacher.reuse_from)
    if is_complete(run.prompts_dir):
        return
    # the prompts last: their marker says the reuse is complete
    for theirs, ours in ((src.teacher_dir, run.teacher_dir), (src.prompts_dir, run.prompts_dir)):
        shutil.rmtree(ours, ignore_errors=True)
        shutil.copytree(theirs, ours, copy_function=link_or_copy, ignore=shutil.ignore_patterns(".*.tmp"))


def link_or_copy(src: str, dst: str) -> None:
    """``shutil.copytree``'s copy function that hard-links (a copy where the file system cannot)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _device(cfg: TrainConfig) -> str:
    if cfg.llm.device != "auto":
        return cfg.llm.device
    return f"cuda:{dist.local_rank()}" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------------- LLM
def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` with its parameters in ``dtype``: what ``from_pretrained(dtype=...)`` gives when
    the weights were loaded in fp32 (every fp16 and bf16 value is one in fp32, and the cast rounds as the
    loader does). Buffers keep their dtype as the loader keeps them: the rotary ``inv_freq`` stays fp32 (cast
    too, it changes the logits; tests/test_train_units.py compares the two)."""
    out = copy.deepcopy(model)
    for p in out.parameters():  # tied weights are one parameter: they stay tied
        p.data = p.data.to(dtype)
    out.config.dtype = dtype
    return out


class RunLLM:
    """The run's LLM, loaded once per process (one :func:`load_model`) and handed to each phase in the dtype
    and on the device that phase always used: the teacher in ``llm.teacher_dtype`` on ``llm.device``, the
    feature head's features in fp32 there, evaluation and the scheduler in theirs on the CPU.

    It is loaded in the dtype every phase of this process uses, else in fp32 on the CPU, from which the
    other dtypes are cast (:func:`cast_parameters`, exact); one cast copy is kept at a time. Moves between
    devices are in place and lossless. Each hand-out has the attention implementation it was loaded with
    (the teacher sets its own)."""

    def __init__(self, ref: str, dtypes: Sequence[torch.dtype], device: str):
        one = len(set(dtypes)) == 1
        self._dtype = dtypes[0] if one else torch.float32
        self._loaded: LoadedModel | None = load_model(ref, self._dtype, device=device if one else "cpu")
        self._attn = self._loaded.model.config._attn_implementation
        self._cast: LoadedModel | None = None

    def get(self, dtype: torch.dtype, device: str) -> LoadedModel:
        """The LLM in ``dtype`` on ``device``."""
        assert self._loaded is not None, "the LLM was released"
        if dtype == self._dtype:
            self._cast = None
            out = self._loaded
        else:
            if self._cast is None or self._cast.model.dtype != dtype:
                self._cast = None  # the previous copy goes first
                self._loaded.model.to("cpu")  # the copy is made on the host, never beside it on an accelerator
                self._cast = replace(self._loaded, model=cast_parameters(self._loaded.model, dtype))
            out = self._cast
        out.model.to(device)
        out.model.config._attn_implementation = self._attn
        return out

    def park(self) -> None:
        """While the SSMs train: cast copies dropped and the LLM off any accelerator (kept in host memory:
        the feature head, evaluation and the scheduler need it again)."""
        self._cast = None
        if self._loaded is not None:
            self._loaded.model.to("cpu")

    def release(self) -> None:
        """No later phase of this process needs the LLM (ranks other than 0 after the SSMs' start)."""
        self._loaded = self._cast = None


def _llm_dtypes(cfg: TrainConfig) -> list[torch.dtype]:
    """The LLM's dtype in each phase this process runs, first the teacher's (later phases run on rank 0)."""
    dtypes = [parse_dtype(cfg.llm.teacher_dtype, _device(cfg))]
    if dist.is_main():
        if cfg.feature.enabled or cfg.eagle3.enabled:
            dtypes.append(torch.float32)  # the heads are built from, and trained on features of, the fp32 LLM
        if cfg.eval.enabled:
            dtypes.append(parse_dtype(cfg.llm.eval_dtype))
        if cfg.scheduler.prompts:
            dtypes.append(parse_dtype(cfg.scheduler.dtype or cfg.llm.eval_dtype))
    return dtypes


# ------------------------------------------------------------------------------------------ prompts
def _split(n: int, held_out: float) -> int:
    h = int(round(n * held_out)) if held_out < 1 else int(held_out)
    return min(max(h, 0), max(n - 1, 0))


def build_prompts(cfg: TrainConfig, run: RunDir, llm) -> dict:
    """Rank 0 writes prompts/prompts.jsonl (shuffled; the last ``held_out`` are held out)."""
    info = run.prompts_info()
    if info is not None:
        return info
    prompts = collect_prompts(cfg.prompts, llm.tokenizer)
    grown = 0
    if cfg.prompts.grow:
        from boosttune.train.grow import grow_prompts

        llm.model.config._attn_implementation = cfg.teacher.attn_implementation
        new = grow_prompts(llm.model, llm.tokenizer, default_seeds(), cfg.prompts.grow, eos_token_ids(llm),
                           seed=cfg.prompts.shuffle_seed, batch_size=cfg.teacher.batch_size,
                           backend=backend_for(cfg.teacher).decoder)
        from boosttune.core.prompts import encode_prompt

        for p in new:
            ids = encode_prompt(llm.tokenizer, p)
            if len(ids) <= cfg.prompts.max_prompt_tokens:
                prompts.append(TrainPrompt(id=p.id, source="grown", category=p.category, chat=True, input_ids=ids,
                                           text=p.text))
                grown += 1
    if len(prompts) < 2:
        raise ConfigError("prompts.sources: fewer than 2 prompts were found; add sources or raise limits")
    random.Random(cfg.prompts.shuffle_seed).shuffle(prompts)
    held = _split(len(prompts), cfg.prompts.held_out)
    by_source: dict[str, int] = {}
    for p in prompts:
        by_source[p.source] = by_source.get(p.source, 0) + 1
    info = {"count": len(prompts), "train": len(prompts) - held, "held_out": held, "grown": grown,
            "by_source": by_source}
    atomic_write_text(run.prompts_file, "".join(p.to_json() + "\n" for p in prompts))
    mark_complete(run.prompts_dir, info)
    return info


def read_prompts_file(run: RunDir) -> list[TrainPrompt]:
    # split on "\n" only: str.splitlines also splits at U+2028, U+0085 ..., which JSON strings may hold
    text = run.prompts_file.read_text(encoding="utf-8")
    return [TrainPrompt.from_json(x) for x in text.split("\n") if x.strip()]


# ------------------------------------------------------------------------------------------ teacher
def teacher_phase(cfg: TrainConfig, run: RunDir, llm, prompts: list[TrainPrompt]) -> dict:
    llm.model.config._attn_implementation = cfg.teacher.attn_implementation
    with writing(run.teacher_dir):  # a shard's safetensors failing on a full disk names the shards' directory
        stats = run_teacher(llm.model, llm.tokenizer, prompts, cfg.teacher, run, eos_token_ids(llm), rank=dist.rank(),
                            world=dist.world_size(), seed=cfg.optim.seed, features=cfg.feature.enabled)
    if stats["tokens"]:
        path = run.teacher_stats(dist.rank())
        old = json.loads(path.read_text()) if path.exists() else {"tokens": 0, "seconds": 0.0}
        atomic_write_json(path, {"tokens": old["tokens"] + stats["tokens"],
                                 "seconds": old["seconds"] + stats["seconds"],
                                 "backends": sorted({*old.get("backends", []), stats["backend"]}),
                                 "dtypes": sorted({*old.get("dtypes", []), dtype_name(llm.model.dtype)}),
                                 "token_ids": _merge_token_ids(old.get("token_ids"), stats["token_ids"])})
    return stats


def _merge_token_ids(a: dict | None, b: dict | None) -> dict:
    """How token ids were obtained, over resumed runs and ranks: sources joined, counts added."""
    a, b = a or {}, b or {}
    sources = sorted({x for d in (a, b) for x in str(d.get("source", "")).split("+") if x})
    out = {"source": "+".join(sources)} if sources else {}
    for k in sorted((a.keys() | b.keys()) - {"source"}):
        out[k] = a.get(k, 0) + b.get(k, 0)
    return out


def teacher_summary(run: RunDir, ds) -> dict:
    per_rank = [json.loads(p.read_text()) for p in run.teacher_stats_files()]
    tokens = sum(len(x) for x in ds["output_ids"])
    secs = max((r["seconds"] for r in per_rank), default=0.0)  # ranks run in parallel
    measured = sum(r["tokens"] for r in per_rank)
    token_ids: dict = {}
    for r in per_rank:
        token_ids = _merge_token_ids(token_ids, r.get("token_ids"))
    return {"samples": len(ds), "tokens": tokens, "seconds": secs,
            "tokens_per_s": measured / secs if secs else None,
            "stop_fraction": sum(f == "stop" for f in ds["finish"]) / max(1, len(ds)),
            "backends": sorted({b for r in per_rank for b in r.get("backends", [])}),
            "dtypes": sorted({d for r in per_rank for d in r.get("dtypes", [])}),
            "token_ids": token_ids}


@dataclass
class TeacherData:
    """What the prompt and teacher phases hand to the later ones."""

    prompts_info: dict
    """The prompt set's counts: ``count``, ``train``, ``held_out``, ``grown``, ``by_source``."""
    prompts: list[TrainPrompt]
    """Every prompt, the ``train`` training prompts first."""
    teacher: dict
    """The teacher's figures (:func:`teacher_summary`)."""
    train: list[Sample]
    """The training prompts with the LLM's continuations: what the SSMs and the feature head train on."""
    held: list[Sample]
    """The held-out prompts with theirs: what every stage is scored on."""
    tokenizer: PreTrainedTokenizerBase
    """The LLM's (saved with every SSM)."""
    pad_id: int
    """The LLM's padding id, else its smallest end-of-sequence id."""

    @property
    def held_out_prompts(self) -> list[TrainPrompt]:
        return self.prompts[self.prompts_info["train"]:]


def prompts_and_teacher(cfg: TrainConfig, run: RunDir, llm: LoadedModel) -> TeacherData:
    """The prompt set (rank 0) and the LLM's continuations of it (every rank its shards), each made only
    where the run lacks it; the files are how ranks share them."""
    if dist.is_main():
        if cfg.teacher.reuse_from:
            reuse_teacher(cfg, run)
        build_prompts(cfg, run, llm)
        remove_shard_temporaries(run)  # a killed run's; no rank writes shards before the barrier
    dist.barrier()
    prompts_info = run.prompts_info()
    prompts = read_prompts_file(run)
    _log(f"prompts: {prompts_info['count']} ({prompts_info['by_source']}), {prompts_info['held_out']} held out")

    stats = teacher_phase(cfg, run, llm, prompts)
    if stats["tokens"]:
        _log(f"teacher: {stats['tokens']} tokens in {stats['seconds']:.0f} s ({stats['tokens_per_s']:.0f} tok/s, rank 0, "
             f"LLM in {dtype_name(llm.model.dtype)})")
    dist.barrier()
    ds = load_teacher(run, len(prompts), cfg.teacher.shard_size)
    if dist.is_main():
        ensure_counted(run, model_vocab_size(llm.model), ds)
    n_train = prompts_info["train"]
    pad_id = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else min(eos_token_ids(llm))
    return TeacherData(prompts_info=prompts_info, prompts=prompts, teacher=teacher_summary(run, ds),
                       train=samples_from_teacher(ds, range(n_train)),
                       held=samples_from_teacher(ds, range(n_train, len(prompts))),
                       tokenizer=llm.tokenizer, pad_id=pad_id)


# ------------------------------------------------------------------------------------------- stages
def stage_pool(boost: BoostConfig, k: int, n_train: int, left: list[int] | None) -> list[int]:
    """The training-sample indices stage ``k`` trains on: every one for stage 1 and in the ``independent``
    and ``weighted`` modes (weights, not the pool, steer ``weighted``); else ``left``, what stage k - 1 left
    (:func:`next_pool`), unless fewer than ``boost.min_pool`` are left (then every one again)."""
    everything = list(range(n_train))
    if k == 1 or boost.mode in ("independent", "weighted") or left is None or len(left) < boost.min_pool:
        return everything
    return list(left)


def unmatched(pool: list[int], matched: list[bool]) -> list[int]:
    """The samples of ``pool`` whose ``matched[i]`` is False: they stay for the next stage."""
    return [i for i in pool if not matched[i]]


def next_pool(boost: BoostConfig, pool: list[int], matched: list[bool], covered: list[float] | None) -> list[int]:
    """What a stage leaves of its ``pool`` for the next: ``match`` (and ``independent``, whose record it is
    only) the samples it did not match; ``quantile`` the pool without its best-``covered`` share (``covered[i]``:
    the union's coverage of sample i so far); ``weighted`` all of it."""
    if boost.mode == "quantile":
        assert covered is not None, "quantile mode needs each sample's union coverage"
        return remove_best_covered(pool, covered, boost.quantile)
    if boost.mode == "weighted":
        return list(pool)
    return unmatched(pool, matched)


def coverage_k(cfg: TrainConfig) -> int:
    """Candidates per position that cover the LLM's token: ``boost.top_k``, else the tree's first width."""
    return cfg.boost.top_k or (cfg.tree.widths[0] if cfg.tree.widths else 1)


def _score(model, samples, pad_id: int, autocast: bool) -> tuple[dict[int, list[bool]], dict[int, list[int]]]:
    """This rank's share of the samples: index -> per-position agreement, and index -> per-position rank
    of the LLM's token (one forward for both)."""
    r, w = dist.rank(), dist.world_size()
    mine = [i for i in range(len(samples)) if i % w == r]
    agree, ranks = teacher_forced_scores(model, [samples[i] for i in mine], pad_id, autocast=autocast)
    return dict(zip(mine, agree, strict=True)), dict(zip(mine, ranks, strict=True))


def _stage_ranks(cfg: TrainConfig, run: RunDir, j: int, name: str, samples: list[Sample], pad_id: int) -> list[list[int]]:
    """SSM ``j``'s ranks of the LLM's tokens on ``samples`` (``name``: train or heldout), as its stage
    cached them (``stages/stage-J/ranks-NAME-rank*.json``); where the cache is missing or incomplete (a run
    from before it existed), computed again from the saved SSM (the same weights, the same forward) and cached."""
    rows: list = [None] * len(samples)
    for p in run.stage_scores_files(j, f"ranks-{name}"):
        for i, v in json.loads(p.read_text()).items():
            if int(i) < len(rows):
                rows[int(i)] = v
    if all(r is not None for r in rows):
        return rows
    from transformers import AutoModelForCausalLM

    from boosttune.train.stage import precision

    dist.barrier()  # every rank has read the old files before any is replaced
    model = AutoModelForCausalLM.from_pretrained(run.ssm_dir(j), dtype=torch.float32).eval()
    _, part = _score(model, samples, pad_id, precision(cfg).startswith("bf16"))
    return _gather_scores(run, j, f"ranks-{name}", part, len(samples))


def _flat(rows: list[list[int]]) -> np.ndarray:
    return np.asarray([x for r in rows for x in r], dtype=np.int64)  # (T,)


def coverage_fields(held_ranks: list[list[list[int]]], k: int) -> dict:
    """A stage's summary's coverage: ``held_ranks[s]`` SSM s + 1's held-out ranks, the stage's SSM last."""
    c = coverage_summary(np.stack([_flat(r) for r in held_ranks]), k) if held_ranks[0] else None
    return {"coverage_k": k, "heldout_coverage": c["topk"][-1] if c else 0.0,
            "ssm_coverages": c["topk"] if c else [0.0] * len(held_ranks),
            "union_coverage": c["union_topk"] if c else 0.0,
            "union_gain_over_best_single": c["union_gain"] if c else 0.0}


def _gather_scores(run: RunDir, k: int, name: str, part: dict[int, list[bool]], n: int) -> list[list[bool]]:
    """Every rank's scores, through files (works with or without a process group)."""
    atomic_write_json(run.stage_scores(k, name, dist.rank()), {str(i): v for i, v in part.items()})
    dist.barrier()
    rows: list = [None] * n
    for p in run.stage_scores_files(k, name):
        for i, v in json.loads(p.read_text()).items():
            rows[int(i)] = v
    if any(r is None for r in rows):
        raise RuntimeError(f"{run.stage_dir(k)}: {name} scores missing for some samples (a rank failed?)")
    return rows


def acceptance_profile(rows: list[list[bool]], depths: int = PROFILE_DEPTHS) -> list[float]:
    """P(the SSM's greedy draft has at least d tokens accepted), d = 1..depths, teacher forced."""
    prefix = [next((i for i, h in enumerate(r) if not h), len(r)) for r in rows]
    return [sum(p >= d for p in prefix) / max(1, len(prefix)) for d in range(1, depths + 1)]


def build_init(cfg: TrainConfig, run: RunDir, llm) -> Path:
    """Rank 0 saves the SSMs' common starting weights once (every stage starts from them)."""
    from boosttune.train.ssm_init import init_ssm

    out = run.ssm_init_dir
    if dist.is_main() and not is_complete(out):
        _publish_model(init_ssm(llm, cfg.ssm), llm.tokenizer, out, {"init": cfg.ssm.init})
    dist.barrier()
    return out


def run_stage(cfg: TrainConfig, run: RunDir, k: int, init_dir: Path, tokenizer, train, held, pad_id: int) -> dict:
    """Train SSM ``k`` on its pool, score it, save it; returns the stage's summary. A finished stage's
    summary is read back (and given the coverage fields it lacks, from the cached or recomputed ranks)."""
    from transformers import AutoModelForCausalLM

    from boosttune.train.stage import precision, train_stage

    out, summary_path = run.ssm_dir(k), run.stage_summary(k)
    kc = coverage_k(cfg)
    if is_complete(out) and summary_path.exists():
        summary = json.loads(summary_path.read_text())
        if "union_coverage" not in summary:  # a stage finished before coverage was reported
            held_ranks = [_stage_ranks(cfg, run, j, "heldout", held, pad_id) for j in range(1, k + 1)]
            summary = {**summary, **coverage_fields(held_ranks, kc)}
            if dist.is_main():
                atomic_write_json(summary_path, summary)
            dist.barrier()
        return summary
    run.stage_dir(k).mkdir(parents=True, exist_ok=True)
    left = json.loads(run.stage_match(k - 1).read_text())["pool_after"] if k > 1 else None
    pool = stage_pool(cfg.boost, k, len(train), left)
    earlier_train = [_stage_ranks(cfg, run, j, "train", train, pad_id) for j in range(1, k)] \
        if cfg.boost.mode in ("quantile", "weighted") else []
    samples = [train[i] for i in pool]
    covered_before = None
    if cfg.boost.mode == "weighted" and earlier_train:
        union = union_rank_rows([[r[i] for i in pool] for r in earlier_train])
        weights = token_weights(union, kc, cfg.boost.covered_weight)
        samples = [replace(s, weights=w) for s, w in zip(samples, weights, strict=True)]
        covered_before = float((_flat(union) < kc).mean())
    t0 = time.perf_counter()
    warm = cfg.boost.warm_start and k > 1  # SSM k starts from SSM k - 1
    _log(f"stage {k}/{cfg.boost.num_ssms}: training on {len(pool)} of {len(train)} samples ({cfg.boost.mode}"
         + (f", from SSM {k - 1}" if warm else "") + ")")
    model = AutoModelForCausalLM.from_pretrained(run.ssm_dir(k - 1) if warm else init_dir, dtype=torch.float32).train()
    model, stats = train_stage(model, samples, cfg, run.stage_dir(k), run.stage_checkpoint(k), pad_id,
                               seed=cfg.optim.seed + k, desc=f"stage {k}")
    model.eval()
    factors = None
    if cfg.boost.delta_rank and k > 1:  # SSM 1 plus a low-rank delta: what is scored below is what drafts
        first = AutoModelForCausalLM.from_pretrained(run.ssm_dir(1), dtype=torch.float32)
        factors, kept = cut_to_rank(first, model, cfg.boost.delta_rank)
        stats = {**stats, "delta_rank": cfg.boost.delta_rank, "delta_energy_kept": kept}
        _log(f"stage {k}: cut to SSM 1 plus rank-{cfg.boost.delta_rank} deltas ({kept:.1%} of their energy kept)")
    autocast = precision(cfg).startswith("bf16")
    train_agree, train_ranks = _score(model, train, pad_id, autocast)
    held_agree_part, held_ranks_part = _score(model, held, pad_id, autocast)
    train_rows = _gather_scores(run, k, "train", train_agree, len(train))
    held_rows = _gather_scores(run, k, "heldout", held_agree_part, len(held))
    train_ranks_k = _gather_scores(run, k, "ranks-train", train_ranks, len(train))
    held_ranks = [_stage_ranks(cfg, run, j, "heldout", held, pad_id) for j in range(1, k)]
    held_ranks.append(_gather_scores(run, k, "ranks-heldout", held_ranks_part, len(held)))
    m = cfg.boost.match
    train_match = [is_match(r, m) for r in train_rows]
    held_match = [is_match(r, m) for r in held_rows]
    sample_cov = sample_union_coverage([*earlier_train, train_ranks_k], kc) if cfg.boost.mode == "quantile" else None
    pool_after = next_pool(cfg.boost, pool, train_match, sample_cov)
    earlier = [json.loads(run.stage_match(j).read_text())["heldout_matched"] for j in range(1, k)]
    ensemble = [any(x) for x in zip(held_match, *earlier, strict=True)] if held else []
    match = {"pool": pool, "pool_after": pool_after, "pool_after_size": len(pool_after),
             "train_matched": train_match, "heldout_matched": held_match}
    held_agree = summarize_agreement(held_rows)
    summary = {
        "stage": k, "ssm_dir": run.relative(out), "mode": cfg.boost.mode,
        "pool_before": len(pool), "pool_after": len(pool_after),
        "match_rate": sum(train_match[i] for i in pool) / max(1, len(pool)),
        "heldout_match_rate": sum(held_match) / max(1, len(held)),
        "ensemble_match_rate": sum(ensemble) / max(1, len(held)),
        "heldout_top1": held_agree["top1"], "heldout_mean_prefix": held_agree["mean_prefix"],
        "train_top1": summarize_agreement([train_rows[i] for i in pool])["top1"],
        "acceptance_profile": acceptance_profile(held_rows),
        **coverage_fields(held_ranks, kc),
        **stats, "stage_seconds": time.perf_counter() - t0,
    }
    if covered_before is not None:
        summary["train_covered_before"] = covered_before  # share of the pool's tokens weighted covered_weight
    if dist.is_main():
        atomic_write_json(run.stage_match(k), match)
        _save_ssm(model, tokenizer, out, summary, factors)
        crash_point("ssm-saved")
        atomic_write_json(summary_path, summary)
    dist.barrier()
    return summary


def _save_ssm(model, tokenizer, out: Path, summary: dict, factors: Factors | None = None) -> None:
    model = model.to(torch.float32)
    model.config.use_cache = True

    def save(d: Path) -> None:
        model.save_pretrained(d)
        if factors:
            save_factors(d, factors)

    _publish_model(model, tokenizer, out, {"stage": summary["stage"]}, stats=summary, save=save, kind=SSMKind.name)


def _publish_model(model, tokenizer, out: Path, marker: dict, stats: dict | None = None,
                   save: Callable[[Path], None] | None = None, kind: str | None = None) -> None:
    """Save model + tokenizer (+ stats.json) in a temporary sibling, mark it complete, rename it to
    ``out``; ``save`` writes the model (default ``model.save_pretrained``); ``kind``: the drafter kind
    the directory declares (``core/kind_file.py``; None for the SSMs' starting point). A failed write (a
    full disk inside safetensors included) is an OSError naming ``out``; the half-written sibling has no
    marker and is removed by the next attempt."""
    tmp = out.with_name(f".{out.name}.tmp")
    with writing(out):
        shutil.rmtree(tmp, ignore_errors=True)
        (save or model.save_pretrained)(tmp)
        tokenizer.save_pretrained(tmp)
        if kind is not None:
            declare_kind(tmp, kind)
        if stats is not None:
            atomic_write_json(tmp / "stats.json", stats)
        mark_complete(tmp, marker)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)


def finished_feature(cfg: TrainConfig, run: RunDir, k: int = 1) -> dict | None:
    """The statistics of the run's feature head ``k`` if it was trained with the ``feature:`` settings of
    ``cfg`` (None: none yet, or other settings: it is trained again)."""
    stats = _finished_stats(run.feature_head_dir(k))
    return stats if stats is not None and _same_feature_settings(stats.get("config"), cfg.feature, k) else None


def _finished_stats(directory: Path) -> dict | None:
    """A complete model directory's stats.json (None: not complete, or no statistics)."""
    stats_file = directory / "stats.json"
    if not is_complete(directory) or not stats_file.is_file():
        return None
    return json.loads(stats_file.read_text())


def _same_feature_settings(saved: dict | None, now: FeatureConfig, k: int = 1) -> bool:
    """Whether head ``k``'s recorded ``feature:`` settings are ``now``'s; a field the record lacks (one
    added since the head was trained) counts at its default, which keeps the recipe it was trained with.
    How many heads follow never matters, nor, for the first head, how the later ones are boosted."""
    if saved is None:
        return False
    ignored = {"heads"} | ({"boost", "covered_weight"} if k == 1 else set())
    defaults = json.loads(json.dumps(asdict(FeatureConfig())))
    was, want = {**defaults, **saved}, json.loads(json.dumps(asdict(now)))
    return {n: v for n, v in was.items() if n not in ignored} == {n: v for n, v in want.items() if n not in ignored}


def recorded_features(run: RunDir, shard_size: int, samples: list, first: int) -> tuple[list, list, int]:
    """The samples (prompt indices ``first``...) and the features the teacher recorded for them:
    where it did, the sample loses its last token (never fed to the LLM, so it has no feature); None
    where it did not (its features are computed). Also how many were recorded."""
    recorded = load_features(run, range(first, first + len(samples)), shard_size)
    out, feats = [], []
    for s, f in zip(samples, recorded, strict=True):
        if f is not None and len(f) == len(s.ids) - 1 and len(s.ids) - 1 > s.prompt_len:
            out.append(replace(s, ids=s.ids[:-1]))
            feats.append(f)
        else:
            out.append(s)
            feats.append(None)
    return out, feats, sum(f is not None for f in feats)


def feature_phase(cfg: TrainConfig, run: RunDir, data: TeacherData, llm: RunLLM) -> dict | None:
    """Rank 0 trains the feature heads (``feature.enabled``, ``feature.heads`` of them) on every training
    sample, after the SSMs, on the LLM features the teacher recorded (:func:`recorded_features`;
    computed where it did not); head k > 1 boost-tuned on what heads 1..k-1 miss (``feature.boost``).
    Returns the first head's statistics with the heads' held-out coverage (None: disabled, or another
    rank). A head trained with the same settings is not trained again (other settings replace it and
    every later head: a finished run can gain heads); a killed head starts over (minutes long)."""
    if not cfg.feature.enabled or not dist.is_main():
        return None
    fc = cfg.feature
    done = [finished_feature(cfg, run, k) for k in range(1, fc.heads + 1)]
    fresh = next((k for k, d in enumerate(done, start=1) if d is None), None)
    if fresh is None:
        return heads_summary(typing.cast(list[dict], done), coverage_k(cfg))
    from boosttune.core.progress import progress
    from boosttune.serving.draft_vocab import head_ids, load_ranking
    from boosttune.train.feature import llm_features

    llm = llm.get(torch.float32, _device(cfg))
    vocab = llm.model.get_output_embeddings().weight.shape[0]
    rows = head_ids(load_ranking(run.draft_vocab_path), fc.draft_vocab, vocab) if fc.draft_vocab else torch.arange(vocab)
    t0 = time.perf_counter()
    train, feats, train_recorded = recorded_features(run, cfg.teacher.shard_size, data.train, 0)
    held, held_feats, held_recorded = recorded_features(run, cfg.teacher.shard_size, data.held, len(train))
    every, every_feats = train + held, feats + held_feats
    todo = [i for i, f in enumerate(every_feats) if f is None]
    with progress(total=len(todo), desc="LLM features", unit="sample") as bar:
        for i, f in zip(todo, llm_features(llm.model, [every[i] for i in todo], bar.update), strict=True):
            every_feats[i] = f
    data_f = HeadData(train, every_feats[: len(train)], held, every_feats[len(train):], rows,
                      round(time.perf_counter() - t0, 1), train_recorded + held_recorded)
    summaries = typing.cast(list[dict], done[: fresh - 1])
    trained: dict[int, torch.nn.Module] = {}
    for k in range(fresh, fc.heads + 1):
        summary, trained[k] = train_feature_head(cfg, run, k, data_f, llm, trained)
        summaries.append(summary)
    return heads_summary(summaries, coverage_k(cfg))


@dataclass
class HeadData:
    """What every feature head trains and is measured on: the samples, the LLM's features over them,
    the draft vocabulary's rows, and how the features were had (seconds computing them, how many the
    teacher recorded)."""

    train: list
    feats: list
    held: list
    held_feats: list
    rows: torch.Tensor
    feature_seconds: float
    recorded: int
    train_ranks: dict[int, list[list[int]]] = field(default_factory=dict)
    """Head j's ranks of the training answers, once computed (boosting head k needs heads 1..k-1's)."""

    @functools.cached_property
    def train_lookup_ranks(self) -> list[list[int]]:
        """Prompt lookup's ranks of the training answers (``lookup_rank_rows``), computed once for every head."""
        return lookup_rank_rows(self.train)

    @functools.cached_property
    def held_lookup_ranks(self) -> list[list[int]]:
        """Prompt lookup's ranks of the held-out answers, computed once for every head."""
        return lookup_rank_rows(self.held)


def _earlier_head(run: RunDir, j: int, trained: dict, device: str) -> torch.nn.Module:
    """Head ``j``: the one this process trained, else the run's saved one."""
    if j in trained:
        return trained[j]
    return load_model(str(run.feature_head_dir(j)), torch.float32).model.to(device)


def boost_weights(cfg: TrainConfig, run: RunDir, k: int, d: HeadData, trained: dict, device: str
                  ) -> tuple[list[torch.Tensor] | None, float | None, float | None]:
    """Head ``k``'s per-pair loss weights (None: every pair 1), the share of answer tokens heads 1..k-1
    already cover (``feature.boost: weighted``, k > 1; else None) and the share prompt lookup drafts
    (``feature.lookup_weight`` < 1; else None). A token both cover takes the lower weight."""
    fc = cfg.feature
    over_heads, over_lookup = k > 1 and fc.boost == "weighted", fc.lookup_weight < 1
    if not over_heads and not over_lookup:
        return None, None, None
    from boosttune.core.progress import progress
    from boosttune.train.feature import answer_ranks, pair_weights

    kc = coverage_k(cfg)
    weights = [[1.0] * (len(s.ids) - s.prompt_len) for s in d.train]
    covered = by_lookup = None
    if over_heads:
        todo = [j for j in range(1, k) if j not in d.train_ranks]
        with progress(total=len(todo) * len(d.train), desc=f"head {k}: earlier heads' ranks", unit="sample") as bar:
            for j in todo:
                d.train_ranks[j] = answer_ranks(_earlier_head(run, j, trained, device), d.train, d.feats, d.rows,
                                                bar.update)
        union = union_rank_rows([d.train_ranks[j] for j in range(1, k)])
        covered = float(np.mean(_flat(union) < kc)) if any(union) else 0.0
        weights = token_weights(union, kc, fc.covered_weight)
    if over_lookup:
        lookup = d.train_lookup_ranks
        by_lookup = float(np.mean(_flat(lookup) < kc)) if any(lookup) else 0.0
        weights = [np.minimum(w, lw).tolist() for w, lw in zip(weights, token_weights(lookup, kc, fc.lookup_weight),
                                                               strict=True)]
    return pair_weights(d.train, weights), covered, by_lookup


def train_feature_head(cfg: TrainConfig, run: RunDir, k: int, d: HeadData, llm: LoadedModel, trained: dict
                       ) -> tuple[dict, torch.nn.Module]:
    """Train, measure and publish feature head ``k`` (``run.feature_head_dir(k)``); its summary and the head."""
    from boosttune.core.feature_head import save_head
    from boosttune.core.progress import progress
    from boosttune.train.feature import answer_ranks, build_head, evaluate_head, train_head
    from boosttune.train.stage import precision

    fc = cfg.feature
    device = str(llm.model.device)
    weights, covered, by_lookup = boost_weights(cfg, run, k, d, trained, device)
    head = build_head(llm.model, fc.layers).to(llm.model.device)
    before = evaluate_head(head, d.held, d.held_feats, d.rows)
    name = feature_name(k)
    with progress(total=None, desc=name, unit="step") as bar:
        amp = torch.bfloat16 if precision(cfg).startswith("bf16") else None  # as the SSM stages train
        stats = train_head(head, d.train, d.feats, d.rows, fc, on_step=lambda step, losses: bar.update(1),
                           seed=cfg.optim.seed + k - 1, autocast=amp, weights=weights)
    after = evaluate_head(head, d.held, d.held_feats, d.rows)
    head = head.to(torch.float32).eval()
    summary = {"config": json.loads(json.dumps(asdict(fc))), "head": name, "feature_seconds": d.feature_seconds,
               "train": stats, "held_out_before": before, "held_out": after,
               "samples": len(d.train), "held_out_samples": len(d.held), "recorded_by_teacher": d.recorded,
               "boost": fc.boost if k > 1 else None, "covered_by_earlier": covered, "covered_by_lookup": by_lookup,
               "held_out_ranks": answer_ranks(head, d.held, d.held_feats, d.rows),
               "held_out_lookup_ranks": d.held_lookup_ranks}
    _log(f"{name}: {stats['steps']} steps in {stats['seconds']:.0f} s, held-out top-1 "
         f"{before['top1']:.3f} -> {after['top1']:.3f} (features {d.feature_seconds:.0f} s)"
         + (f", {covered:.3f} of answer tokens covered by heads 1..{k - 1}" if covered is not None else "")
         + (f", {by_lookup:.3f} drafted by prompt lookup" if by_lookup is not None else ""))
    head.config.use_cache = True
    meta = {"layers": list(fc.layers), "draft_vocab": fc.draft_vocab}
    _publish_model(head, llm.tokenizer, run.feature_head_dir(k), {"feature": True}, stats=summary,
                   save=lambda tmp: save_head(head, tmp, meta), kind=FeatureKind.name)
    return summary, head


def finished_eagle3(cfg: TrainConfig, run: RunDir) -> dict | None:
    """The run's EAGLE-3 head's statistics if it was trained with the ``eagle3:`` settings of ``cfg``."""
    stats = _finished_stats(run.eagle3_dir)
    return stats if stats is not None and stats.get("config") == json.loads(json.dumps(asdict(cfg.eagle3))) else None


def eagle3_phase(cfg: TrainConfig, run: RunDir, data: TeacherData, llm: RunLLM) -> dict | None:
    """Rank 0 trains the EAGLE-3 head (``eagle3.enabled``) on every training sample, from the fp32 LLM's
    layer inputs over them (one forward each), measures its greedy chains on the held-out samples and
    publishes it in ``run.eagle3_dir``; its statistics (None: disabled, or another rank). A head trained
    with the same settings is not trained again; a killed one starts over (minutes long)."""
    if not cfg.eagle3.enabled or not dist.is_main():
        return None
    done = finished_eagle3(cfg, run)
    if done is not None:
        return done
    from boosttune.core.eagle3_head import Eagle3Spec
    from boosttune.core.progress import progress
    from boosttune.serving.draft_vocab import head_ids, load_ranking
    from boosttune.train.eagle3 import evaluate_eagle3, init_head, layer_features, train_eagle3
    from boosttune.train.stage import precision

    ec = cfg.eagle3
    loaded = llm.get(torch.float32, _device(cfg))
    model = loaded.model
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = head_ids(load_ranking(run.draft_vocab_path), ec.draft_vocab, vocab)
    spec = Eagle3Spec.from_llm(model.config, len(rows), tuple(ec.layers) if ec.layers else None)
    t0 = time.perf_counter()
    every = data.train + data.held
    with progress(total=len(every), desc="LLM layer inputs", unit="sample") as bar:
        feats = layer_features(model, every, spec.layers, bar.update)
    feature_seconds = round(time.perf_counter() - t0, 1)
    train_f, held_f = feats[: len(data.train)], feats[len(data.train):]
    head = init_head(model, spec, rows).to(model.device)
    w = model.get_output_embeddings().weight.detach().float()[rows.to(model.device)]
    before = evaluate_eagle3(head, data.held, held_f, ec.depth)
    with progress(total=None, desc="eagle3", unit="step") as bar:
        amp = torch.bfloat16 if precision(cfg).startswith("bf16") else None  # as the feature heads train
        stats = train_eagle3(head, data.train, train_f, w, ec, on_step=lambda step, losses: bar.update(1),
                             seed=cfg.optim.seed, autocast=amp)
    after = evaluate_eagle3(head, data.held, held_f, ec.depth)
    summary = {"config": json.loads(json.dumps(asdict(ec))), "layers": list(spec.layers), "draft_vocab": spec.draft_vocab,
               "feature_seconds": feature_seconds, "train": stats, "held_out_before": before, "held_out": after,
               "samples": len(data.train), "held_out_samples": len(data.held)}
    _log(f"eagle3: {stats['steps']} steps in {stats['seconds']:.0f} s, held-out chain tau {before['tau']:.3f} -> "
         f"{after['tau']:.3f} (depth {ec.depth}; layer inputs {feature_seconds:.0f} s)")
    head.eval()  # fp32 throughout: autocast only ran the forward in bf16
    _publish_model(head, data.tokenizer, run.eagle3_dir, {"eagle3": True}, stats=summary,
                   save=lambda tmp: head.save(tmp, {"llm_ref": cfg.llm.ref}), kind="eagle3")
    return summary


def heads_summary(summaries: list[dict], k: int) -> dict:
    """The report's ``feature`` entry: the first head's statistics, the heads' held-out top-``k``
    coverage and their union's (where every head recorded its held-out ranks) and, with more than one
    head, a line per head."""
    out = {n: v for n, v in summaries[0].items() if n not in ("held_out_ranks", "held_out_lookup_ranks")}
    ranks = [s.get("held_out_ranks") for s in summaries]
    if all(r is not None for r in ranks):
        c = coverage_summary(np.stack([_flat(r) for r in ranks]), k)
        out |= {"coverage_k": k, "head_coverages": c["topk"], "union_coverage": c["union_topk"],
                "union_gain_over_best_single": c["union_gain"]}
        lookup = summaries[0].get("held_out_lookup_ranks")  # the same samples for every head
        if lookup is not None:  # what a bundle serves: the heads merged with prompt lookup
            c = coverage_summary(np.stack([_flat(r) for r in [*ranks, lookup]]), k)
            out |= {"lookup_coverage": c["topk"][-1], "union_coverage_with_lookup": c["union_topk"]}
    if len(summaries) > 1:
        out["heads"] = [{"head": s.get("head", feature_name(i)), "boost": s.get("boost"), "steps": s["train"]["steps"],
                         "seconds": s["train"]["seconds"], "held_out_top1": s["held_out"]["top1"],
                         "covered_by_earlier": s.get("covered_by_earlier"),
                         "covered_by_lookup": s.get("covered_by_lookup")}
                        for i, s in enumerate(summaries, start=1)]
    return out


# ---------------------------------------------------------------------------------- boost-tuning
def stage_done(run: RunDir, k: int) -> bool:
    """Whether stage ``k``'s SSM and summary are complete (:func:`run_stage` then only reads them)."""
    return is_complete(run.ssm_dir(k)) and run.stage_summary(k).exists()


def boost_phase(cfg: TrainConfig, run: RunDir, data: TeacherData, init_dir: Path) -> list[dict]:
    """Every stage in turn, each on what the earlier ones left (:func:`run_stage`); the stages' summaries."""
    stages: list[dict] = []
    for k in range(1, cfg.boost.num_ssms + 1):
        done = stage_done(run, k)
        stages.append(run_stage(cfg, run, k, init_dir, data.tokenizer, data.train, data.held, data.pad_id))
        if not done:  # a killed run's report lists the SSMs it finished (export reads a run's SSMs there)
            write_report(cfg, run, data, stages)
        s = stages[-1]
        _log(f"stage {k}: pool {s['pool_before']} -> {s['pool_after']}, match {s['match_rate']:.3f}, "
             f"held-out top-1 {s['heldout_top1']:.3f}, ensemble held-out match {s['ensemble_match_rate']:.3f}, "
             f"top-{s['coverage_k']} coverage {s['heldout_coverage']:.3f}, union {s['union_coverage']:.3f}")
    return stages


def drafters_to_train(cfg: TrainConfig, run: RunDir) -> bool:
    """Whether this process will train an SSM or the feature head (the same answer on every rank for
    the SSMs; the head is rank 0's)."""
    fresh_feature = cfg.feature.enabled and dist.is_main() and any(
        finished_feature(cfg, run, k) is None for k in range(1, cfg.feature.heads + 1))
    return fresh_feature or not all(stage_done(run, k) for k in range(1, cfg.boost.num_ssms + 1))


def forget_results(cfg: TrainConfig, run: RunDir) -> None:
    """Rank 0, before drafters are trained: the report's evaluation and the scheduler describe the drafters
    there were. A run killed before new results exist must not keep those as its own, so the report drops
    them and the scheduler (when this run trains it) loses its completion marker."""
    if not dist.is_main():
        return
    if cfg.scheduler.prompts:
        (run.scheduler_dir / MARKER).unlink(missing_ok=True)
    report = _read_report(run)
    if report is not None and (report.get("evaluation") is not None or "scheduler" in report):
        report = {k: v for k, v in report.items() if k != "scheduler"}
        atomic_write_text(run.report_path, json.dumps({**report, "evaluation": None}, indent=2) + "\n")


# ------------------------------------------------------------------------------------------ report
def eval_settings(cfg: TrainConfig) -> dict:
    """What the τ evaluation of a run's SSMs depends on besides the SSMs (JSON types); with ``eagle3.enabled``
    also its settings, so that a head trained (or trained again) on a finished run is evaluated, and the
    scheduler, which does not route it, is kept."""
    e3 = {"eagle3": asdict(cfg.eagle3)} if cfg.eagle3.enabled else {}
    return json.loads(json.dumps({"eval": to_dict(cfg.eval), "tree": asdict(cfg.tree),
                                  "eval_dtype": cfg.llm.eval_dtype, "feature": cfg.feature.enabled, **e3}))


def _read_report(run: RunDir) -> dict | None:
    """report.json as it is (None: none yet, or a damaged one, which is then made again)."""
    try:
        report = json.loads(run.report_path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def previous_evaluation(run: RunDir, settings: dict) -> dict | None:
    """report.json's evaluation if it was made with ``settings`` (None: none, or other settings)."""
    evaluation = (_read_report(run) or {}).get("evaluation")
    return evaluation if isinstance(evaluation, dict) and evaluation.get("settings") == settings else None


def evaluation_phase(cfg: TrainConfig, run: RunDir, data: TeacherData, stages: list[dict], llm: RunLLM,
                     trained: bool) -> dict | None:
    """Rank 0: τ of the run's SSMs (``eval.enabled``; :func:`boosttune.train.evaluate.evaluate_run`).
    report.json's evaluation is kept when this process trained nothing and the settings are the same."""
    if not cfg.eval.enabled or not dist.is_main():
        return None
    settings = eval_settings(cfg)
    done = None if trained else previous_evaluation(run, settings)
    if done is not None:
        return done
    from boosttune.train.evaluate import evaluate_run

    dirs = [run.root / s["ssm_dir"] for s in stages]
    loaded = llm.get(parse_dtype(cfg.llm.eval_dtype), "cpu")
    return {**evaluate_run(cfg, run, data.held_out_prompts, dirs, loaded), "settings": settings}


def scheduler_phase(cfg: TrainConfig, run: RunDir, stages: list[dict], llm: RunLLM, trained: bool) -> dict | None:
    """Rank 0: the learned scheduler (``scheduler.prompts``), fitted on the run's drafters; its report. A
    scheduler fitted with the same settings is kept when this process trained nothing (read back; no file
    written)."""
    if not cfg.scheduler.prompts or not dist.is_main():
        return None
    from boosttune.scheduler.offline.train import RunModels, finished_scheduler, train_scheduler

    models = RunModels(llm_ref=cfg.llm.ref, llm_dtype=cfg.llm.eval_dtype, tree=asdict(cfg.tree),
                       ssm_dirs=[run.root / s["ssm_dir"] for s in stages], llm=lambda dtype: llm.get(dtype, "cpu"))
    done = None if trained else finished_scheduler(run, cfg.scheduler, models)
    return done if done is not None else train_scheduler(run, cfg.scheduler, models=models)


def write_report(cfg: TrainConfig, run: RunDir, data: TeacherData, stages: list[dict], feature: dict | None = None,
                 evaluation: dict | None = None, scheduler: dict | None = None, eagle3: dict | None = None) -> dict:
    """The run's report (rank 0 writes it, unless the file holds it already); ``scheduler`` only when the
    run fitted one."""
    report = {
        "format": REPORT_FORMAT,
        "llm": {"ref": cfg.llm.ref, "path": resolve_model_path(cfg.llm.ref), "dtype": cfg.llm.eval_dtype},
        "tree": asdict(cfg.tree),
        "world_size": dist.world_size(),
        "prompts": data.prompts_info,
        "teacher": data.teacher,
        "stages": stages,
        "feature": feature,
        "eagle3": eagle3,
        "evaluation": evaluation,
    }
    if scheduler is not None:
        report["scheduler"] = scheduler
    if dist.is_main():
        text = json.dumps(report, indent=2) + "\n"
        if not run.report_path.is_file() or run.report_path.read_text() != text:  # unchanged: not rewritten
            atomic_write_text(run.report_path, text)
    return report


# -------------------------------------------------------------------------------------------- main
def open_run(cfg: TrainConfig, run_dir: str | Path) -> RunDir:
    """The run directory, made on first use, its config saved or checked against this one."""
    run = RunDir(run_dir)
    dist.init()
    if dist.is_main():
        run.root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    check_or_save_config(cfg, run)
    return run


def train(cfg: TrainConfig, run_dir: str | Path) -> dict:
    """Run (or resume) the whole pipeline in ``run_dir``; returns the report. Each phase takes what the
    earlier ones returned; its files in the run are a cache it checks, so a resumed run skips finished work."""
    run = open_run(cfg, run_dir)
    t_start = time.perf_counter()
    backend_for(cfg.teacher).preflight(cfg.llm.ref, run)  # before weights
    dtypes = _llm_dtypes(cfg)
    llm = RunLLM(cfg.llm.ref, dtypes, _device(cfg))
    teacher_llm = llm.get(dtypes[0], _device(cfg))
    data = prompts_and_teacher(cfg, run, teacher_llm)
    init_dir = build_init(cfg, run, teacher_llm)
    del teacher_llm
    if dist.is_main():  # the SSMs train without the LLM; only rank 0 needs it after them
        llm.park()
    else:
        llm.release()

    trained = drafters_to_train(cfg, run)
    if trained:
        forget_results(cfg, run)
    stages = boost_phase(cfg, run, data, init_dir)
    feature = feature_phase(cfg, run, data, llm)
    eagle3 = eagle3_phase(cfg, run, data, llm)
    dist.barrier()
    evaluation = evaluation_phase(cfg, run, data, stages, llm, trained)
    dist.barrier()  # the other ranks are done (the scheduler is rank 0's alone)
    scheduler = scheduler_phase(cfg, run, stages, llm, trained)
    llm.release()
    report = write_report(cfg, run, data, stages, feature, evaluation, scheduler, eagle3)
    _log(f"done in {time.perf_counter() - t_start:.0f} s; report: {run.report_path}")
    return report
