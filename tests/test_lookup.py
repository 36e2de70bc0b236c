"""Prompt lookup: the n-gram search, and lossless decoding with it (greedy identity, sampled chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import perturbed, tiny_llama
from test_engine_sampling import (
    NEGATIVE_RUNS,
    _accept_always,
    exact_distribution,
    pvalue,
    run_engine,
    sampling_models,
)

from boosttune.serving.decode import incremental_generate
from boosttune.serving.drafter import SSMDrafter
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.lean import drafter_runner
from boosttune.serving.lookup import (
    LOOKUP_NAME,
    PromptLookupDrafter,
    chain_length,
    find_match,
    lookup_tree,
)
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig


def cont(ctx, length, **kw) -> list[int]:
    return find_match(np.array(ctx), length, **kw)[1].tolist()


def test_find_match_prefers_long_ngrams_then_the_latest_match():
    # last 3 tokens "1 2 3" occurred at the start, followed by 4 5 6
    assert cont([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3) == [4, 5, 6]
    assert cont([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 2) == [4, 5]
    # "3" alone occurred twice before: the latest (followed by 8) wins over the earlier (4)
    assert cont([3, 4, 0, 3, 8, 3], 2) == [8, 3]
    # a 2-gram match beats a later 1-gram match
    assert cont([5, 6, 7, 0, 6, 9, 5, 6], 2) == [7, 0]
    assert cont([1, 2, 3], 4) == []  # nothing repeats
    assert cont([4, 4], 3) == [4]  # the match may run into the newest token
    assert cont([1, 2, 1, 2], 5, max_ngram=1) == [1, 2]  # what followed the earlier "2", to the end
    assert cont([1, 2, 1], 0) == []


def test_find_match_reports_the_ngram_and_per_match_lengths_cut_the_chain():
    ctx = np.array([1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    n, chain = find_match(ctx, 8)
    assert n == 3 and chain.tolist() == [4, 5, 6, 9, 1, 2, 3]
    assert find_match(np.array([7, 8, 9]), 4)[0] == 0
    assert [chain_length(n, 8, (0, 2, 5)) for n in (0, 1, 2, 3, 4)] == [0, 0, 2, 5, 5]
    assert chain_length(2, 3, (0, 6)) == 3 and chain_length(1, 6) == 6  # capped at the depth; no table
    drafter, tree = PromptLookupDrafter(vocab_size=16), lookup_tree(8, (0, 2, 5))
    assert drafter.draft(torch.tensor(ctx), tree, SamplingParams(), None).tokens.tolist() == [4, 5, 6, 9, 1]
    one_token_match = torch.tensor([3, 4, 0, 3])  # only "3" repeats: this table drafts nothing
    assert drafter.draft(one_token_match, tree, SamplingParams(), None).size == 0


def lookup_engine(llm, ssms=(), length=4, ngram_depths=()) -> SpeculativeEngine:
    """Prompt lookup merged with ``ssms``, which draft through the runner serving gives them."""
    v = llm.get_output_embeddings().weight.shape[0]
    drafters = {f"ssm-{i}": SSMDrafter(drafter_runner(s)) for i, s in enumerate(ssms)}
    trees = dict.fromkeys(drafters, TreeConfig(widths=(2, 1, 1)))
    drafters[LOOKUP_NAME], trees[LOOKUP_NAME] = PromptLookupDrafter(vocab_size=v), lookup_tree(length, ngram_depths)
    return SpeculativeEngine(ModelRunner(llm), drafters, Plan(trees))


@pytest.mark.parametrize("with_ssm, ngram_depths", [(False, ()), (True, ()), (False, (1, 3, 6))])
def test_greedy_with_prompt_lookup_matches_incremental(with_ssm, ngram_depths):
    hits = 0
    for seed in range(5):
        llm = tiny_llama(seed)
        ssms = [perturbed(llm, seed + 50, noise=0.2)] if with_ssm else []
        prompt = ([5, 9, 13, 7, 5, 9] * 3)[: 6 + 2 * seed]  # repeats itself: lookup finds matches
        stop = StopCriteria(max_new_tokens=40)
        ref = incremental_generate(llm, prompt, stop)
        out = lookup_engine(llm, ssms, length=6, ngram_depths=ngram_depths).generate(prompt, stop)
        assert out.tokens == ref.tokens, seed
        hits += out.proposer_hits[LOOKUP_NAME]
    assert hits > 0, "prompt lookup never had a draft accepted: the test would not exercise it"


PROMPT = [2, 3, 1, 2, 3, 1]  # lookup proposes "2 3" after the last "1"


@pytest.fixture(scope="module")
def models():
    return sampling_models()


def sampling_lookup_engine(n_ssms: int) -> SpeculativeEngine:
    """The recipe: prompt lookup proposing 2 tokens, merged with ``n_ssms`` SSMs."""
    llm, ssms = sampling_models()
    return lookup_engine(llm, ssms[:n_ssms], length=2)


@pytest.mark.parametrize("n_ssms", [0, 1])
def test_sampling_with_prompt_lookup_keeps_the_llm_distribution(models, n_ssms):
    llm, _ = models
    assert cont(PROMPT, 2) == [2, 3]
    exact = exact_distribution(llm, PROMPT)
    assert exact[(2, 3)] < 0.5, "the lookup chain must not be the LLM's near-certain choice"
    pv = pvalue(run_engine(sampling_lookup_engine, (n_ssms,), PROMPT), exact)
    assert pv > 1e-3, f"chi-square p-value {pv:.2e}: sampled output with prompt lookup does not follow the LLM"


def test_negative_control_accepting_lookup_drafts_blindly_fails(models):
    llm, _ = models
    counts = run_engine(sampling_lookup_engine, (0,), PROMPT, runs=NEGATIVE_RUNS, verifier=_accept_always)
    pv = pvalue(counts, exact_distribution(llm, PROMPT))
    assert pv < 1e-6, f"the wrong verifier passed (p-value {pv:.2e}): the test has no power"
