"""τ of a training run's drafters with the serving engine: each SSM alone and the merged ensemble, each
feature head alone and, with several, the heads merged, and the EAGLE-3 head alone.

Greedy decoding of held-out prompts (``eval.prompts``, else the run's held-out prompts) with the
LLM in ``llm.eval_dtype``; every SSM drafts the ``tree:`` section's tree (the one a bundle of the run
serves by default) and the ensemble merges all SSMs' trees (shared prefixes deduplicated); with
``eval.prompt_lookup`` each option is measured again merged with prompt lookup (its ``lookup`` entry), so
that export can ship the fastest of all. τ counts the bonus token (DESIGN.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from boosttune.assemble import engine_from_models
from boosttune.config import TrainConfig
from boosttune.core.files import is_complete
from boosttune.core.models import LoadedModel, dtype_name, eos_token_ids, load_model, load_ssms
from boosttune.core.progress import progress
from boosttune.core.prompts import encode_prompt, read_prompts
from boosttune.core.rundir import RunDir, ssm_name
from boosttune.serving import kinds
from boosttune.serving.draft_vocab import load_ranking
from boosttune.serving.engine import SpeculativeEngine
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig
from boosttune.train.sources import TrainPrompt


def eval_prompt_ids(cfg: TrainConfig, tokenizer, held_out: list[TrainPrompt]) -> list[list[int]]:
    if cfg.eval.prompts:
        ids = [encode_prompt(tokenizer, p) for p in read_prompts(cfg.eval.prompts)]
    else:  # chat prompts first: τ on requests is what serving sees
        ordered = sorted(held_out, key=lambda p: not p.chat)
        ids = [p.input_ids for p in ordered]
    return ids[: cfg.eval.limit or None]


def tau_of(engine: SpeculativeEngine, prompts: list[list[int]], stop: StopCriteria) -> dict:
    """τ and tokens/s over ``prompts``, and the median seconds of a step's drafting (all drafters,
    prompt catch-up excluded) and of its verification forward."""
    steps = tokens = 0
    secs = 0.0
    draft, verify = [], []
    for ids in prompts:
        res = engine.generate(ids, stop, record=True)
        steps += res.steps
        tokens += len(res.tokens)
        secs += res.wall_time
        draft += [sum(r.draft_s) for r in res.records[1:]]  # step 1 includes catching up on the prompt
        verify += [r.verify_s for r in res.records]
    return {"tau": tokens / max(1, steps), "tokens": tokens, "steps": steps,
            "tokens_per_s": tokens / secs if secs else 0.0,
            "draft_s_median": statistics.median(draft) if draft else 0.0,
            "verify_s_median": statistics.median(verify) if verify else 0.0}


def relative_cost(single: dict, plain: dict, depth: int) -> float:
    """c: an SSM's seconds per draft forward (one per tree level) over one plain decoding step's."""
    return single["draft_s_median"] / max(1, depth) / plain["verify_s_median"] if plain["verify_s_median"] else 0.0


def evaluate_run(cfg: TrainConfig, run: RunDir, held_out: list[TrainPrompt], ssm_dirs: Sequence[Path],
                 llm: LoadedModel) -> dict:
    """{"prompts": n, "singles": [{ssm, tau, ...}], "ensemble": {...}} for the SSMs in ``ssm_dirs`` (the
    run's stages, in order) with ``llm``, the run's LLM in ``llm.eval_dtype``."""
    dtype = llm.model.dtype
    ssms = load_ssms(llm, ssm_dirs, dtype)
    prompts = eval_prompt_ids(cfg, llm.tokenizer, held_out)
    stop = StopCriteria(max_new_tokens=cfg.eval.max_new_tokens, eos_token_ids=eos_token_ids(llm))
    tree = cfg.tree
    ranking = load_ranking(run.draft_vocab_path) if tree.draft_vocab else None
    t0 = time.perf_counter()
    out: dict = {"prompts": len(prompts), "max_new_tokens": cfg.eval.max_new_tokens, "dtype": dtype_name(dtype),
                 "widths": list(tree.widths), "tree": asdict(tree), "singles": []}
    # plain decoding in the same process and dtype: every speed below is relative to it
    out["plain"] = plain = tau_of(engine_from_models(llm.model, [], tree), prompts, stop)
    runs = [(ssm_name(k + 1), [s.model]) for k, s in enumerate(ssms)]
    if len(ssms) > 1:
        runs.append(("ensemble", [s.model for s in ssms]))
    for name, models in progress(runs, desc="evaluate τ", unit="config"):
        r = _option(llm.model, models, tree, ranking, prompts, stop, plain, cfg.eval.prompt_lookup)
        if name == "ensemble":
            out["ensemble"] = r
        else:
            out["singles"].append({"ssm": name, **r, "c": relative_cost(r, plain, tree.max_depth)})
    heads = run.feature_dirs() if cfg.feature.enabled else []
    if heads:  # each feature head alone, on its draft vocabulary, then all of them merged
        alone = [feature_tau(cfg, run, llm.model, tree, prompts, stop, plain, [d]) for d in heads]
        out["feature"] = alone[0]
        if len(heads) > 1:
            out["feature_heads"] = [{"drafter": d.name, **r} for d, r in zip(heads, alone, strict=True)]
            merged = out["feature_ensemble"] = feature_tau(cfg, run, llm.model, tree, prompts, stop, plain, heads)
            merged["drafters"] = [d.name for d in heads]
            out["feature_ensemble_gain_over_best_single"] = merged["tau"] / max(r["tau"] for r in alone) - 1
    if cfg.eagle3.enabled and is_complete(run.eagle3_dir):  # the EAGLE-3 head alone, on its own tree
        out["eagle3"] = eagle3_tau(cfg, run, llm.model, tree, prompts, stop, plain)
    best = max((s["tau"] for s in out["singles"]), default=0.0)
    if "ensemble" in out and best:
        out["ensemble_gain_over_best_single"] = out["ensemble"]["tau"] / best - 1
    if out["singles"]:
        out["ensemble_gain_over_first"] = out.get("ensemble", out["singles"][0])["tau"] / out["singles"][0]["tau"] - 1
    out["seconds"] = time.perf_counter() - t0
    return out


def feature_tau(cfg: TrainConfig, run: RunDir, llm, tree: TreeConfig, prompts: list[list[int]], stop: StopCriteria,
                plain: dict, heads: Sequence[Path] | None = None) -> dict:
    """τ, speed and c of the run's feature ``heads`` (default: the first alone; several: merged into one
    tree), on the run's tree shape with the heads' draft vocabulary (the one they were trained over); with
    ``eval.prompt_lookup``, also merged with prompt lookup."""
    heads = list(heads) if heads else [run.feature_dir]
    models = {d.name: load_model(str(d), llm.dtype).model for d in heads}
    kind = kinds.kind(kinds.directory_kind(heads[0]))
    tree = kind.trained_tree(heads[0], tree)
    ranking = load_ranking(run.draft_vocab_path) if tree.draft_vocab else None
    r = _option(llm, models, tree, ranking, prompts, stop, plain, cfg.eval.prompt_lookup,
                kinds={name: kind.name for name in models})
    return {**r, "c": relative_cost(r, plain, tree.max_depth), "draft_vocab": tree.draft_vocab}


def eagle3_tau(cfg: TrainConfig, run: RunDir, llm, tree: TreeConfig, prompts: list[list[int]], stop: StopCriteria,
               plain: dict) -> dict:
    """τ, speed and c of the run's EAGLE-3 head on the tree it serves by default (``Eagle3Kind.trained_tree``);
    with ``eval.prompt_lookup``, also merged with prompt lookup."""
    kind = kinds.kind(kinds.Eagle3Kind.name)
    head = kind.load(run.eagle3_dir, llm.dtype, llm.device, llm=llm)
    tree = kind.trained_tree(run.eagle3_dir, tree)
    r = _option(llm, {run.eagle3_dir.name: head}, tree, None, prompts, stop, plain, cfg.eval.prompt_lookup,
                kinds={run.eagle3_dir.name: kind.name})
    return {**r, "c": relative_cost(r, plain, tree.max_depth), "widths": list(tree.widths)}


def _option(llm, drafters, tree: TreeConfig, ranking, prompts: list[list[int]], stop: StopCriteria, plain: dict,
            lookup: int, kinds: dict[str, str] | None = None) -> dict:
    """τ, tokens/s and speed-up over plain decoding of one option (these drafters, of ``kinds``, on
    ``tree``); with ``lookup`` > 0 the same merged with prompt lookup of chains up to that long, as its
    ``lookup`` entry."""
    def measured(**extra) -> dict:
        r = tau_of(engine_from_models(llm, drafters, tree, ranking=ranking, kinds=kinds, **extra), prompts, stop)
        r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
        return r

    r = measured()
    if lookup:
        m = measured(lookup=lookup)
        r["lookup"] = {"prompt_lookup": lookup, **{k: m[k] for k in ("tau", "tokens", "steps", "tokens_per_s", "speedup")}}
    return r
