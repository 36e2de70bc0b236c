"""The engine's hooks for the scheduler: plans naming drafters and their trees, prefill states, labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import local_llm, oracle_head, perturbed, tiny_llama

from boosttune.assemble import engine_from_models
from boosttune.scheduler.features import FeatureSpec
from boosttune.scheduler.offline.labels import label_request
from boosttune.scheduler.offline.walk import walk
from boosttune.serving.builders import merge_trees
from boosttune.serving.decode import incremental_generate
from boosttune.serving.engine import Plan, SpeculativeEngine
from boosttune.serving.lookup import LOOKUP_NAME, lookup_tree
from boosttune.serving.stops import StopCriteria
from boosttune.serving.tree import TokenTree, TreeConfig
from boosttune.serving.verify import greedy_branch_accepts, greedy_verify

PROMPT = [3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def models():
    llm = tiny_llama(11)
    return llm, [perturbed(llm, 1, 0.1), perturbed(llm, 2, 0.4), llm]


def make(models, widths=(1, 2, 1)) -> SpeculativeEngine:
    llm, ssms = models
    return engine_from_models(llm, ssms, TreeConfig(widths=widths))


def plan_of(eng: SpeculativeEngine, active: list[int] | None, tree: TreeConfig | None) -> Plan:
    """The engine's drafters ``active`` (by position; None: all), each with ``tree`` (None: its default)."""
    names = list(eng.drafters) if active is None else [list(eng.drafters)[j] for j in active]
    return Plan({name: tree or eng.plan.trees[name] for name in names})


@pytest.mark.parametrize("active", [[], [1], [0, 2], None])
def test_drafter_subsets_and_tree_overrides_stay_lossless(models, active):
    stop = StopCriteria(max_new_tokens=24)
    ref = incremental_generate(models[0], PROMPT, stop).tokens
    eng = make(models)
    default = eng.plan
    for tree in (None, TreeConfig(widths=(1,))):
        out = eng.generate(PROMPT, stop, plan=plan_of(eng, active, tree))
        assert out.tokens == ref
        assert out.active == list(plan_of(eng, active, None).drafters)
        unused = set(eng.drafters) - set(out.active)
        assert all(out.proposer_hits.get(name, 0) == 0 for name in unused)
        if tree is not None and out.active:
            assert max(out.accept_lengths) <= 2  # depth-1 trees: one draft token + the bonus
    assert eng.plan == default and all(t.widths == (1, 2, 1) for t in eng.plan.trees.values()), \
        "a request's plan lasts one request"
    if active == []:
        assert out.accept_lengths == [1] * 24


def test_each_drafter_drafts_the_tree_its_plan_names(models):
    """A plan gives each drafter its own tree for one request (the scheduler's SSM and lookup trees)."""
    llm, ssms = models
    eng = engine_from_models(llm, ssms, TreeConfig(widths=(1, 2, 1)), lookup=2)
    seen = {}
    for name, d in eng.drafters.items():
        def spy(committed, tree, sampling, gen, name=name, draft=d.draft):
            seen[name] = tree.widths
            return draft(committed, tree, sampling, gen)
        d.draft = spy
    stop = StopCriteria(max_new_tokens=12)
    plan = Plan({"ssm-3": TreeConfig(widths=(1,)), LOOKUP_NAME: TreeConfig(widths=(1,) * 6)})
    out = eng.generate(PROMPT, stop, plan=plan)
    assert out.tokens == incremental_generate(llm, PROMPT, stop).tokens
    assert seen == {"ssm-3": (1,), LOOKUP_NAME: (1,) * 6}
    assert [t.widths for t in eng.plan.trees.values()] == [(1, 2, 1)] * 3 + [(1, 1)], "a request's plan lasts one request"
    with pytest.raises(ValueError, match="does not have"):
        eng.generate(PROMPT, stop, plan=Plan({"ssm-9": TreeConfig()}))


def test_planner_sees_prefill_states_and_chooses(models):
    seen = []

    def planner(hidden):
        seen.append(hidden.shape)
        return Plan({"ssm-3": TreeConfig(widths=(1, 1, 1, 1))})

    stop = StopCriteria(max_new_tokens=20)
    out = make(models).generate(PROMPT, stop, planner=planner)
    assert seen == [(len(PROMPT) - 1, 32)]
    assert out.active == ["ssm-3"] and out.accept_lengths == [5] * 4  # the LLM as its own SSM accepts everything
    assert out.plan_s > 0 and out.prefill_s > 0
    one = make(models).generate([9], stop, planner=lambda h: (seen.append(h.shape), Plan())[1])
    assert seen[-1] == (0, 32) and one.tokens == incremental_generate(models[0], [9], stop).tokens


