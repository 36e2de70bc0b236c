"""Batched decoding: several requests verified in one LLM forward decode exactly as each would alone (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import noisy_head, perturbed, tiny_llama

from boosttune.assemble import engine_from_models
from boosttune.serving.batch import BatchedDecoder, Member, Request, batch_reason
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.lean import Feed, LeanRunner, run_many
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig

PROMPTS = [[5, 9, 11, 5, 9], [7], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3, 4], [20, 21, 22, 20, 21], [2, 30, 31, 32, 33, 2]]
LENGTHS = [24, 9, 30, 17, 12]


@pytest.fixture(scope="module")
def models():
    llm = tiny_llama(0, vocab=64, layers=2)
    return llm, perturbed(llm, 1, 0.3), noisy_head(llm, 2, 0.2)


def _eagle3(llm):
    """An EAGLE-3 head over 40 of the 64 tokens, reading layer 0's input and layer 1's twice."""
    from boosttune.core.eagle3_head import Eagle3Spec
    from boosttune.train.eagle3 import init_head

    head = init_head(llm, Eagle3Spec.from_llm(llm.config, 40, (0, 1, 1)), torch.arange(3, 43))
    return head.eval().requires_grad_(False)


def _engine(models, kinds=("ssm", "feature"), lookup=4) -> SpeculativeEngine:
    llm, ssm, head = models
    drafters = {"ssm": ssm, "feature": head}
    if "eagle3" in kinds:
        drafters["eagle3"] = _eagle3(llm)
    named = {k: drafters[k] for k in kinds}
    trees = {"ssm": TreeConfig(widths=(2, 2, 1)), "feature": TreeConfig(widths=(3, 1)),
             "eagle3": TreeConfig(widths=(2, 1, 1))}
    return engine_from_models(llm, named, {k: trees[k] for k in kinds}, lookup=lookup,
                              kinds={k: k for k in kinds})


def _alone(engine, i, sampling=None):
    return engine.generate(PROMPTS[i], StopCriteria(max_new_tokens=LENGTHS[i]), sampling).tokens


def _run_batch(batch: BatchedDecoder, joins: dict[int, list[int]], sampling=lambda i: None) -> dict[int, list[int]]:
    """Step the batch; at step s the requests ``joins[s]`` join, prefilled together. Returns each
    request's tokens."""
    streamed: dict[int, list[int]] = {}
    out: dict[int, list[int]] = {}
    step = 0
    while step <= max(joins) or len(batch):
        for i in joins.get(step, []):
            streamed[i] = []
        joined = batch.add_many([Request(PROMPTS[i], StopCriteria(max_new_tokens=LENGTHS[i]), sampling(i),
                                         on_tokens=streamed[i].extend, tag=i) for i in joins.get(step, [])])
        assert all(isinstance(m, Member) for m in joined), joined
        for m in batch.step():
            assert m.error is None, m.error
            out[m.tag] = m.stream.result().tokens
            assert streamed[m.tag] == out[m.tag], "streamed tokens are the result's"
        step += 1
    return out


def test_run_many_computes_what_each_runner_computes_alone(models):
    llm = models[0]
    base = LeanRunner(llm)
    solo = [base.spawn() for _ in range(3)]
    batched = [base.spawn() for _ in range(3)]
    for runners in (solo, batched):  # three requests of different lengths in the cache
        for r, n in zip(runners, (3, 7, 1), strict=True):
            r.forward_chain(torch.arange(2, 2 + n))
    feeds = []
    for r, t in zip(batched, (1, 4, 2), strict=True):
        p = r.cached_len
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        feeds.append((r, Feed(torch.arange(5, 5 + t).unsqueeze(0), torch.arange(p, p + t).unsqueeze(0), p, mask,
                              hidden=t == 4)))
    outs = run_many(feeds)
    for (r, f), s, (logits, hidden) in zip(feeds, solo, outs, strict=True):
        want, want_hidden = s.forward_hidden(f.inputs, f.position_ids, f.prefix_len, f.tree_mask)
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        assert (hidden is None) == (not f.hidden)
        if f.hidden:
            torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
        assert r.cached_len == s.cached_len


def test_prefill_skips_the_lm_head_and_leaves_the_cache_as_a_full_forward_does(models):
    llm = models[0]
    base = LeanRunner(llm)
    lean, full, plain = base.spawn(), base.spawn(), ModelRunner(llm)
    prompt = torch.arange(3, 40) % 60
    hidden = lean.chain_hidden(prompt)
    torch.testing.assert_close(hidden, plain.chain_hidden(prompt), rtol=1e-5, atol=1e-5)
    full.forward_chain(prompt)
    nxt = torch.tensor([9, 4])
    torch.testing.assert_close(lean.forward_chain(nxt), full.forward_chain(nxt), rtol=1e-6, atol=1e-6)
    # in one forward: a feed without logits (a prefill) beside one with them
    a, b = base.spawn(), base.spawn()
    b.forward_chain(prompt[:5])
    outs = run_many([(a, Feed(prompt.unsqueeze(0), torch.arange(37).unsqueeze(0), 0,
                              torch.ones(37, 37, dtype=torch.bool).tril(), logits=False)),
                     (b, Feed(torch.tensor([[7]]), torch.tensor([[5]]), 5, torch.ones(1, 1, dtype=torch.bool)))])
    assert outs[0] == (None, None)
    solo = base.spawn()
    solo.forward_chain(prompt[:5])
    torch.testing.assert_close(outs[1][0], solo.forward_chain(torch.tensor([7])), rtol=1e-5, atol=1e-5)
    assert a.cached_len == 37


