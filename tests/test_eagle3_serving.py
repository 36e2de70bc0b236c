"""An EAGLE-3 head served by our engine: the LLM's taps, the drafter's chains against the head's own
training unroll, greedy output token-identical to plain decoding, and the kind's checks."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import greedy_samples, tiny_llama

from boosttune.config import Eagle3Config
from boosttune.core.eagle3_head import Eagle3Head, Eagle3Spec
from boosttune.serving import kinds
from boosttune.serving.compiled import compile_runner
from boosttune.serving.decode import incremental_generate
from boosttune.serving.eagle3_drafter import Eagle3Drafter
from boosttune.serving.engine import Plan, SpeculativeEngine, feature_taps, reader_features
from boosttune.serving.lean import LeanRunner
from boosttune.serving.lookup import LOOKUP_NAME, PromptLookupDrafter, lookup_tree
from boosttune.serving.runner import ModelRunner
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TreeConfig
from boosttune.train.eagle3 import init_head, layer_features, train_eagle3

LAYERS = (0, 1, 3)
ROWS = torch.tensor([2, 3, 5, 7, 8, 11, 13, 17, 19, 23, 29, 30, 31, 37, 41, 43, 47, 50, 53, 59, 60, 61])


@pytest.fixture(scope="module")
def llm4():
    return tiny_llama(11, layers=4)


def _noisy_head(llm, rows: torch.Tensor = ROWS, seed: int = 1) -> Eagle3Head:
    head = init_head(llm, Eagle3Spec.from_llm(llm.config, len(rows), LAYERS), rows)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3 * (p.std() + 0.1))
    return head.eval().requires_grad_(False)


def _truth(llm, ids: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        out = llm(input_ids=ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[-1][0], *(out.hidden_states[i][0] for i in taps)], -1)


def test_taps_are_the_layer_inputs_on_every_runner(llm4):
    """The hidden-state path returns the last states, then the inputs of the tapped layers in the order
    asked, whichever runner the LLM serves through (transformers', the lean one, the compiled one)."""
    ids = torch.tensor([5, 9, 2, 33, 17, 4, 60, 8, 21])
    want = _truth(llm4, ids, (3, 0))
    for runner in (ModelRunner(llm4), LeanRunner(llm4)):
        runner.set_taps((3, 0))
        torch.testing.assert_close(runner.chain_hidden(ids), want, atol=1e-4, rtol=1e-4)
        runner.reset()
        runner.set_taps(())
        assert runner.chain_hidden(ids).shape == (9, 32)
        with pytest.raises(ValueError, match="taps must be decoder layers"):
            runner.set_taps((4,))
    lean = LeanRunner(llm4)
    lean.set_taps((3, 0))
    compile_runner(lean, warm_up=False)
    lean.prefill(ids[:-1])
    _, hidden = lean.forward_hidden(ids[-1:][None], torch.tensor([[8]]), 8, torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(hidden[0], want[-1], atol=1e-4, rtol=1e-4)  # the compiled plain step's taps
    with pytest.raises(ValueError, match="before compiling"):
        lean.set_taps((1,))


def test_reader_features_pick_each_drafters_layers():
    h = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 12)  # 2 rows, last + taps (1, 2, 5), width 3
    torch.testing.assert_close(reader_features(h, 3, (1, 2, 5), ()), h[:, :3])
    torch.testing.assert_close(reader_features(h, 3, (1, 2, 5), (5, 1)), torch.cat([h[:, 9:12], h[:, 3:6]], 1))
    assert reader_features(h[:0], 3, (1, 2, 5), (5, 1)).shape == (0, 6)  # a one-token prompt's prefill


def _features(llm, committed: torch.Tensor) -> torch.Tensor:
    """The LLM's three layer inputs over every committed position but the pending one."""
    return _truth(llm, committed[:-1], LAYERS)[:, 32:]


def _unrolled_chain(head: Eagle3Head, aux: torch.Tensor, committed: torch.Tensor, drafted: torch.Tensor) -> list[int]:
    """The greedy chain the head's training unroll drafts from the last committed pair, fed the
    drafted tokens as its later steps' inputs (what serving feeds them)."""
    j = committed.shape[0] - 2
    depth = drafted.shape[0]
    tokens = torch.cat([committed[1:], drafted[: depth - 1]])[None]
    pad = torch.zeros(depth - 1, aux.shape[1])  # later positions' own features: never read by the chain from j
    states = head.unroll(torch.cat([aux, pad])[None], tokens, depth)
    return [int(head.d2t[head.logits(states[s][0, j]).argmax()]) for s in range(depth)]


def test_drafted_chains_are_the_heads_training_unroll(llm4):
    """A chain of three, drafted with the head's cache, tree masks and positions, equals the chain the
    training unroll gives, on the first draft and after a step that accepted one token (the cache
    dropped the draft nodes and fed the accepted ones with the LLM's own features)."""
    head = _noisy_head(llm4)
    drafter = Eagle3Drafter(head, 64)
    assert drafter.feature_layers() == LAYERS and feature_taps([drafter]) == (0, 1, 3)
    chain = TreeConfig(widths=(1, 1, 1))
    committed = torch.tensor([4, 9, 22, 31, 7, 50, 12, 40, 3, 18])
    drafter.observe(_features(llm4, committed))
    tree = drafter.draft(committed, chain, SamplingParams(), None)
    drafted = tree.tokens
    assert tree.parents.tolist() == [-1, 0, 1] and set(drafted.tolist()) <= set(ROWS.tolist())
    assert drafted.tolist() == _unrolled_chain(head, _features(llm4, committed), committed, drafted)
    drafter.accept([0])  # the first draft token accepted, then the LLM's bonus token
    longer = torch.cat([committed, drafted[:1], torch.tensor([44])])
    drafter.observe(_features(llm4, longer)[len(committed) - 1 :])
    again = drafter.draft(longer, chain, SamplingParams(), None).tokens
    assert again.tolist() == _unrolled_chain(head, _features(llm4, longer), longer, again)
    # a negative control: the same chain drafted from stale features is another chain
    stale = Eagle3Drafter(_noisy_head(llm4), 64)
    stale.observe(torch.zeros(len(longer) - 1, 3 * 32))
    assert stale.draft(longer, chain, SamplingParams(), None).tokens.tolist() != again.tolist()
    with pytest.raises(ValueError, match="draft_vocab 0"):
        drafter.draft(longer, TreeConfig(widths=(2,), draft_vocab=8), SamplingParams(), None)


def _trained_head(llm) -> Eagle3Head:
    """A head trained a little on the LLM's own greedy continuations, so that its drafts get accepted."""
    rows = torch.arange(64)
    head = init_head(llm, Eagle3Spec.from_llm(llm.config, 64, LAYERS), rows)
    samples = greedy_samples(llm)
    feats = layer_features(llm, samples, LAYERS)
    train_eagle3(head, samples, feats, llm.lm_head.weight.detach()[rows],
                 Eagle3Config(enabled=True, minutes=0, max_steps=60, depth=3, lr=5e-3, batch_tokens=128))
    return head.eval().requires_grad_(False)


@pytest.mark.parametrize("runner", [ModelRunner, LeanRunner])
def test_greedy_output_is_plain_decodings_with_the_head_and_prompt_lookup(llm4, runner):
    """fp32 greedy decoding with the head (a tree, then chains) and prompt lookup merged is token for
    token the LLM's plain decoding, and the head's drafts do get accepted."""
    head = _trained_head(llm4)
    drafters = {"eagle3": Eagle3Drafter(head, 64), LOOKUP_NAME: PromptLookupDrafter(64)}
    hits = 0
    for widths in [(3, 2, 1), (1, 1, 1)]:
        plan = Plan({"eagle3": TreeConfig(widths=widths), LOOKUP_NAME: lookup_tree(3)})
        engine = SpeculativeEngine(runner(llm4), drafters, plan)
        assert engine.llm.taps == LAYERS
        g = torch.Generator().manual_seed(3)
        for _ in range(4):
            prompt = torch.randint(2, 64, (5,), generator=g).tolist()
            stop = StopCriteria(max_new_tokens=24)
            got = engine.generate(prompt, stop)
            assert got.tokens == incremental_generate(llm4, prompt, stop).tokens
            hits += got.proposer_hits["eagle3"]
    assert hits > 0, "the head's drafts were never accepted: the identity above tested nothing of it"


def test_the_kind_checks_and_loads_a_saved_head(llm4, tmp_path):
    head = _noisy_head(llm4)
    head.save(tmp_path / "e3")
    kind = kinds.kind(kinds.directory_kind(tmp_path / "e3"))
    assert kind.name == "eagle3"
    kind.check(tmp_path / "e3")
    loaded = kind.load(tmp_path / "e3", torch.float32, llm=llm4)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.fc.weight, head.fc.weight)
    tree = kind.trained_tree(tmp_path / "e3", TreeConfig(widths=(3,), draft_vocab=8192))
    assert tree.widths == (3, 1, 1) and tree.draft_vocab == 0 and tree.min_prob == kind.MIN_PROB
    with pytest.raises(ValueError, match="with its LLM"):
        kind.load(tmp_path / "e3", torch.float32)
    from boosttune.assemble import engine_from_models

    with pytest.raises(ValueError, match="its own vocabulary"):  # refused when the engine is built
        engine_from_models(llm4, {"eagle3": loaded}, TreeConfig(widths=(3,), draft_vocab=8), kinds={"eagle3": "eagle3"})
    assert engine_from_models(llm4, {"eagle3": loaded}, tree, kinds={"eagle3": "eagle3"}).llm.taps == LAYERS
    spec = json.loads((tmp_path / "e3" / "eagle3_head.json").read_text())
    spec["spec"]["draft_vocab"] = 30  # the weights hold 22 rows
    (tmp_path / "e3" / "eagle3_head.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="'lm_head.weight' has shape"):
        kind.check(tmp_path / "e3")