def test_recorded_branch_accepts_explain_every_step(models):
    stop = StopCriteria(max_new_tokens=30)
    eng = make(models)
    out = eng.generate(PROMPT, stop, plan=plan_of(eng, [0, 1], None), record=True)
    assert len(out.records) == out.steps
    for rec, length in zip(
        out.records[:-1], out.accept_lengths[:-1], strict=True
    ):  # the last step may be cut
        assert len(rec.accepts) == 2 and len(rec.draft_s) == 2
        assert max(rec.accepts) == length - 1
        assert rec.nodes > 0 and rec.verify_s > 0 and rec.step_s >= rec.verify_s + sum(rec.draft_s)


def test_branch_accepts_match_verifying_each_branch_alone():
    # two 2-node chains sharing their first token: [7, 8] and [7, 9]; the LLM wants 7 then 9
    a = TokenTree(
        torch.tensor([7, 8]),
        torch.tensor([-1, 0]),
        torch.tensor([1, 2]),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2),
        torch.full((2,), -1),
    )
    b = TokenTree(
        torch.tensor([7, 9]),
        torch.tensor([-1, 0]),
        torch.tensor([1, 2]),
        torch.ones(2, dtype=torch.long),
        torch.ones(2),
        torch.full((2,), -1),
    )
    merged, maps = merge_trees([a, b], dedupe=True)
    assert merged.size == 3
    logits = torch.zeros(4, 16)
    logits[0, 7] = logits[1, 9] = 1.0  # root → 7; after 7 → 9
    assert greedy_branch_accepts(merged, logits, maps) == [1, 2]
    for tree, m in ((a, maps[0]), (b, maps[1])):
        alone = torch.cat([logits[:1], logits[m + 1]])
        assert len(greedy_verify(tree, alone)[0]) == greedy_branch_accepts(merged, logits, [m])[0]


@pytest.mark.parametrize(
    "active, depths, ngram_depths",
    [([0], (3, 0, 0, 0), ()), ([1, 3], (0, 2, 0, 5), ()), ([0, 1, 2, 3], (3, 3, 3, 5), ()), ([3], (0, 0, 0, 5), (1, 3, 5))],
)
def test_position_labels_replay_the_engines_own_steps(models, active, depths, ngram_depths):
    """Labels made from one run with every drafter, walked for a policy, give exactly the steps (and
    accepted lengths) the engine takes when run with that policy (fp32 greedy: no rounding noise)."""
    llm, ssms = models
    widths = (1, 2, 1)
    eng = engine_from_models(llm, ssms, TreeConfig(widths=widths), lookup=5)
    prompt = [3, 4, 5, 6, 3, 4, 5, 9, 3, 4]  # repeats itself: prompt lookup finds matches
    stop = StopCriteria(max_new_tokens=30)
    spec = FeatureSpec(hidden_size=llm.config.hidden_size, ngram_buckets=4, lookup=True)
    record = label_request(eng, "p", prompt, stop, chat=False, spec=spec)
    trees = {j: TreeConfig(widths=widths[: depths[j]]) for j in active if j != 3}
    if 3 in active:
        trees[3] = lookup_tree(depths[3], ngram_depths)
    names = list(eng.drafters)
    run = eng.generate(prompt, stop, plan=Plan({names[j]: trees[j] for j in active}))
    assert run.tokens == incremental_generate(llm, prompt, stop).tokens
    assert max(run.accept_lengths) > 1, "no draft accepted: the comparison would be trivial"
    walked = walk(record.labels(), depths, lookup=3, ngram_depths=ngram_depths)
    assert walked.steps == run.steps
    assert np.diff([*walked.starts, len(run.tokens)]).tolist() == run.accept_lengths


@pytest.mark.parametrize("depths, ngram_depths", [((0, 0, 0, 5), ()), ((0, 0, 0, 2), ()), ((0, 0, 0, 5), (1, 3, 5)),
                                                 ((3, 0, 0, 1), ())])
