"""Position-level labels and the step-by-step replay: exact cases worked by hand, and the learned
per-match prompt-lookup lengths on made-up requests where the best table is known."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from boosttune.core.ranks import NOT_DRAFTABLE
from boosttune.scheduler.costs import CostModel
from boosttune.scheduler.features import RequestFeatures
from boosttune.scheduler.offline.evaluate import mean_tokens_per_s
from boosttune.scheduler.offline.labels import RequestRecord
from boosttune.scheduler.offline.stepwise import fit_ngram_depths
from boosttune.scheduler.offline.walk import Labels, walk, walk_seconds
from boosttune.scheduler.policy import Candidate
from boosttune.serving.drafter import draft_ranks
from boosttune.serving.lookup import find_match, lookup_positions
from boosttune.serving.tree import TreeConfig


def test_walk_steps_over_positions():
    acc = np.array([[2, 0], [0, 0], [0, 0], [1, 3], [0, 0], [0, 0], [0, 0]])  # 7 positions, 2 drafters
    lab = Labels(acc, np.zeros(7, np.int64), np.zeros(7, np.int64))
    w = walk(lab, [2, 2])  # t=0 takes 2 (+1) -> t=3 takes 2 (depth cap) -> t=6 -> end
    assert w.steps == 3 and w.starts.tolist() == [0, 3, 6]
    assert walk(lab, [1, 0]).starts.tolist() == [0, 2, 3, 5, 6]  # SSM 0 alone, depth 1
    assert walk(lab, [0, 0]).steps == 7  # plain decoding
    assert walk(lab, [0, 3]).starts.tolist() == [0, 1, 2, 3]  # drafter 1 alone: 3 tokens at t=3


def test_walk_lookup_lengths_per_match():
    # prompt lookup (drafter 0) would have 4 tokens accepted at t=0 after a 1-token match, and at
    # t=5 after a 3-token match; chains hold 6 tokens.
    acc = np.array([[4], [0], [0], [0], [0], [4], [0], [0], [0], [0]])
    ngram = np.array([1, 0, 0, 0, 0, 3, 0, 0, 0, 0])
    chain = np.where(ngram > 0, 6, 0)
    lab = Labels(acc, ngram, chain)
    w = walk(lab, [8], lookup=0)
    assert w.starts.tolist() == [0, 5] and w.lookup_nodes.tolist() == [6, 6]
    w = walk(lab, [8], lookup=0, ngram_depths=(1, 2, 8))  # short after 1-token matches
    assert w.starts.tolist() == [0, 2, 3, 4, 5] and w.lookup_nodes.tolist() == [1, 0, 0, 0, 6]
    costs = CostModel(
        depths=(8,), nodes_per_ssm=((0.0,),), draft_s=((0.001,),), ssm_prefill_s_per_token=(0.0,),
        verify_nodes=(0, 1, 6), verify_s=(0.02, 0.021, 0.03), overhead_s=(0.002, 0.0),
    )
    decode, draft = walk_seconds(w, costs, [8], lookup=0)
    assert decode == pytest.approx(0.021 + 3 * 0.02 + 0.03 + 5 * (0.001 + 0.002))
    assert draft == pytest.approx(5 * 0.001)


def test_lookup_positions_agree_with_the_drafter_search():
    rng = np.random.default_rng(3)
    for _ in range(20):
        prompt = rng.integers(0, 5, size=12).tolist()
        out = rng.integers(0, 5, size=15).tolist()
        acc, ngram, chain, _ = lookup_positions(prompt, out, depth=4)
        for t in range(len(out)):
            n, draft = find_match(np.array(prompt + out[:t]), 4)
            assert (ngram[t], chain[t]) == (n, len(draft))
            k = 0
            while k < len(draft) and t + k < len(out) and draft[k] == out[t + k]:
                k += 1
            assert acc[t] == k


def expansion_accepts(ranks: np.ndarray, widths: tuple[int, ...]) -> np.ndarray:
    tree = TreeConfig(widths=widths)
    return tree.policy.accepts(tree, ranks)


def test_expansion_accepts_from_ranks():
    ranks = np.array([0, 0, 2, 0, 5, 0, NOT_DRAFTABLE, 0])
    # widths 1,1,3: level 3 accepts ranks < 3
    assert expansion_accepts(ranks, (1, 1, 3)).tolist() == [3, 1, 0, 1, 0, 1, 0, 1]
    assert expansion_accepts(ranks, (1,)).tolist() == [1, 1, 0, 1, 0, 1, 0, 1]
    dynamic = TreeConfig(kind="dynamic")
    with pytest.raises(ValueError, match="expansion trees"):
        dynamic.policy.accepts(dynamic, ranks)


def test_draft_ranks_match_the_models_own_argmax():
    """Teacher-forced ranks: 0 exactly where the model's greedy token after the true prefix is the
    output token, and a restricted head ranks within its ids (others are not draftable)."""
    torch.manual_seed(0)
    model = tiny_llama(1)
    prompt, out = [3, 4, 5], [6, 7, 8, 9, 10, 11]
    ranks = draft_ranks(model, prompt, out)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    for t, tok in enumerate(out):
        assert ranks[t] == int((logits[t] > logits[t, tok]).sum())
    head = torch.tensor([6, 8, 10, 20, 30])
    r = draft_ranks(model, prompt, out, head)
    for t, tok in enumerate(out):
        if tok in head.tolist():
            assert r[t] == int((logits[t, head] > logits[t, tok]).sum())
        else:
            assert r[t] == NOT_DRAFTABLE


def _lookup_record(i: int, rng) -> RequestRecord:
    """A request where a 3-token match is always copied for 8 tokens and a 1-token match never."""
    t_out = 60
    ngram = rng.choice([0, 1, 3], size=t_out, p=[0.3, 0.5, 0.2])
    acc = np.where(ngram == 3, 8, 0)
    feats = RequestFeatures(prompt_tokens=4, chat=True, hidden_mean=np.zeros(2, np.float32), ngrams=np.ones(1, np.float32))
    return RequestRecord(
        f"r{i}", feats, acc[:, None], new_tokens=t_out, wall_s=1.0, prefill_s=0.0, lookup=0,
        ngram=ngram, chain=np.where(ngram > 0, 8, 0),
    )


def test_fitted_lookup_lengths_skip_weak_matches():
    rng = np.random.default_rng(0)
    records = [_lookup_record(i, rng) for i in range(6)]
    # verification grows with nodes: a wasted 8-token chain costs 50 % of a plain step
    costs = CostModel(
        depths=(4, 8), nodes_per_ssm=((1.0, 2.0),), draft_s=((1e-4, 1e-4),), ssm_prefill_s_per_token=(0.0,),
        verify_nodes=(0, 8), verify_s=(0.02, 0.03), overhead_s=(0.0, 0.0),
    )
    table = fit_ngram_depths(records, costs, mask=0b1, depth=8, lookup=0)
    assert table == (0, 8, 8)  # 2-token matches never occur: that entry keeps its start, 8
    assert mean_tokens_per_s(records, Candidate(0b1, 8, table), costs) > mean_tokens_per_s(records, Candidate(0b1, 8, (8, 8, 8)), costs)
    # when drafting is free, nothing beats drafting the whole chain: no table
    flat = CostModel(
        depths=(4, 8), nodes_per_ssm=((1.0, 2.0),), draft_s=((0.0, 0.0),), ssm_prefill_s_per_token=(0.0,),
        verify_nodes=(0, 8), verify_s=(0.02, 0.02), overhead_s=(0.0, 0.0),
    )
    assert fit_ngram_depths(records, flat, mask=0b1, depth=8, lookup=0) == ()


def test_the_lookup_table_is_served_only_where_it_pays_held_out():
    """fit_scheduler keeps a fitted table only where cross-validation shows it faster than the fixed
    chain; where the fitted table's gain is below the margin, the fixed chain is served."""
    import dataclasses

    from boosttune.config import SchedulerConfig
    from boosttune.scheduler.features import FeatureSpec
    from boosttune.scheduler.offline.train import fit_scheduler

    rng = np.random.default_rng(0)
    records = [_lookup_record(i, rng) for i in range(8)]
    records = [dataclasses.replace(r, features=dataclasses.replace(r.features, hidden_mean=rng.normal(size=2).astype(np.float32)))
               for r in records]  # features that vary (constant ones leave the PCA nothing to scale)
    spec = FeatureSpec(hidden_size=2, ngram_buckets=1, lookup=False)
    cfg = SchedulerConfig(prompts="unused", depths=(4, 8), pca_components=2, ridge_alphas=(1.0,), cv_folds=4)

    def costs(wasted: float) -> CostModel:  # a wasted 8-token chain costs ``wasted`` of a plain step
        return CostModel(
            depths=(4, 8), nodes_per_ssm=((1.0, 2.0),), draft_s=((1e-4, 1e-4),), ssm_prefill_s_per_token=(0.0,),
            verify_nodes=(0, 8), verify_s=(0.02, 0.02 * (1 + wasted)), overhead_s=(0.0, 0.0),
        )

    paying = fit_scheduler(records, costs(0.5), spec, (1,), cfg)
    cv = paying.meta["crossval"]["lookup_depths"]
    assert paying.lookup_depths == (0, 8, 8) and cv["adopted"] and cv["low"] > 1.0 and cv["requests"] == 8
    # a chain so cheap to waste that the table's edge falls below the 2 % margin: fitted, not served
    marginal = fit_scheduler(records, costs(0.002), spec, (1,), cfg)
    cv = marginal.meta["crossval"]["lookup_depths"]
    assert marginal.meta["crossval"]["fitted_lookup_depths"] and not cv["adopted"] and cv["ratio"] < 1.02
    assert marginal.lookup_depths == ()
