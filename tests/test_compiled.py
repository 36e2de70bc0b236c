"""The compiled LLM forward computes what the eager lean forward computes, through a whole request;
engines whose LLM runs it decode exactly as plain decoding does; it compiles two graphs, not one per
cache length or tree size; what cannot be compiled says why.

One tiny model is compiled for the whole module (inductor compiles C++: seconds per graph)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import perturbed, tiny_llama
from torch._dynamo.utils import counters

from boosttune.assemble import compile_served, engine_from_models
from boosttune.serving.compiled import compile_reason, compile_runner
from boosttune.serving.decode import incremental_generate
from boosttune.serving.engine import Plan
from boosttune.serving.lean import Feed, LeanRunner, run_many
from boosttune.serving.runner import ModelRunner
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def llm():
    return tiny_llama(11, layers=3)


@pytest.fixture(scope="module")
def compiled(llm):
    """A compiled lean runner of ``llm`` (warmed up: both graphs exist) and the graphs compiled for it."""
    before = counters["stats"]["unique_graphs"]
    runner = LeanRunner(llm)
    compile_runner(runner)
    return runner, counters["stats"]["unique_graphs"] - before


@torch.inference_mode()  # as the engine steps
def test_compiled_runner_matches_the_eager_one_through_a_request(llm, compiled):
    runner = compiled[0].spawn()
    eager = LeanRunner(llm)
    assert runner.compiled is not None and eager.compiled is None
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 64, (9,), generator=g)
    _close(runner.forward_chain(prompt), eager.forward_chain(prompt))
    for step in range(110):  # trees of 4 and plain steps, past the first capacity (256): the cache grows
        p = runner.cached_len
        if step % 3:
            toks = torch.randint(2, 64, (1, 4), generator=g)
            pos = torch.tensor([[p, p + 1, p + 1, p + 2]])
            mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
            keep = torch.tensor([0, 2, 3])
        else:
            toks, pos, mask, keep = torch.randint(2, 64, (1, 1), generator=g), torch.tensor([[p]]), \
                torch.ones(1, 1, dtype=torch.bool), torch.tensor([0])
        a, ha = runner.forward_hidden(toks, pos, p, mask)
        b, hb = eager.forward_hidden(toks, pos, p, mask)
        _close(a, b)
        _close(ha, hb)
        runner.keep(p, keep)
        eager.keep(p, keep)
    assert runner.cached_len == eager.cached_len > 256
    runner.crop(5)
    eager.crop(5)
    nxt = torch.tensor([7, 8, 9])
    _close(runner.forward_chain(nxt), eager.forward_chain(nxt))


def test_two_graphs_serve_every_length_and_tree(compiled):
    """The warm-up compiles a plain step's graph and a tree's; the request above (cache growth, trees,
    plain steps, a chain after a crop) compiled nothing more."""
    assert compiled[1] == 2
    before = counters["stats"]["unique_graphs"]
    runner = compiled[0].spawn()
    with torch.inference_mode():
        runner.prefill(torch.arange(2, 40))
        for t in (1, 5, 9, 1, 3):
            p = runner.cached_len
            runner.forward(torch.full((1, t), 3), torch.arange(p, p + t).unsqueeze(0), p,
                           torch.ones(t, t, dtype=torch.bool).tril())
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize("tree", [TreeConfig(widths=(2, 2, 1)), TreeConfig(kind="dynamic", topk=3, depth=3, budget=6)])
def test_engines_with_a_compiled_llm_decode_exactly(llm, compiled, tree):
    """fp32 greedy output equals transformers' incremental decoding, for plain decoding and drafted
    trees alike, and the drafts are accepted as with the eager LLM forward."""
    ssm = perturbed(llm, 12, 0.3)
    engine = engine_from_models(llm, [ssm], tree)
    eager = engine_from_models(llm, [ssm], tree)
    engine.llm.compiled = compiled[0].compiled  # the module's compiled forward of this very LLM
    stop = StopCriteria(max_new_tokens=40)
    for prompt in ([5, 9, 2], [7, 3, 3, 11, 20, 4]):
        ref = incremental_generate(llm, prompt, stop).tokens
        res = engine.generate(prompt, stop)
        assert res.tokens == ref
        assert engine.generate(prompt, stop, plan=Plan()).tokens == ref
        assert res.accept_lengths == eager.generate(prompt, stop).accept_lengths
        assert res.tau > 1.1


@torch.inference_mode()
def test_batches_of_compiled_runners_run_eager_and_match(llm, compiled):
    """Several requests in one forward take the eager path (each runner alone takes the compiled one)."""
    runners = [compiled[0].spawn() for _ in range(2)]
    alone = [LeanRunner(llm) for _ in range(2)]
    for k, (r, a) in enumerate(zip(runners, alone, strict=True)):
        ids = torch.arange(3 + k, 10 + 2 * k)
        r.prefill(ids)
        a.prefill(ids)
    feeds = [Feed(torch.tensor([[4, 5]]), torch.tensor([[r.cached_len, r.cached_len + 1]]), r.cached_len,
                  torch.ones(2, 2, dtype=torch.bool).tril()) for r in runners]
    together = run_many(list(zip(runners, feeds, strict=True)))
    for (logits, _), a, f in zip(together, alone, feeds, strict=True):
        _close(logits, a.forward(f.inputs, f.position_ids, f.prefix_len, f.tree_mask))


@torch.inference_mode()
def test_a_drafters_runner_with_a_draft_vocabulary_compiles_too(llm):
    """A drafter's head restricted to a draft vocabulary: its logits there, -inf elsewhere, as eager."""
    ids = torch.tensor([5, 1, 9, 30, 2])
    runner, eager = LeanRunner(llm, head_ids=ids), LeanRunner(llm, head_ids=ids)
    compile_runner(runner)
    prompt = torch.randint(2, 64, (7,), generator=torch.Generator().manual_seed(3))
    _close(runner.forward_chain(prompt), eager.forward_chain(prompt))
    p = runner.cached_len
    a, ha = runner.forward_hidden(torch.tensor([[4]]), torch.tensor([[p]]), p, torch.ones(1, 1, dtype=torch.bool))
    b, hb = eager.forward_hidden(torch.tensor([[4]]), torch.tensor([[p]]), p, torch.ones(1, 1, dtype=torch.bool))
    _close(a, b)
    _close(ha, hb)
    assert torch.isinf(a[:, [0, 3, 4]]).all() and torch.isfinite(a[:, ids]).all()