def test_labels_count_the_phrase_tables_branch_as_the_engine_drafts_it(models, depths, ngram_depths):
    """With the LLM's phrase table, prompt lookup's greedy trees hold the table's branch; the labels
    replay what it accepts and the nodes it adds beside each chain length, so the walk gives exactly
    the engine's steps, accepted lengths and lookup nodes (fp32 greedy), and fewer steps than the same
    labels without the branch."""
    from dataclasses import replace

    from boosttune.serving.phrases import build_phrases

    llm, ssms = models
    widths = (1, 2, 1)
    prompt = [3, 4, 5, 6, 3, 4, 5, 9, 3, 4]
    stop = StopCriteria(max_new_tokens=30)
    plain = incremental_generate(llm, prompt, stop).tokens
    table = build_phrases([[*prompt, *plain]], llm.get_output_embeddings().weight.shape[0])  # the LLM's own text
    eng = engine_from_models(llm, ssms, TreeConfig(widths=widths), lookup=5, phrases=table)
    spec = FeatureSpec(hidden_size=llm.config.hidden_size, ngram_buckets=4, lookup=True)
    record = label_request(eng, "p", prompt, stop, chat=False, spec=spec)
    assert record.branch is not None and record.branch.shape == (len(plain), 3)
    assert (record.branch[:, 0] > 0).any(), "the branch is never right: the comparison would be trivial"
    names = list(eng.drafters)
    trees = {names[j]: TreeConfig(widths=widths[: depths[j]]) for j in range(3) if depths[j]}
    trees[LOOKUP_NAME] = lookup_tree(depths[3], ngram_depths)
    run = eng.generate(prompt, stop, plan=Plan(trees), record=True)
    assert run.tokens == plain
    walked = walk(record.labels(), depths, lookup=3, ngram_depths=ngram_depths)
    assert walked.steps == run.steps
    assert np.diff([*walked.starts, len(run.tokens)]).tolist() == run.accept_lengths
    if not any(depths[:3]):  # lookup alone: its nodes are the tree's
        assert walked.lookup_nodes.tolist() == [r.nodes for r in run.records]
    bare = walk(replace(record.labels(), branch=None), depths, lookup=3, ngram_depths=ngram_depths)
    assert bare.steps > walked.steps
    again = type(record).from_json(record.to_json(), 4)  # the branch survives the labels file
    assert np.array_equal(again.branch, record.branch)


def noisy_oracle_head(llm, seed: int, noise: float = 0.6):
    """``oracle_head`` with noise on its layer: right often, not always."""
    head = oracle_head(llm)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.model.layers.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return head


@pytest.mark.parametrize("depths", [(1, 0, 0), (2, 0, 0), (2, 1, 0), (1, 0, 5), (2, 2, 5)])
def test_feature_head_labels_replay_the_engines_own_steps(depths):
    """A feature head's labels (one LLM forward for its features, one teacher-forced pass of the head,
    depth 2 from its own predicted features), walked for a policy with SSMs and prompt lookup beside
    it, give exactly the engine's own steps."""
    llm = local_llm(11)  # its feature at j depends on token j only: a noisy oracle head agrees often
    head, ssm = noisy_oracle_head(llm, 5), perturbed(llm, 1, 0.3)
    widths = (3, 2)
    eng = engine_from_models(llm, {"feature": head, "ssm-1": ssm}, TreeConfig(widths=widths), lookup=5,
                             kinds={"feature": "feature"})
    prompt = [3, 4, 5, 6, 3, 4, 5, 9, 3, 4]
    stop = StopCriteria(max_new_tokens=30)
    spec = FeatureSpec(hidden_size=llm.config.hidden_size, ngram_buckets=4, lookup=True)
    record = label_request(eng, "p", prompt, stop, chat=False, spec=spec)
    assert set(record.accepts[:, 0].tolist()) == {0, 1, 2}, "the head should miss, hit once and hit twice"
    names = list(eng.drafters)  # feature, ssm-1, prompt-lookup
    trees = {names[j]: TreeConfig(widths=widths[: depths[j]]) for j in (0, 1) if depths[j]}
    if depths[2]:
        trees[LOOKUP_NAME] = lookup_tree(depths[2])
    run = eng.generate(prompt, stop, plan=Plan(trees))
    assert run.tokens == incremental_generate(llm, prompt, stop).tokens
    walked = walk(record.labels(), depths, lookup=2)
    assert walked.steps == run.steps
    assert np.diff([*walked.starts, len(run.tokens)]).tolist() == run.accept_lengths


def test_feature_head_replay_needs_features_and_shallow_trees():
    llm = local_llm(11)
    eng = engine_from_models(llm, {"feature": noisy_oracle_head(llm, 5)}, TreeConfig(widths=(2,)),
                             kinds={"feature": "feature"})
    drafter = eng.drafters["feature"]
    with pytest.raises(ValueError, match="features"):
        drafter.replay([3, 4], [5, 6], TreeConfig(widths=(2,)))
    with pytest.raises(ValueError, match="two levels"):
        drafter.replay([3, 4], [5, 6], TreeConfig(widths=(2, 1, 1)), features=lambda: torch.zeros(3, 32))


