"""The lean drafter runner computes what ModelRunner computes: same logits and hidden states through
prefills, tree feeds, cache compaction and crops, with restricted heads and embeddings as input;
engines drafting through it decode exactly as plain decoding does."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import perturbed, tiny_llama

from boosttune.assemble import engine_from_models
from boosttune.serving import lean
from boosttune.serving.decode import incremental_generate
from boosttune.serving.drafter import SSMDrafter
from boosttune.serving.lean import LeanRunner, drafter_runner, lean_reason
from boosttune.serving.runner import ModelRunner
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _pair(seed: int = 3, head_ids=None):
    model = tiny_llama(seed, layers=3)
    return LeanRunner(model, head_ids), ModelRunner(copy.deepcopy(model), head_ids)


@pytest.mark.parametrize("head_ids", [None, torch.tensor([5, 1, 9, 30, 2])])
@torch.inference_mode()  # as the engine steps
def test_lean_runner_matches_model_runner_through_a_request(head_ids):
    leanr, ref = _pair(head_ids=head_ids)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 64, (9,), generator=g)
    _close(leanr.forward_chain(prompt), ref.forward_chain(prompt))
    for _ in range(4):  # a step: a small tree fed in one forward, then two of its nodes kept
        p = leanr.cached_len
        toks = torch.randint(2, 64, (1, 4), generator=g)
        pos = torch.tensor([[p, p + 1, p + 1, p + 2]])
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        a, ha = leanr.forward_hidden(toks, pos, p, mask)
        b, hb = ref.forward_hidden(toks, pos, p, mask)
        _close(a, b)
        _close(ha, hb)
        keep = torch.tensor([0, 1, 3])
        leanr.keep(p, keep)
        ref.keep(p, keep)
        assert leanr.cached_len == ref.cached_len == p + 3
    leanr.crop(5)
    ref.crop(5)
    nxt = torch.tensor([7, 8])
    _close(leanr.forward_chain(nxt), ref.forward_chain(nxt))
    leanr.reset()
    ref.reset()
    _close(leanr.forward_chain(prompt), ref.forward_chain(prompt))


def test_lean_runner_takes_embeddings_and_grows_its_cache():
    leanr, ref = _pair(4)
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(1, 300, 32, generator=g)  # past the first capacity (256): the cache doubles
    pos = torch.arange(300).unsqueeze(0)
    mask = torch.ones(300, 300, dtype=torch.bool).tril()
    a, ha = leanr.forward_hidden(emb, pos, 0, mask)
    b, hb = ref.forward_hidden(emb, pos, 0, mask)
    _close(a, b)
    _close(ha, hb)
    _close(leanr.chain_hidden(torch.tensor([3, 4])), ref.chain_hidden(torch.tensor([3, 4])))


def test_fused_weights_follow_changes_of_the_model():
    leanr, ref = _pair(5)
    ids = torch.tensor([3, 9, 4])
    leanr.forward_chain(ids)
    with torch.no_grad():
        for m in (leanr.model, ref.model):
            torch.manual_seed(0)
            for p in m.parameters():
                p.mul_(0.9).add_(0.01)
    leanr.reset()
    ref.reset()
    _close(leanr.forward_chain(ids), ref.forward_chain(ids))


def test_only_plain_llama_models_qualify(monkeypatch):
    model = tiny_llama(6)
    assert lean_reason(model) is None and isinstance(drafter_runner(model), LeanRunner)
    biased = tiny_llama(6)
    biased.config.attention_bias = True
    assert "bias" in lean_reason(biased) and type(drafter_runner(biased)) is ModelRunner
    with pytest.raises(ValueError, match="LeanRunner"):
        LeanRunner(biased)
    monkeypatch.setenv(lean.ENV_VAR, "0")
    assert type(drafter_runner(model)) is ModelRunner


def test_the_llm_runs_lean_on_cpu_in_assembled_engines():
    """On CPU the assembled engine's LLM runs through LeanRunner (its plain decoding too: bench's baseline),
    and its greedy output is transformers' incremental decoding's, token for token (fp32)."""
    from boosttune.serving.engine import Plan
    from boosttune.serving.lean import llm_runner

    llm = tiny_llama(7)
    biased = tiny_llama(7)
    biased.config.attention_bias = True
    assert isinstance(llm_runner(llm), LeanRunner) and type(llm_runner(biased)) is ModelRunner
    engine = engine_from_models(llm, [perturbed(llm, 8, 0.3)], TreeConfig(widths=(2, 1, 1)))
    assert isinstance(engine.llm, LeanRunner)
    stop = StopCriteria(max_new_tokens=24)
    for prompt in ([3, 4, 5], [9, 1, 2, 9, 1]):
        ref = incremental_generate(llm, prompt, stop).tokens
        assert engine.generate(prompt, stop).tokens == ref
        assert engine.generate(prompt, stop, plan=Plan()).tokens == ref  # plain decoding, the same runner


@pytest.mark.parametrize("tree", [TreeConfig(widths=(1, 3, 1)), TreeConfig(kind="dynamic", topk=3, depth=3, budget=6)])
def test_engines_drafting_through_lean_runners_decode_exactly(tree, monkeypatch):
    llm = tiny_llama(0)
    ssms = [perturbed(llm, 1, 0.3), perturbed(llm, 2, 0.5)]
    engine = engine_from_models(llm, ssms, tree)
    assert all(isinstance(d.runner, LeanRunner) for d in engine.drafters.values() if isinstance(d, SSMDrafter))
    monkeypatch.setenv(lean.ENV_VAR, "0")
    reference = engine_from_models(llm, ssms, tree)  # the same drafters through transformers' forward
    assert not any(isinstance(d.runner, LeanRunner) for d in reference.drafters.values())
    stop = StopCriteria(max_new_tokens=40)
    for prompt in ([5, 9, 2], [7, 3, 3, 11, 20]):
        res = engine.generate(prompt, stop)
        assert res.tokens == incremental_generate(llm, prompt, stop).tokens
        assert res.accept_lengths == reference.generate(prompt, stop).accept_lengths  # the same drafts
        assert res.tau > 1.1