def test_served_engines_compile_the_llm_and_each_lean_drafter(llm):
    from boosttune.assemble import Served

    engine = engine_from_models(llm, [perturbed(llm, 14, 0.3)], TreeConfig(widths=(2, 1)), lookup=3)
    assert compile_served(Served(engine=engine, llm=None, models={})) > 0  # type: ignore[arg-type]
    assert engine.llm.compiled is not None and engine.drafters["ssm-1"].runner.compiled is not None
    stop = StopCriteria(max_new_tokens=30)
    assert engine.generate([5, 9, 2], stop).tokens == incremental_generate(llm, [5, 9, 2], stop).tokens


def test_a_served_drafter_compiles_over_its_draft_vocabulary(llm):
    """compile_served cuts each drafter's head to its tree's draft vocabulary before building its graphs
    (not the whole vocabulary's head the drafter had at load); a head cut later rebuilds the forward."""
    from boosttune.assemble import Served

    ranking = torch.randperm(64, generator=torch.Generator().manual_seed(4))
    engine = engine_from_models(llm, [perturbed(llm, 15, 0.3)], TreeConfig(widths=(2, 1), draft_vocab=24),
                                ranking=ranking)
    compile_served(Served(engine=engine, llm=None, models={}))  # type: ignore[arg-type]
    runner = engine.drafters["ssm-1"].runner
    first = runner.compiled
    assert first is not None and first._head[1] == 24 and torch.equal(first._head_ids.sort().values,
                                                                      ranking[:24].sort().values)
    stop = StopCriteria(max_new_tokens=30)
    assert engine.generate([5, 9, 2], stop).tokens == incremental_generate(llm, [5, 9, 2], stop).tokens
    assert runner.compiled is first  # drafting with the tree it was built for rebuilt nothing
    runner.restrict_head(ranking[:8])
    assert runner.compiled is not first and runner.compiled._head[1] == 8
    p = runner.cached_len
    logits = runner.forward(torch.tensor([[4]]), torch.tensor([[p]]), p, torch.ones(1, 1, dtype=torch.bool))
    assert torch.isfinite(logits[0, ranking[:8]]).all() and torch.isinf(logits[0, ranking[8:]]).all()