def test_recost_served_measures_the_served_engine_and_decodes_exactly(models):
    """``assemble.recost_served``: the scheduler's costs timed again on the engine being served (a tree of
    every drafter merged included), its fixed choice taken again, and that choice decodes exactly."""
    from test_scheduler import SPEC, synthetic_records
    from test_scheduler import costs as trained_costs

    from boosttune.assemble import Served, recost_served
    from boosttune.config import SchedulerConfig
    from boosttune.scheduler.offline.train import fit_scheduler

    llm, ssms = models[0], models[1][:2]
    engine = engine_from_models(llm, ssms, TreeConfig(widths=(1, 1)))
    cfg = SchedulerConfig(prompts="unused", depths=(1, 2), pca_components=4, ridge_alphas=(1e-3,), prompt_lookup=False)
    sched = fit_scheduler(synthetic_records(), trained_costs(), SPEC, (1, 1), cfg)
    served = Served(engine=engine, llm=None, models={}, scheduler=sched)  # type: ignore[arg-type]
    assert recost_served(served, prompts=[[5, 9, 2, 7], [3, 3, 8]], tokens=6) > 0
    new = served.scheduler
    assert new is not sched and new.costs.depths == (1, 2) and new.fallback in new.candidates
    assert new.costs.verify_nodes[0] == 0 and max(new.costs.verify_nodes) >= 2  # plain steps and merged trees
    assert new.costs.verify_s != sched.costs.verify_s and "recosted" in new.meta
    stop = StopCriteria(max_new_tokens=20)
    assert served.generate([5, 9, 2], stop).tokens == incremental_generate(llm, [5, 9, 2], stop).tokens


def test_recost_served_keeps_the_costs_per_forward_and_reads_them_at_the_next_start(models, tmp_path, monkeypatch):
    """``recost_cache``: the first start on a forward times the costs and keeps them; the next start of the
    same scheduler on the same forward reads them (the same fixed choice, no timing); another forward, or
    the cache turned off, times them again; a torn entry is timed again and rewritten."""
    from test_scheduler import SPEC, synthetic_records
    from test_scheduler import costs as trained_costs

    from boosttune.assemble import Served, recost_note, recost_served
    from boosttune.config import SchedulerConfig
    from boosttune.recost_cache import forward_label
    from boosttune.scheduler.offline.train import fit_scheduler

    monkeypatch.setenv("BOOSTTUNE_RECOST_CACHE", str(tmp_path / "recost"))
    llm, ssms = models[0], models[1][:2]
    engine = engine_from_models(llm, ssms, TreeConfig(widths=(1, 1)))
    cfg = SchedulerConfig(prompts="unused", depths=(1, 2), pca_components=4, ridge_alphas=(1e-3,), prompt_lookup=False)
    sched = fit_scheduler(synthetic_records(), trained_costs(), SPEC, (1, 1), cfg)
    prompts = [[5, 9, 2, 7], [3, 3, 8]]
    assert forward_label(engine.llm) == "torch.float32 unquantized eager"

    def start(keep: bool = True) -> tuple[Served, float]:
        served = Served(engine=engine, llm=None, models={}, scheduler=sched)  # type: ignore[arg-type]
        return served, recost_served(served, prompts=prompts, tokens=6, keep=keep)

    first, first_s = start()
    saved = first.scheduler.meta["recosted"]["saved"]
    assert saved and first.scheduler.meta["recosted"]["kept"] is None and len(list((tmp_path / "recost").iterdir())) == 1
    again, again_s = start()
    assert again.scheduler.meta["recosted"]["kept"] == saved and again.scheduler.costs == first.scheduler.costs
    assert again.scheduler.fallback == first.scheduler.fallback and again_s < first_s
    assert "read from" in recost_note(again, again_s) and "measured again" in recost_note(first, first_s)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # another forward as the timings see it: another entry
    try:
        other, _ = start()
    finally:
        torch.set_num_threads(threads)
    assert other.scheduler.meta["recosted"]["kept"] is None and len(list((tmp_path / "recost").iterdir())) == 2
    unkept, _ = start(keep=False)  # calibration_repeats: timed, nothing read or written
    assert unkept.scheduler.meta["recosted"]["kept"] is None and unkept.scheduler.meta["recosted"]["saved"] is None
    Path(saved).write_text("{not json")
    torn, _ = start()
    assert torn.scheduler.meta["recosted"]["kept"] is None and torn.scheduler.meta["recosted"]["saved"] == saved
    monkeypatch.setenv("BOOSTTUNE_RECOST_CACHE", "0")
    off, _ = start()
    assert off.scheduler.meta["recosted"]["kept"] is None and off.scheduler.meta["recosted"]["saved"] is None