@pytest.mark.parametrize(("max_tokens", "prefill_tokens"), [(64, 512), (9, 8)])
def test_greedy_requests_joining_mid_stream_decode_as_alone(models, max_tokens, prefill_tokens):
    """max_tokens 9: trees cut to the budget, some steps without drafting; prefill_tokens 8: the
    joining prompts (4, 0 and 13 tokens before the pending one) prefill in two forwards."""
    engine = _engine(models)
    want = {i: _alone(engine, i) for i in range(len(PROMPTS))}
    batch = BatchedDecoder(engine, max_batch=5, max_tokens=max_tokens, draft_max_batch=5,
                           prefill_tokens=prefill_tokens)
    got = _run_batch(batch, {0: [0, 1, 2], 2: [3], 5: [4]})
    assert got == want


def test_a_request_that_fails_to_join_leaves_the_others_joining(models):
    engine = _engine(models)
    want = {i: _alone(engine, i) for i in (0, 2)}
    batch = BatchedDecoder(engine, max_batch=3, max_tokens=64, draft_max_batch=3)
    stop = StopCriteria(max_new_tokens=LENGTHS[0])
    joined = batch.add_many([Request(PROMPTS[0], stop, tag=0), Request([], stop, tag=1),
                             Request(PROMPTS[2], StopCriteria(max_new_tokens=LENGTHS[2]), tag=2)])
    assert isinstance(joined[1], ValueError) and "at least one token" in str(joined[1])
    assert [m.tag for m in batch.members] == [0, 2] and len(batch._kv.users) == 2  # its caches went to the next
    out = {}
    while len(batch):
        out.update((m.tag, m.stream.result().tokens) for m in batch.step())
    assert out == want
    with pytest.raises(RuntimeError, match="do not fit"):
        batch.add_many([Request(PROMPTS[0], stop)] * 4)


def test_requests_with_an_eagle3_head_decode_as_alone(models):
    """The LLM's taps (the head's layer inputs) come out of the batched forward for every request."""
    engine = _engine(models, kinds=("feature", "eagle3"))
    assert engine.llm.taps == (0, 1)
    want = {i: _alone(engine, i) for i in range(len(PROMPTS))}
    batch = BatchedDecoder(engine, max_batch=5, max_tokens=64, draft_max_batch=5)
    assert _run_batch(batch, {0: [0, 1, 2], 2: [3], 5: [4]}) == want


def test_sampled_requests_decode_as_alone_with_their_seeds(models):
    engine = _engine(models)
    params = {i: SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i) for i in range(len(PROMPTS))}
    want = {i: _alone(engine, i, params[i]) for i in range(len(PROMPTS))}
    batch = BatchedDecoder(engine, max_batch=5, max_tokens=256, draft_max_batch=5)  # every step drafts
    got = _run_batch(batch, {0: [0, 1], 1: [2, 3, 4]}, sampling=params.get)
    assert got == want


def test_larger_batches_take_plain_steps_and_still_decode_as_alone(models):
    engine = _engine(models)
    want = {i: _alone(engine, i) for i in range(len(PROMPTS))}
    batch = BatchedDecoder(engine, max_batch=5, max_tokens=64, draft_max_batch=2)
    nodes = []
    original = batch._draft

    def counting(stream, budget):
        feed = original(stream, budget)
        nodes.append((len(batch), feed.inputs.shape[1] - 1))
        return feed

    batch._draft = counting
    assert _run_batch(batch, {0: [0, 1, 2], 4: [3, 4]}) == want
    assert all(n == 0 for size, n in nodes if size > 2), "no tree above draft_max_batch requests"
    assert any(n > 0 for size, n in nodes if size <= 2), "trees again once the batch shrinks"


def test_a_removed_request_frees_its_caches_for_the_next(models):
    engine = _engine(models, kinds=("feature",), lookup=0)
    want = {i: _alone(engine, i) for i in range(len(PROMPTS))}
    batch = BatchedDecoder(engine, max_batch=2, max_tokens=16, draft_max_batch=2)
    a = batch.add(PROMPTS[2], StopCriteria(max_new_tokens=LENGTHS[2]), tag=2)
    b = batch.add(PROMPTS[0], StopCriteria(max_new_tokens=LENGTHS[0]), tag=0)
    assert batch.full
    batch.step()
    batch.remove(a)  # cancelled after one step
    c = batch.add(PROMPTS[3], StopCriteria(max_new_tokens=LENGTHS[3]), tag=3)
    assert c.caches[0] is a.caches[0], "the cancelled request's caches serve the next one"
    done = {}
    while len(batch):
        for m in batch.step():
            done[m.tag] = m.stream.result().tokens
    assert done == {0: want[0], 3: want[3]}
    assert b.stream.finished


def test_a_failing_request_leaves_the_others_decoding(models):
    engine = _engine(models, kinds=("ssm",), lookup=0)
    want = _alone(engine, 0)
    batch = BatchedDecoder(engine, max_batch=2, max_tokens=16)
    good = batch.add(PROMPTS[0], StopCriteria(max_new_tokens=LENGTHS[0]))

    def boom(tokens):
        raise RuntimeError("client went away")

    bad = batch.add(PROMPTS[1], StopCriteria(max_new_tokens=LENGTHS[1]), on_tokens=boom)
    left = batch.step()
    assert left == [bad] and isinstance(bad.error, RuntimeError)
    while len(batch):
        batch.step()
    assert good.stream.result().tokens == want


def test_engines_that_cannot_batch_say_why(models):
    llm = models[0]
    engine = SpeculativeEngine(ModelRunner(llm), {}, Plan())
    assert "lean" in batch_reason(engine)
    with pytest.raises(ValueError, match="cannot batch"):
        BatchedDecoder(engine)
    with pytest.raises(ValueError, match="max_tokens"):
        BatchedDecoder(_engine(models), max_batch=8, max_tokens=4)
