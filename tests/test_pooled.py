"""Caches in a shared pool: a forward of several requests attends in one call per layer and computes what
each request's forward computes alone (fp32), through growth of the pool and with idle slots between."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from boosttune.serving import pooled
from boosttune.serving.lean import Feed, LeanRunner, run_many


@pytest.fixture(scope="module")
def llm():
    return tiny_llama(3, vocab=64, layers=2)


@pytest.fixture
def calls(monkeypatch):
    """Counts the pooled attention calls."""
    seen = []
    attend = pooled.PooledStep.attend

    def counted(self, *args, **kwargs):
        seen.append(self.width)
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(pooled.PooledStep, "attend", counted)
    return seen


def _tree_feed(runner: LeanRunner, t: int, seed: int) -> Feed:
    """``t`` tokens as a tree: token j sees the first and itself, and the one before where j is even."""
    p = runner.cached_len
    mask = torch.eye(t, dtype=torch.bool)
    mask[:, 0] = True
    for j in range(2, t, 2):
        mask[j, j - 1] = True
    ids = torch.randint(2, 60, (1, t), generator=torch.Generator().manual_seed(seed))
    return Feed(ids, torch.arange(p, p + t).unsqueeze(0), p, mask, hidden=t > 2)


def _alone(runner: LeanRunner, f: Feed):
    """``runner``'s logits for ``f`` through its own forward."""
    return runner.forward(f.inputs, f.position_ids, f.prefix_len, f.tree_mask)


def test_pooled_forward_of_trees_equals_each_request_alone(llm, calls):
    base = LeanRunner(llm)
    pool = base.new_pool(5)
    runners = [base.spawn(pool) for _ in range(5)]  # slots 0..4; slot 2 stays idle
    solo = [base.spawn() for _ in range(5)]
    for group in (runners, solo):
        for r, n in zip(group, (3, 9, 1, 14, 6), strict=True):
            r.forward_chain(torch.arange(2, 2 + n) % 60)
    live = [0, 1, 3, 4]
    feeds = [(runners[j], _tree_feed(runners[j], t, j)) for j, t in zip(live, (1, 5, 2, 4), strict=True)]
    outs = run_many(feeds)
    assert calls == [5, 5], "one pooled attention call per layer, over slots 0..4"
    for j, (_, f), (logits, hidden) in zip(live, feeds, outs, strict=True):
        want, want_hidden = solo[j].forward_hidden(f.inputs, f.position_ids, f.prefix_len, f.tree_mask)
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        assert (hidden is None) == (not f.hidden)
        if f.hidden:
            torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
        assert runners[j].cached_len == solo[j].cached_len
    # the idle slot's cache is untouched, and it still decodes as the solo runner does
    torch.testing.assert_close(runners[2].forward_chain(torch.tensor([7])), solo[2].forward_chain(torch.tensor([7])),
                               rtol=1e-5, atol=1e-5)


def test_pool_growth_keeps_every_slot_and_later_forwards_exact(llm, calls):
    base = LeanRunner(llm)
    pool = base.new_pool(2)
    a, b = base.spawn(pool), base.spawn(pool)
    sa, sb = base.spawn(), base.spawn()
    for r in (a, sa):
        r.forward_chain(torch.arange(5, 25) % 60)
    for r in (b, sb):
        r.forward_chain(torch.arange(3, 6))
    cap = pool.capacity
    long = torch.arange(cap + 10) % 60  # grows the pool past its capacity (doubling)
    run_many([(a, Feed(long.unsqueeze(0), torch.arange(20, 20 + long.numel()).unsqueeze(0), 20,
                       torch.ones(long.numel(), long.numel(), dtype=torch.bool).tril(), logits=False)),
              (b, _tree_feed(b, 3, 1))])
    sa.forward_chain(long)
    _alone(sb, _tree_feed(sb, 3, 1))
    assert pool.capacity >= 2 * cap and a._keys[0].data_ptr() == pool.keys[0][0].data_ptr()
    fa, fb = _tree_feed(a, 2, 4), _tree_feed(b, 1, 5)
    (la, _), (lb, _) = run_many([(a, fa), (b, fb)])
    torch.testing.assert_close(la, _alone(sa, fa), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lb, _alone(sb, fb), rtol=1e-5, atol=1e-5)
    assert len(calls) == 4


