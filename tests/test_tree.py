"""Tree topology, builders, merge and KV compaction against explicit references."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from boosttune.serving.builders import choose_children, merge_trees, subtree
from boosttune.serving.kv import compact_cache
from boosttune.serving.tree import (
    TokenTree,
    TreeConfig,
    ancestor_mask,
    path_to,
    rerank_keep,
    verification_inputs,
)


def make_tree(parents: list[int], tokens: list[int], proposer: int = 0) -> TokenTree:
    par = torch.tensor(parents)
    n = len(parents)
    return TokenTree(
        tokens=torch.tensor(tokens), parents=par, depth=ancestor_mask(par).sum(dim=1),
        proposer=torch.full((n,), proposer), q_prob=torch.ones(n), dist_row=torch.full((n,), -1),
    )


def naive_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def test_ancestor_mask_matches_naive_on_random_trees():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(1, 30, (1,), generator=g))
        parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
        assert torch.equal(ancestor_mask(torch.tensor(parents)), naive_ancestors(parents))


def test_verification_inputs_positions_and_mask():
    #        root
    #       /    \
    #      0(a)   1(b)
    #      |
    #      2(c)
    tree = make_tree([-1, -1, 0], [10, 11, 12])
    ids, pos, mask = verification_inputs(tree, root_token=7, prefix_len=5)
    assert ids.tolist() == [[7, 10, 11, 12]]
    assert pos.tolist() == [[5, 6, 6, 7]]
    expected = torch.tensor(
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [1, 0, 1, 0],
         [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert path_to(tree.parents, 2) == [0, 2]
    assert path_to(tree.parents, -1) == []


def test_tree_rejects_non_topological_order():
    try:
        make_tree([1, -1], [3, 4])
    except AssertionError:
        return
    raise AssertionError("a child listed before its parent must be refused")


def test_merge_dedupes_common_prefixes_for_greedy():
    a = make_tree([-1, 0, 1], [5, 6, 7], proposer=0)          # 5 6 7
    b = make_tree([-1, 0, 0, -1], [5, 6, 9, 8], proposer=1)   # 5 6 / 5 9 / 8
    merged, maps = merge_trees([a, b], dedupe=True)
    assert merged.tokens.tolist() == [5, 6, 7, 9, 8]
    assert merged.parents.tolist() == [-1, 0, 1, 0, -1]
    assert maps[0].tolist() == [0, 1, 2] and maps[1].tolist() == [0, 1, 3, 4]
    # every merged root-to-node path exists in one of the inputs
    assert merged.depth.tolist() == [1, 2, 3, 2, 1]


def test_merge_keeps_duplicate_samples_for_sampling():
    a = make_tree([-1], [5], proposer=0)
    b = make_tree([-1], [5], proposer=1)
    merged, maps = merge_trees([a, b], dedupe=False)
    assert merged.tokens.tolist() == [5, 5] and merged.proposer.tolist() == [0, 1]
    assert maps[1].tolist() == [1]


def test_choose_children_greedy_is_topk_and_sampling_without_replacement():
    q = torch.tensor([[0.1, 0.5, 0.0, 0.4]])
    tok, valid = choose_children(q, 2, greedy=True, generator=None)
    assert tok.tolist() == [[1, 3]] and valid.all()
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(2000):
        tok, valid = choose_children(q, 3, greedy=False, generator=g)
        assert len(set(tok[0][valid[0]].tolist())) == int(valid.sum()) == 3  # distinct, no zero-q token
        assert 2 not in tok[0][valid[0]].tolist()
        counts[tok[0, 0]] += 1
    # the first draw is a plain sample of q
    torch.testing.assert_close(counts / counts.sum(), q[0], atol=0.03, rtol=0)


def test_rerank_keeps_an_ancestor_closed_set():
    tree = make_tree([-1, 0, 0, 1, -1, 4], [1, 2, 3, 4, 5, 6])
    cum = torch.tensor([-0.1, -0.5, -0.3, -0.6, -0.2, -0.9])
    keep = rerank_keep(cum, tree.depth, budget=4)
    assert keep.tolist() == [True, True, True, False, True, False]
    sub, old = subtree(tree, keep)
    assert old.tolist() == [0, 1, 2, 4]
    assert sub.parents.tolist() == [-1, 0, 0, -1]


def test_compact_cache_keeps_prefix_and_gathers_path():
    cache = DynamicCache()
    k = torch.arange(10.0).view(1, 1, 10, 1).expand(1, 2, 10, 3).contiguous()
    cache.update(k.clone(), k.clone() + 100, layer_idx=0)
    compact_cache(cache, start=4, keep=torch.tensor([0, 2, 5]))
    layer = cache.layers[0]
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 9]
    assert layer.values[0, 1, :, 0].tolist() == [100, 101, 102, 103, 104, 106, 109]
    assert cache.get_seq_length() == 7


def test_tree_config_validation_names_the_field():
    for kwargs, word in [({"kind": "beam"}, "kind"), ({"widths": (1, 0)}, "widths"), ({"budget": 0}, "budget")]:
        try:
            TreeConfig(**kwargs)
        except ValueError as e:
            assert word in str(e)
        else:
            raise AssertionError(f"{kwargs} should be refused")


def test_tree_and_plan_labels_name_the_shape():
    from boosttune.serving.engine import Plan
    from boosttune.serving.lookup import lookup_tree

    assert TreeConfig(widths=(3,)).label == "3" and TreeConfig(widths=(3, 1)).label == "3,1"
    assert lookup_tree(4).label == "1x4" and lookup_tree(8, (0, 2, 5)).label == "1x8+lengths"
    assert TreeConfig(kind="dynamic", topk=4, depth=6, budget=32).label == "dyn:4,6,32"
    plan = Plan({"feature": TreeConfig(widths=(3,)), "prompt-lookup": lookup_tree(4)})
    assert plan.label == "feature[3] + prompt-lookup[1x4]" and Plan().label == "plain"
