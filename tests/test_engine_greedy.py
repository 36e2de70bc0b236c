"""Greedy speculative output must be token-identical to incremental decoding (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_llama

from boosttune.assemble import engine_from_models
from boosttune.serving.decode import incremental_generate
from boosttune.serving.drafter import SSMDrafter
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig

TREES = {
    "chain": TreeConfig(widths=(1, 1, 1, 1)),
    "specinfer": TreeConfig(widths=(1, 1, 3, 1, 1, 1, 1, 1)),
    "wide": TreeConfig(widths=(3, 2, 2)),
    "dynamic": TreeConfig(kind="dynamic", topk=3, depth=4, budget=12),
    "pruned": TreeConfig(widths=(2, 2, 2, 1, 1), min_prob=0.05),
}


def engine(llm, ssms, trees) -> SpeculativeEngine:
    drafters = {f"ssm-{i}": SSMDrafter(ModelRunner(s)) for i, s in enumerate(ssms)}
    return SpeculativeEngine(ModelRunner(llm), drafters, Plan(dict(zip(drafters, trees, strict=True))))


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("seed", range(6))
def test_single_ssm_matches_incremental(tree, seed):
    llm = tiny_llama(seed)
    ssm = perturbed(llm, seed + 100, noise=0.15)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 64, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
    stop = StopCriteria(max_new_tokens=33)
    ref = incremental_generate(llm, prompt, stop)
    out = engine(llm, [ssm], [TREES[tree]]).generate(prompt, stop)
    assert out.tokens == ref.tokens
    assert sum(out.accept_lengths) == len(out.tokens) == 33
    assert out.steps < 33, "a 15%-noise copy of the LLM should get some drafts accepted"


@pytest.mark.parametrize("seed", range(6))
def test_merged_ssms_match_incremental(seed):
    llm = tiny_llama(seed, layers=3)
    ssms = [perturbed(llm, seed + 10 * k, noise=0.1 + 0.1 * k) for k in range(3)]
    trees = [TREES["specinfer"], TREES["wide"], TREES["dynamic"]]
    prompt = [3, 4, 5, 6, 7][: seed + 1]
    stop = StopCriteria(max_new_tokens=40)
    ref = incremental_generate(llm, prompt, stop)
    out = engine(llm, ssms, trees).generate(prompt, stop)
    assert out.tokens == ref.tokens
    assert sum(out.proposer_hits.values()) > 0


def test_llm_as_its_own_ssm_accepts_every_draft():
    llm = tiny_llama(3)
    stop = StopCriteria(max_new_tokens=25)
    out = engine(llm, [llm], [TreeConfig(widths=(1, 1, 1, 1))]).generate([5, 6], stop)
    assert out.tokens == incremental_generate(llm, [5, 6], stop).tokens
    assert out.accept_lengths == [5, 5, 5, 5, 5]


def test_eos_and_max_new_tokens_cut_inside_a_step():
    llm = tiny_llama(4)
    ref = incremental_generate(llm, [9, 8], StopCriteria(max_new_tokens=30)).tokens
    eos = ref[6]
    first = ref.index(eos)
    stop = StopCriteria(max_new_tokens=30, eos_token_ids=frozenset({eos}))
    out = engine(llm, [llm], [TreeConfig(widths=(1,) * 5)]).generate([9, 8], stop)
    assert out.tokens == ref[: first + 1] and out.finish_reason == "stop"
    stop = StopCriteria(max_new_tokens=7)
    out = engine(llm, [llm], [TreeConfig(widths=(1,) * 5)]).generate([9, 8], stop)
    assert out.tokens == ref[:7] and out.finish_reason == "length"


def test_no_drafters_is_plain_incremental_decoding():
    llm = tiny_llama(5)
    stop = StopCriteria(max_new_tokens=12)
    out = SpeculativeEngine(ModelRunner(llm), {}, Plan()).generate([1, 2, 3], stop)
    assert out.tokens == incremental_generate(llm, [1, 2, 3], stop).tokens
    assert out.accept_lengths == [1] * 12


@pytest.mark.parametrize("extra", [8, 16])
def test_ssm_with_padded_vocabulary_matches_incremental(extra):
    llm = tiny_llama(6)
    ssm = perturbed(llm, 60, noise=0.1)
    ssm.resize_token_embeddings(64 + extra)
    stop = StopCriteria(max_new_tokens=20)
    ref = incremental_generate(llm, [4, 5, 6], stop)
    out = engine_from_models(llm, [ssm], TreeConfig(widths=(2, 1, 1))).generate([4, 5, 6], stop)
    assert out.tokens == ref.tokens


def test_greedy_trees_branch_on_the_ssms_next_best_tokens():
    """A width-3 level holds the SSM's three most likely tokens with their softmax probabilities
    (the one-hot greedy distribution would give the argmax and two arbitrary zero-q tokens)."""
    ssm = tiny_llama(2)
    prompt = [3, 4, 5]
    drafter = SSMDrafter(ModelRunner(ssm))
    tree = drafter.draft(torch.tensor(prompt), TreeConfig(widths=(3, 2)), SamplingParams(), None)
    with torch.inference_mode():
        probs = torch.softmax(ssm(torch.tensor([prompt])).logits[0, -1].float(), -1)
    top = probs.topk(3)
    level1 = tree.depth == 1
    assert tree.tokens[level1].tolist() == top.indices.tolist()
    torch.testing.assert_close(tree.q_prob[level1], top.values)
    assert int((tree.depth == 2).sum()) == 6 and bool((tree.q_prob > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_picks_argmaxs_index_ties_and_nans_included(dtype):
    """``greedy_tokens`` (torch.max's indices, the faster kernel) picks what argmax picks: the lowest index
    among tied maxima, and a NaN as the largest, in every row of a large vocabulary."""
    from boosttune.serving.sampling import greedy_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 49152, generator=g).to(dtype)
    logits[1:, :] = logits[1:, :].round()  # coarse values: ties everywhere
    logits[3, [7, 100, 40000]] = 50.0  # a tie of three at the top
    logits[4, 30000] = float("nan")
    logits[5, [9, 20]] = float("nan")
    picked = greedy_tokens(logits)
    assert torch.equal(picked, logits.argmax(-1))
    assert picked[3] == 7 and picked[4] == 30000 and picked[5] == 9
    assert int(greedy_tokens(logits[6])) == int(logits[6].argmax())