def test_rows_that_see_no_key_take_the_per_request_path(llm, calls):
    base = LeanRunner(llm)
    pool = base.new_pool(2)
    a, b = base.spawn(pool), base.spawn(pool)
    sa, sb = base.spawn(), base.spawn()
    blind = torch.tensor([[False, False], [True, True]])  # an empty cache and a first row that sees nothing
    fa = Feed(torch.tensor([[4, 5]]), torch.tensor([[0, 1]]), 0, blind)
    fb = Feed(torch.tensor([[6]]), torch.tensor([[0]]), 0, torch.ones(1, 1, dtype=torch.bool))
    (la, _), (lb, _) = run_many([(a, fa), (b, fb)])
    assert calls == []
    torch.testing.assert_close(la, _alone(sa, fa), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lb, _alone(sb, fb), rtol=1e-5, atol=1e-5)


def test_a_pool_refuses_more_runners_than_slots(llm):
    base = LeanRunner(llm)
    pool = base.new_pool(1)
    base.spawn(pool)
    with pytest.raises(RuntimeError, match="1 slots are all taken"):
        base.spawn(pool)


def test_a_pool_gives_back_a_long_requests_room_and_keeps_the_others(llm):
    base = LeanRunner(llm)
    pool = base.new_pool(2)
    short, long = base.spawn(pool), base.spawn(pool)
    solo = base.spawn()
    for r in (short, solo):
        r.forward_chain(torch.arange(2, 40) % 60)
    long.forward_chain(torch.arange(600) % 60)
    assert pool.capacity >= 600
    pool.shrink(short.cached_len)  # the long one left
    assert pool.capacity == 256 and short._keys[0].shape[1] == 256
    nxt = torch.tensor([5, 6])
    torch.testing.assert_close(short.forward_chain(nxt), solo.forward_chain(nxt), rtol=1e-5, atol=1e-5)
    pool.shrink(0)
    assert pool.capacity == 256, "never below 256 positions, nor for a pool within twice what it holds"


def test_caches_stay_longer_than_what_they_hold(llm):
    """A compiled graph traced with caches shorter than their tensors compiles again for a cache that
    fills its tensor exactly: pools and runners keep room beyond every length they are asked for."""
    base = LeanRunner(llm)
    pool = base.new_pool(2)
    pooled_runner, alone = base.spawn(pool), base.spawn()
    for r in (pooled_runner, alone):
        r.forward_chain(torch.arange(255) % 60)
        assert r._keys[0].shape[1] == 256
        r.forward_chain(torch.tensor([3]))  # 256 cached: the tensors grow
        assert r._keys[0].shape[1] > 256


def test_prompts_into_empty_slots_attend_apart_in_bf16(llm):
    """A bf16 wave of prompts into empty slots attends each prompt over its own rows (``prompt_attention``,
    where the native ops are built), and leaves the caches and hidden states each prompt gets alone."""
    model = tiny_llama(3, vocab=64, layers=2).to(torch.bfloat16)
    base = LeanRunner(model)
    pool = base.new_pool(4)
    runners = [base.spawn(pool) for _ in range(4)]
    prompts = [torch.arange(2, 2 + n) % 60 for n in (7, 1, 12, 4)]
    feeds = [(r, Feed(p[None], torch.arange(p.numel())[None], 0, torch.ones(p.numel(), p.numel(), dtype=torch.bool).tril(),
                      hidden=True, logits=False)) for r, p in zip(runners, prompts, strict=True)]
    step = pooled.PooledStep.plan(pool, [(r, 0, f.tree_mask, a, a + f.inputs.shape[1], 0, f.inputs.shape[1])
                                         for (r, f), a in zip(feeds, (0, 7, 8, 20), strict=True)], 2)
    assert step is not None and step.starts.tolist() == [0, 7, 8, 20, 24]
    outs = run_many(feeds)
    for (r, _), p, (logits, hidden) in zip(feeds, prompts, outs, strict=True):
        alone = LeanRunner(model)
        assert logits is None
        torch.testing.assert_close(hidden, alone.chain_hidden(p), rtol=3e-2, atol=3e-2)
        nxt = torch.tensor([[5]])
        at = torch.tensor([[p.numel()]])
        torch.testing.assert_close(r.forward(nxt, at, p.numel(), torch.ones(1, 1, dtype=torch.bool)),
                                   alone.forward(nxt, at, p.numel(), torch.ones(1, 1, dtype=torch.bool)), rtol=3e-2, atol=3e-2)
    later = pooled.PooledStep.plan(pool, [(r, r.cached_len, torch.ones(1, 1, dtype=torch.bool), j, j + 1, r.cached_len,
                                           r.cached_len + 1) for j, r in enumerate(runners)], 2)
    assert later is not None and later.starts is None  # a step over filled caches pads as before