def test_what_cannot_compile_says_why(llm):
    assert "ModelRunner" in compile_reason(ModelRunner(copy.deepcopy(llm)))
    biased = tiny_llama(13)
    biased.config.attention_bias = True
    engine = engine_from_models(biased, [], TreeConfig(widths=(1,)))
    from boosttune.assemble import Served

    with pytest.raises(ValueError, match="--compile: .*ModelRunner"):
        compile_served(Served(engine=engine, llm=None, models={}))  # type: ignore[arg-type]


@torch.inference_mode()
def test_batches_over_a_pool_take_the_pooled_graphs_and_match(llm):
    """Runners in a pool: prompts, plain steps and trees of several requests go through the pooled graphs,
    compiled at warm-up, and compute what the eager forward computes; sizes do not recompile. A single
    prompt takes its own graph."""
    runner = LeanRunner(llm)
    compile_runner(runner, pooled=True, prefills=True)
    before = counters["stats"]["unique_graphs"]
    calls: list[str] = []
    graph = runner.compiled

    def counted(name):
        call = getattr(graph, name)
        return lambda *args: calls.append(name) or call(*args)

    for name in ("pooled", "pooled_prefill", "prefill"):  # the spawned runners share the graphs
        setattr(graph, name, counted(name))
    single = runner.spawn()
    prompt = torch.arange(5, 66) % 60
    _close(single.chain_hidden(prompt), LeanRunner(llm).chain_hidden(prompt))
    assert calls == ["prefill"]
    pool = runner.new_pool(4)
    runners = [runner.spawn(pool) for _ in range(4)]
    alone = [LeanRunner(llm) for _ in range(4)]
    prompts = [torch.arange(3 + k, 10 + 5 * k) % 60 for k in range(4)]
    feeds = [(r, Feed(ids[None], torch.arange(ids.numel())[None], 0, torch.ones(ids.numel(), ids.numel(),
                                                                           dtype=torch.bool).tril(),
                      hidden=True, logits=False)) for r, ids in zip(runners, prompts, strict=True)]
    for (logits, hidden), a, ids in zip(run_many(feeds), alone, prompts, strict=True):
        assert logits is None
        _close(hidden, a.chain_hidden(ids))
    for sizes in ((1, 1, 1, 1), (3, 1, 2, 1), (1, 1, 0, 1), (2, 4, 0, 3)):  # 0: that request sits the step out
        feeds = []
        for r, t in zip(runners, sizes, strict=True):
            if t:
                p = r.cached_len
                mask = torch.ones(t, t, dtype=torch.bool).tril()
                feeds.append((r, Feed(torch.arange(4, 4 + t)[None], torch.arange(p, p + t)[None], p, mask,
                                      hidden=t > 1)))
        together = run_many(feeds)
        for (r, f), (logits, hidden) in zip(feeds, together, strict=True):
            a = alone[runners.index(r)]
            want, want_hidden = a.forward_hidden(f.inputs, f.position_ids, f.prefix_len, f.tree_mask)
            _close(logits, want)
            if f.hidden:
                _close(hidden, want_hidden)
            assert r.cached_len == a.cached_len
    assert counters["stats"]["unique_graphs"] == before, "no graph compiled after the warm-up"
    assert calls == ["prefill", "pooled_prefill"] + ["pooled"] * 4, "every forward of several requests ran a pooled graph"
