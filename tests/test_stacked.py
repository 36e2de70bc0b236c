"""Stacked SSMs draft what separate SSM drafters draft: the same trees (tokens, parents, depths, q)
through many engine steps, the same merged trees, greedy output identical to plain decoding, and the
per-drafter cache bookkeeping right; shapes that cannot stack are refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed, tiny_llama

from boosttune.assemble import engine_from_models
from boosttune.core.low_rank import cut_to_rank
from boosttune.serving.builders import merge_trees
from boosttune.serving.decode import incremental_generate
from boosttune.serving.drafter import SSMDrafter
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.lean import drafter_runner, llm_runner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stacked import StackedMember, StackedSSMs, stacked_drafters
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TokenTree, TreeConfig

TREES = [
    TreeConfig(widths=(2, 2, 1)),
    TreeConfig(kind="dynamic", topk=3, depth=4, budget=10),
    TreeConfig(widths=(3, 2, 2), min_prob=0.05),  # members prune differently: ragged frontiers
    TreeConfig(widths=(2, 1, 2), draft_vocab=40),
]


def _ssms(llm, n: int, layers: int = 2):
    return [perturbed(llm, 10 + j, 0.3 + 0.1 * j) for j in range(n)]


def _same(a: TokenTree, b: TokenTree) -> None:
    for f in ("tokens", "parents", "depth", "proposer", "dist_row"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    torch.testing.assert_close(a.q_prob, b.q_prob, rtol=1e-4, atol=1e-5)


class _Recording:
    """Wraps a drafter and keeps the trees it drafted."""

    def __init__(self, inner):
        self.inner, self.trees = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, *args):
        tree = self.inner.draft(*args)
        self.trees.append(tree)
        return tree


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.label + (f"-v{t.draft_vocab}" if t.draft_vocab else ""))
@pytest.mark.parametrize("products", ["packed", "bmm"])
def test_stacked_trees_equal_separate_drafters_through_a_request(llm, tree, products):
    """Two engines, one with separate SSM drafters and one with the stacked group, decode the same
    request; every step's tree of every drafter is the same (so the caches were kept right), and
    both decode exactly as plain decoding does."""
    _compare(llm, _ssms(llm, 3), tree, products)


@pytest.mark.parametrize("products", ["packed", "bmm"])
def test_a_shared_head_is_one_product_and_drafts_the_same(llm, products):
    """SSMs sharing one LM head module: the stacked head is one product over all members' rows, cut
    to a draft vocabulary as well, and the trees stay the separate drafters'."""
    ssms = _ssms(llm, 3)
    for m in ssms[1:]:
        m.lm_head = ssms[0].lm_head
    group = _compare(llm, ssms, TREES[3], products)
    assert group._full_head.shared and group._head.shared and not group._layers[0]["qkv"].shared


