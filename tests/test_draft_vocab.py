"""Draft vocabulary: SSMs computing logits over the K most frequent tokens only.

The restricted head must give the full head's logits on its K tokens and -inf elsewhere; greedy
output stays token-identical to incremental decoding even when the LLM writes tokens the drafts
cannot propose; sampled output keeps the LLM's distribution (chi-square on an enumerable
vocabulary, with the accept-always negative control of test_engine_sampling); a bad ranking file
is refused naming the field.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import perturbed, tiny_llama
from test_engine_sampling import (
    NEGATIVE_RUNS,
    VOCAB,
    _accept_always,
    exact_distribution,
    pvalue,
    run_engine,
    sampling_models,
)

from boosttune.assemble import engine_from_models
from boosttune.serving.decode import incremental_generate
from boosttune.serving.draft_vocab import coverage, head_ids, load_ranking, rank_tokens, save_ranking
from boosttune.serving.drafter import SSMDrafter
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.lean import drafter_runner
from boosttune.serving.runner import ModelRunner, restricted_head_error
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig


def test_ranking_orders_by_count_then_id_and_lists_every_token(tmp_path):
    ranking, counts = rank_tokens([[5, 3, 5], [3, 5, 9], [7]], vocab_size=10)
    assert ranking == [5, 3, 7, 9, 0, 1, 2, 4, 6, 8]
    assert counts[5] == 3 and sum(counts.values()) == 7
    save_ranking(tmp_path / "r.json", ranking, counts)
    assert load_ranking(tmp_path / "r.json").tolist() == ranking
    assert head_ids(torch.tensor(ranking), 3, rows=8).tolist() == [5, 3, 7]
    assert head_ids(torch.tensor(ranking), 4, rows=8).tolist() == [5, 3, 7, 0], "ids past the head are skipped"
    assert coverage(torch.tensor(ranking), 2, [[5, 3, 1, 1]]) == 0.5
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rank_tokens([[12]], vocab_size=10)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"ranking": [0, 1, 1, 3]}, "every id"), ({"ranking": [0, 1, 2]}, "'ranking' must list"),
     ({"version": 9}, "version 1"), ({"ranking": [0, 1, 2, 4]}, "every id")],
)
def test_bad_ranking_files_are_refused(tmp_path, change, message):
    body = {"format": "boosttune.draft_vocab", "version": 1, "vocab_size": 4, "tokens_counted": 3, "distinct": 2,
            "ranking": [0, 1, 2, 3]}
    (tmp_path / "r.json").write_text(json.dumps({**body, **change}))
    with pytest.raises(ValueError, match=message):
        load_ranking(tmp_path / "r.json")


def test_restricted_head_gives_the_full_logits_on_its_tokens():
    model = tiny_llama(21)
    ids = torch.tensor([7, 3, 40, 11])
    prompt = torch.tensor([4, 9, 2, 30, 5])
    full = ModelRunner(model).forward_chain(prompt)  # (T, V)
    cut = ModelRunner(model, head_ids=ids).forward_chain(prompt)
    torch.testing.assert_close(cut[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    others = torch.ones(full.shape[-1], dtype=torch.bool)
    others[ids] = False
    assert torch.isinf(cut[:, others]).all() and (cut[:, others] < 0).all()


def test_models_that_rescale_their_logits_keep_the_full_head():
    model = tiny_llama(22)
    assert restricted_head_error(model) is None
    model.config.logit_scale = 0.5
    assert "logit_scale" in restricted_head_error(model)
    with pytest.raises(ValueError, match="use the full vocabulary"):
        ModelRunner(model, head_ids=torch.tensor([1, 2]))


@pytest.mark.parametrize("k", [3, 12, 64])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_with_a_draft_vocabulary_matches_incremental(seed, k):
    llm = tiny_llama(seed + 30, layers=3)
    ssms = [perturbed(llm, seed + 40 + j, noise=0.1) for j in range(2)]
    stop = StopCriteria(max_new_tokens=30)
    prompt = [3, 4, 5, 6][: seed + 2]
    ref = incremental_generate(llm, prompt, stop)
    # Rank by what the LLM writes, so drafts can succeed, but cut at k: with k = 3 most of the
    # LLM's tokens are outside the draft vocabulary and those drafts must be rejected, not forced.
    ranking, _ = rank_tokens([ref.tokens], vocab_size=64)
    tree = TreeConfig(widths=(2, 1, 1), draft_vocab=k)
    eng = engine_from_models(llm, ssms, tree, ranking=torch.tensor(ranking))
    out = eng.generate(prompt, stop)
    assert out.tokens == ref.tokens
    drafted = set(head_ids(torch.tensor(ranking), k, 64).tolist())
    if k == 3:
        assert not set(ref.tokens) <= drafted, "the test needs LLM tokens outside the draft vocabulary"
    assert sum(out.proposer_hits.values()) > 0


def test_greedy_drafts_rank_the_draft_vocabulary_alone():
    """A greedy tree ranks the K logits of its draft vocabulary instead of all V (the others are -inf):
    the same children, in the same order, with the same q, as ranking the whole row."""
    model = tiny_llama(25, layers=2)
    ranking = torch.randperm(64, generator=torch.Generator().manual_seed(5))
    tree = TreeConfig(widths=(3, 2), draft_vocab=12)
    fast, whole = (SSMDrafter(drafter_runner(model), 64, ranking) for _ in range(2))
    for d in (fast, whole):
        d.prepare(tree)
    whole._greedy_ids = None  # the reference: softmax and top-k over the whole row
    committed = torch.tensor([3, 4, 5, 6, 7])
    a, b = (d.draft(committed, tree, SamplingParams(), None) for d in (fast, whole))
    assert a.size == b.size == 3 + 3 * 2
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    torch.testing.assert_close(a.q_prob, b.q_prob, rtol=1e-5, atol=1e-6)
    assert set(a.tokens.tolist()) <= set(head_ids(ranking, 12, 64).tolist())


def test_a_tree_with_a_draft_vocabulary_needs_a_ranking():
    llm = tiny_llama(23)
    eng = engine_from_models(llm, [perturbed(llm, 1, 0.1)], TreeConfig(widths=(1,), draft_vocab=8))
    with pytest.raises(ValueError, match="needs the draft vocabulary ranking"):
        eng.generate([3, 4], StopCriteria(max_new_tokens=3))


def test_draft_vocabulary_follows_the_tree_of_each_request():
    llm = tiny_llama(24)
    ranking = torch.arange(64).flip(0)
    eng = engine_from_models(llm, [perturbed(llm, 2, 0.1)], TreeConfig(widths=(1, 1)), ranking=ranking)
    runner = eng.drafters["ssm-1"].runner
    stop = StopCriteria(max_new_tokens=6)
    eng.generate([3, 4], stop, plan=Plan({"ssm-1": TreeConfig(widths=(1, 1), draft_vocab=5)}))
    assert runner.head_ids.tolist() == [63, 62, 61, 60, 59]
    eng.generate([3, 4], stop)
    assert runner.head_ids is None, "the drafter's own tree (whole vocabulary) is back after the request"


def _restricted_engine(llm, ssms, excluded: int) -> SpeculativeEngine:
    # ``excluded`` is ranked last, outside both draft vocabularies: only verification's residual
    # (or the bonus token) can produce it.
    ranking = torch.tensor([t for t in range(VOCAB) if t != excluded] + [excluded])
    trees = [TreeConfig(widths=(2, 2), min_prob=0.15, draft_vocab=3), TreeConfig(widths=(2, 1), draft_vocab=2)]
    drafters = {f"ssm-{i}": SSMDrafter(drafter_runner(s), ranking=ranking) for i, s in enumerate(ssms)}  # as served
    return SpeculativeEngine(ModelRunner(llm), drafters, Plan(dict(zip(drafters, trees, strict=True))))


def _likeliest_first_token(exact: dict[tuple[int, int], float]) -> int:
    return max(range(VOCAB), key=lambda t: sum(p for (a, _), p in exact.items() if a == t))


def restricted_engine(excluded: int) -> SpeculativeEngine:
    """The recipe: both sampling SSMs on draft vocabularies that leave ``excluded`` out."""
    return _restricted_engine(*sampling_models(), excluded=excluded)


def test_sampling_with_a_draft_vocabulary_keeps_the_llm_distribution():
    llm, _ = sampling_models()
    exact = exact_distribution(llm)
    first = _likeliest_first_token(exact)
    counts = run_engine(restricted_engine, (first,))
    assert sum(c for (a, _), c in counts.items() if a == first) > 0
    pv = pvalue(counts, exact)
    assert pv > 1e-3, f"chi-square p-value {pv:.2e}: a restricted draft vocabulary changed the output distribution"


def test_negative_control_accept_always_with_a_draft_vocabulary_fails():
    llm, _ = sampling_models()
    exact = exact_distribution(llm)
    counts = run_engine(restricted_engine, (_likeliest_first_token(exact),), runs=NEGATIVE_RUNS, verifier=_accept_always)
    pv = pvalue(counts, exact)
    assert pv < 1e-6, f"the wrong verifier passed (p-value {pv:.2e}): the test has no power"