def _compare(llm, ssms, tree, products):
    """Separate and stacked drafters of ``ssms`` decode one request alike, tree by tree; returns the group."""
    names = ["a", "b", "c"]
    ranking = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    v = llm.get_output_embeddings().weight.shape[0]
    sep = {n: _Recording(SSMDrafter(drafter_runner(m), v, ranking)) for n, m in zip(names, ssms, strict=True)}
    stk = {n: _Recording(d) for n, d in stacked_drafters(ssms, names, v, ranking, products).items()}
    plan = Plan(dict.fromkeys(names, tree))
    prompt = torch.randint(2, 64, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    stop = StopCriteria(max_new_tokens=24)
    ref = incremental_generate(llm, prompt, stop)
    out_sep = SpeculativeEngine(llm_runner(llm), sep, plan).generate(prompt, stop)
    out_stk = SpeculativeEngine(llm_runner(llm), stk, plan).generate(prompt, stop)
    assert out_sep.tokens == out_stk.tokens == ref.tokens
    assert out_sep.accept_lengths == out_stk.accept_lengths
    assert out_sep.proposer_hits == out_stk.proposer_hits
    for n in names:
        assert len(sep[n].trees) == len(stk[n].trees) == out_stk.steps
        for a, b in zip(sep[n].trees, stk[n].trees, strict=True):
            _same(a, b)
    for step in range(out_stk.steps):  # and the engine's merge of them
        ma, mapa = merge_trees([sep[n].trees[step] for n in names], dedupe=True)
        mb, mapb = merge_trees([stk[n].trees[step] for n in names], dedupe=True)
        _same(ma, mb)
        assert all(torch.equal(x, y) for x, y in zip(mapa, mapb, strict=True))
    return stk["a"].inner.group


def test_stacked_caches_match_separate_runners_after_steps(llm):
    """After a request, each member's cache holds what its own runner's cache holds (the committed
    prefix it kept): the next forward of both gives the same logits."""
    ssms = _ssms(llm, 2)
    v = llm.get_output_embeddings().weight.shape[0]
    group = StackedSSMs(ssms, ["a", "b"], v)
    solo = [SSMDrafter(drafter_runner(m), v) for m in ssms]
    members = [StackedMember(group, j) for j in range(2)]
    tree = TreeConfig(widths=(2, 2))
    sampling = SamplingParams()
    committed = torch.randint(2, 64, (7,), generator=torch.Generator().manual_seed(2))
    for step in range(6):
        trees = []
        for j in range(2):
            ta = solo[j].draft(committed, tree, sampling, None)
            _same(ta, members[j].draft(committed, tree, sampling, None))
            trees.append(ta)
        # the path follows member 0's tree (two nodes, or one); member 1's tree left it at once
        ta = trees[0]
        path = [0, int((ta.parents == 0).nonzero()[0])] if step % 2 else [1]
        solo[0].accept(path)
        members[0].accept(path)
        solo[1].accept([])
        members[1].accept([])
        bonus = torch.tensor([3 + step])
        committed = torch.cat([committed, ta.tokens[torch.tensor(path)], bonus])


def test_stacked_sampling_keeps_output_distribution_valid(llm):
    """Under sampling the stacked group drafts with each SSM's own q (trees differ from separate
    drafters' only by the random stream's order); a seeded request runs and stays reproducible."""
    ssms = _ssms(llm, 2)
    eng = engine_from_models(llm, ssms, TreeConfig(widths=(2, 1)), stack_ssms=True)
    assert all(isinstance(d, StackedMember) for d in eng.drafters.values())
    sampling = SamplingParams(temperature=0.8, seed=3)
    stop = StopCriteria(max_new_tokens=24)
    a = eng.generate([5, 6, 7], stop, sampling)
    b = eng.generate([5, 6, 7], stop, sampling)
    assert a.tokens == b.tokens and len(a.tokens) == 24


def test_engine_from_models_stacks_only_what_it_can():
    """Same-shape SSMs stack, another shape stays a drafter of its own, the option off changes nothing,
    and greedy output stays plain decoding's."""
    llm = tiny_llama(0)
    ssms = {"s1": perturbed(llm, 1, 0.3), "wide": tiny_llama(7, hidden=48), "s2": perturbed(llm, 2, 0.4)}
    off = engine_from_models(llm, ssms, TreeConfig(widths=(2, 1)))
    assert all(isinstance(d, SSMDrafter) for d in off.drafters.values())
    on = engine_from_models(llm, ssms, TreeConfig(widths=(2, 1)), stack_ssms=True)
    assert list(on.drafters) == ["s1", "wide", "s2"]
    assert isinstance(on.drafters["s1"], StackedMember) and isinstance(on.drafters["s2"], StackedMember)
    assert on.drafters["s1"].group is on.drafters["s2"].group
    assert isinstance(on.drafters["wide"], SSMDrafter)
    stop = StopCriteria(max_new_tokens=30)
    ref = incremental_generate(llm, [4, 9, 2, 8], stop)
    assert on.generate([4, 9, 2, 8], stop).tokens == off.generate([4, 9, 2, 8], stop).tokens == ref.tokens


def test_differing_shapes_and_trees_are_refused_by_name(llm):
    with pytest.raises(ValueError, match=r"\['a', 'b'\].*a has hidden_size=32 but b has hidden_size=48"):
        StackedSSMs([llm, tiny_llama(1, hidden=48)], ["a", "b"])
    members = stacked_drafters(_ssms(llm, 2), ["a", "b"], 64)
    plan = Plan({"a": TreeConfig(widths=(2, 1)), "b": TreeConfig(widths=(3,))})
    eng = SpeculativeEngine(llm_runner(llm), members, plan)
    with pytest.raises(ValueError, match=r"one tree per step: a drafted \[2,1\] but b asks for \[3\]"):
        eng.generate([3, 4, 5], StopCriteria(max_new_tokens=4))


def _low_rank_members(llm, rank: int):
    """Three SSMs whose layer matrices are SSM a's plus rank-``rank`` deltas, with their factors attached
    as a loaded SSM directory with ``delta.safetensors`` has them (norms and embeddings stay their own)."""
    ssms = _ssms(llm, 3)
    for m in ssms[1:]:
        m.low_rank_delta, _ = cut_to_rank(ssms[0], m, rank)
    return ssms


@pytest.mark.parametrize("products", ["packed", "bmm"])
def test_low_rank_members_draft_with_one_base_product_and_the_same_trees(llm, products):
    """Members given as SSM a plus low-rank factors: every layer product is SSM a's weight read once over
    all rows plus the members' small products, and the trees stay the separate drafters' (the same
    weights, summed in another order)."""
    group = _compare(llm, _low_rank_members(llm, 4), TREES[0], products)
    for ly in group._layers:
        for name in ("qkv", "o", "gate_up", "down"):
            assert ly[name].shared and ly[name].low_rank is not None, name
    a_all, b_all = group._layers[0]["qkv"].low_rank
    assert a_all.shape[0] == b_all.shape[1] == 2 * 4  # two members; q, k and v cut together: one A of rank 4


def test_factors_that_do_not_rebuild_the_weights_are_not_used(llm):
    """A member whose factors belong to other weights drafts with its own full weights."""
    ssms = _low_rank_members(llm, 4)
    ssms[2].low_rank_delta = ssms[1].low_rank_delta
    group = _compare(llm, ssms, TREES[0], "packed")
    assert all(ly[n].low_rank is None and not ly[n].shared for ly in group._layers for n in ("qkv", "down"))


def test_stack_modes_stack_low_rank_ssms_by_default(llm):
    """``--stack-ssms auto`` stacks SSMs that carry low-rank factors and leaves full ones separate; ``on`` and
    ``off`` decide alone; another word is refused naming the flag."""
    from boosttune.assemble import stacks

    plain, cut = _ssms(llm, 2), _low_rank_members(llm, 2)
    assert stacks("auto", cut) and not stacks("auto", plain)
    assert stacks("on", plain) and not stacks("off", cut)
    with pytest.raises(ValueError, match="--stack-ssms"):
        stacks("always", plain)
