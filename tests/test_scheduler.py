"""The learned scheduler without models: subsets arithmetic, fit/predict decisions, costs, files."""

from __future__ import annotations

import dataclasses
import json
import pickle

import numpy as np
import pytest

from boosttune.config import SchedulerConfig, from_dict
from boosttune.scheduler.costs import CostModel, tree_nodes
from boosttune.scheduler.features import FeatureSpec, RequestFeatures, hashed_ngrams, lookup_hit_rate
from boosttune.scheduler.model import fit_linear, make_pipeline
from boosttune.scheduler.offline.labels import RequestRecord
from boosttune.scheduler.offline.train import fit_scheduler
from boosttune.scheduler.persist import SchedulerFileError, digest
from boosttune.scheduler.policy import Candidate, Scheduler
from boosttune.scheduler.subsets import monotone, union_survival
from boosttune.serving.engine import Plan
from boosttune.serving.tree import TreeConfig

SPEC = FeatureSpec(hidden_size=2, ngram_buckets=1, lookup=False)  # the layout before the lookup feature
IDS = [5, 6, 7, 8]  # any prompt of >= 2 tokens (the scheduler falls back without a prefill)


def costs(draft0=(0.01, 0.02), draft1=(0.01, 0.02)) -> CostModel:
    """Two SSMs, depths 1 and 2 of a chain; verification nearly flat; no overhead, no prefill."""
    return CostModel(
        depths=(1, 2),
        nodes_per_ssm=(1, 2),
        draft_s=(tuple(draft0), tuple(draft1)),
        ssm_prefill_s_per_token=(0.0, 0.0),
        verify_nodes=(0, 1, 2, 4),
        verify_s=(0.020, 0.021, 0.022, 0.024),
        overhead_s=(0.0, 0.0),
    )


def feats(h0: float, h1: float) -> RequestFeatures:
    return RequestFeatures(
        prompt_tokens=len(IDS),
        chat=True,
        hidden_mean=np.array([h0, h1], np.float32),
        ngrams=np.ones(1, np.float32),
    )


# Three kinds of request: SSM 0 accepts 2 tokens on every step of kind A, SSM 1 on kind B, nobody on C.
KINDS = {"A": ((1.0, 0.0), [2, 0]), "B": ((-1.0, 0.0), [0, 2]), "C": ((0.0, 1.0), [0, 0])}


def synthetic_records() -> list[RequestRecord]:
    out = []
    for i in range(4):
        for name, (h, acc) in KINDS.items():
            accepts = np.array([acc] * 10, dtype=np.int64)
            out.append(
                RequestRecord(f"{name}{i}", feats(*h), accepts, new_tokens=30, wall_s=1.0, prefill_s=0.01)
            )
    return out


@pytest.fixture(scope="module")
def scheduler() -> Scheduler:
    cfg = SchedulerConfig(prompts="unused", depths=(1, 2), pca_components=4, ridge_alphas=(1e-3,), prompt_lookup=False)
    return fit_scheduler(synthetic_records(), costs(), SPEC, (1, 1), cfg)


# -- subsets arithmetic ---------------------------------------------------------------------------
def test_union_survival():
    accepts = np.array([[0, 2], [1, 0], [3, 1]])  # 3 positions, 2 SSMs
    u = union_survival(accepts, 2, 3)  # rows: {0}, {1}, {0,1}
    np.testing.assert_allclose(u, [[2 / 3, 1 / 3, 1 / 3], [2 / 3, 1 / 3, 0], [1, 2 / 3, 1 / 3]])


def test_monotone_projection():
    raw = np.array([[0.9, 1.2, -0.1], [0.2, 0.5, 0.1], [0.5, 0.1, 0.0]])  # {0}, {1}, {0,1}
    u = monotone(raw, 2)
    np.testing.assert_allclose(u, [[0.9, 0.9, 0.0], [0.2, 0.2, 0.1], [0.9, 0.9, 0.1]])


def test_tree_nodes_of_expansion_widths():
    assert [tree_nodes((1, 1, 3, 1), k) for k in (1, 2, 3, 4)] == [1, 2, 5, 8]


def test_hashed_ngrams_are_stable_unit_vectors():
    a = hashed_ngrams([1, 2, 3, 2, 3], 16)
    assert a.shape == (16,) and np.linalg.norm(a) == pytest.approx(1.0)
    np.testing.assert_array_equal(a, hashed_ngrams([1, 2, 3, 2, 3], 16))
    assert not np.array_equal(a, hashed_ngrams([3, 2, 1, 2, 3], 16))


# -- fit / predict / decide ----------------------------------------------------------------------
def test_fitted_scheduler_makes_the_expected_decisions(scheduler):
    expected = {"A": ((0,), 2), "B": ((1,), 2), "C": ((), 0)}
    for name, ((h0, h1), _) in KINDS.items():
        choice = scheduler.choose(IDS, feats(h0, h1))
        assert (choice.ssm_indices, choice.depth) == expected[name], name
        assert not choice.fallback and choice.seconds > 0
    a = scheduler.choose(IDS, feats(1.0, 0.0))
    assert a.predicted_tau == pytest.approx(3.0, abs=0.01)
    assert a.predicted_tokens_per_s == pytest.approx(
        3.0 / 0.042, rel=0.01
    )  # τ / (draft 0.02 + verify(2) 0.022)
    assert a.trees is not None and set(a.trees) == {0} and a.trees[0].widths == (1, 1)
    assert a.plan == Plan({"ssm-1": TreeConfig(widths=(1, 1))})  # what the engine is handed: drafters by name
    assert scheduler.fallback == Candidate(0, 0)  # on these requests no fixed choice beats plain decoding


def test_linear_model_equals_the_sklearn_pipeline():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 7)), rng.normal(size=(20, 5))
    for keep in (0, 2):  # without and with features passed by the PCA
        model = fit_linear(x, y, components=4, alphas=(0.5, 5.0), passthrough=keep)
        assert model.passthrough == keep and model.coef.shape[1] == keep + model.components.shape[0]
        pipe = make_pipeline(model.components.shape[0], model.alpha, x.shape[1], keep).fit(x, y)
        np.testing.assert_allclose(model.predict(x), pipe.predict(x), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(model.predict(x[3]), pipe.predict(x[3:4])[0], rtol=1e-9, atol=1e-12)


def test_a_costly_ssm_with_equal_predicted_gain_is_dropped(scheduler):
    survival = np.array([[0.8, 0.6]] * 3)  # {0}, {1}, {0,1} predicted alike
    def priced(cost_model, margin=0.0):
        return Scheduler(SPEC, scheduler.model, cost_model, (1, 1), 30, 6.0, Candidate(0, 0), margin=margin)

    cheap0 = priced(costs(draft0=(0.005, 0.01), draft1=(0.03, 0.06)))
    choice = cheap0.decide(survival, prompt_tokens=4)
    assert (choice.ssm_indices, choice.depth) == ((0,), 2)  # 0.030 s / 2.4 tokens beats plain 0.020 s / token
    cheap1 = priced(costs(draft0=(0.03, 0.06), draft1=(0.005, 0.01)))
    assert cheap1.decide(survival, prompt_tokens=4).ssm_indices == (1,)
    pricey = priced(costs(draft0=(0.05, 0.1), draft1=(0.05, 0.1)))
    assert pricey.decide(survival, prompt_tokens=4).ssm_indices == ()  # drafting costs more than it saves
    cautious = priced(cheap0.costs, margin=0.5)
    assert (
        cautious.decide(survival, prompt_tokens=4).ssm_indices == ()
    )  # 0.0125 s/token is not 50 % below 0.020


def test_out_of_range_requests_get_the_fallback(scheduler):
    far = scheduler.choose(IDS, feats(100.0, 0.0))
    assert far.fallback and "standard deviations" in far.reason
    assert (far.ssm_indices, far.depth) == ((), 0)
    assert scheduler.choose(IDS, feats(float("nan"), 0.0)).reason == "non-finite features"
    assert "one-token" in scheduler.choose([5], feats(1.0, 0.0)).reason


# -- persistence ---------------------------------------------------------------------------------
def test_scheduler_file_round_trip(scheduler, tmp_path):
    path = tmp_path / "scheduler.json"
    scheduler.save(path)
    loaded = Scheduler.load(path)
    for (h0, h1), _ in KINDS.values():
        a, b = scheduler.choose(IDS, feats(h0, h1)), loaded.choose(IDS, feats(h0, h1))
        assert (a.ssm_indices, a.depth, a.predicted_tau) == (b.ssm_indices, b.depth, b.predicted_tau)
    assert loaded.drafters == scheduler.drafters == ("ssm-1", "ssm-2")
    # files written before drafters were named: the names come from meta["ssms"], else by position
    body = {k: v for k, v in scheduler.to_json().items() if k != "drafters"}
    assert Scheduler.from_json({**body, "meta": {"ssms": ["a", "b"]}}).drafters == ("a", "b")
    assert Scheduler.from_json(body).drafters == ("ssm-1", "ssm-2")


def _rewrite(path, edit) -> None:
    env = json.loads(path.read_text())
    edit(env)
    env["sha256"] = digest(env["body"])
    path.write_text(json.dumps(env))


def test_corrupted_scheduler_file_is_refused(scheduler, tmp_path):
    path = tmp_path / "scheduler.json"
    scheduler.save(path)
    text = path.read_text()
    path.write_text(text.replace('"z_max": 6.0', '"z_max": 60.0'))
    with pytest.raises(SchedulerFileError, match="sha256 self-check"):
        Scheduler.load(path)
    path.write_text(text[: len(text) // 2])
    with pytest.raises(SchedulerFileError, match="not a JSON scheduler file"):
        Scheduler.load(path)


def test_wrong_version_unknown_type_and_pickle_are_refused(scheduler, tmp_path):
    path = tmp_path / "scheduler.json"
    scheduler.save(path)
    _rewrite(path, lambda env: env.update(version=2))
    with pytest.raises(SchedulerFileError, match="version 2, this boosttune reads version 1"):
        Scheduler.load(path)
    scheduler.save(path)
    _rewrite(path, lambda env: env["body"]["model"].update(type="sklearn_pipeline"))
    with pytest.raises(SchedulerFileError, match="unknown type 'sklearn_pipeline' at body.model"):
        Scheduler.load(path)
    scheduler.save(path)
    _rewrite(path, lambda env: env["body"]["costs"].update(draft_s=[[0.1]]))
    with pytest.raises(SchedulerFileError, match="malformed scheduler"):
        Scheduler.load(path)
    path.write_bytes(pickle.dumps({"type": "scheduler"}))
    with pytest.raises(SchedulerFileError, match="pickle/skops files are never loaded"):
        Scheduler.load(path)
    with pytest.raises(SchedulerFileError, match="no scheduler file"):
        Scheduler.load(tmp_path / "missing.json")


# -- config --------------------------------------------------------------------------------------
def test_config_from_dict_names_unknown_fields_and_bad_values():
    cfg = from_dict(SchedulerConfig, {"prompts": "p.jsonl", "depths": [1, 2], "limit": 10}, "scheduler")
    assert cfg.depths == (1, 2) and cfg.label_depth == 2 and cfg.limit == 10
    with pytest.raises(ValueError, match=r"unknown field scheduler\.budget"):
        from_dict(SchedulerConfig, {"budget": 3}, "scheduler")
    with pytest.raises(ValueError, match="scheduler.train_fraction"):
        SchedulerConfig(train_fraction=1.5)
    with pytest.raises(ValueError, match="scheduler.widths"):
        SchedulerConfig(depths=(1, 4), widths=(1, 0))
    assert SchedulerConfig(depths=(1, 4), widths=(1, 1)).widths == (1, 1)  # SSM depth saturates at 2
    with pytest.raises(ValueError, match="scheduler.real_policies"):
        SchedulerConfig(real_policies=("oracle",))


# -- prompt lookup as a drafter to choose -------------------------------------------------------
def test_lookup_hit_rate_counts_the_tokens_prompt_lookup_would_guess():
    assert lookup_hit_rate([1, 2, 3, 4]) == 0.0  # nothing repeats
    # 1 2 3 1 2 3: after "1" (seen before, followed by 2) it guesses 2, then 3: 2 hits of 5
    assert lookup_hit_rate([1, 2, 3, 1, 2, 3]) == pytest.approx(2 / 5)
    # the latest occurrence wins: after "1 2 1" the 1-gram "1" was last followed by 2 → guesses 2 (wrong: 5)
    assert lookup_hit_rate([1, 2, 1, 5]) == pytest.approx(0 / 3)
    assert lookup_hit_rate([7]) == 0.0


def lookup_records(dims: int) -> list[RequestRecord]:
    """Drafter 0 (an SSM) accepts 1 token per step on every request; drafter 1 (prompt lookup)
    accepts 3 on requests whose prompt repeats itself (hit rate 0.8) and none on others (0.1).
    The hidden state is noise in ``dims`` dimensions: only the passed-through scalar tells."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(24):
        copying = i % 2 == 0
        f = RequestFeatures(
            prompt_tokens=40, chat=True, hidden_mean=rng.normal(size=dims).astype(np.float32),
            ngrams=np.ones(1, np.float32), lookup_hit_rate=(0.8 if copying else 0.1) + 0.01 * (i % 5),
        )
        accepts = np.array([[1, 3 if copying else 0]] * 10, dtype=np.int64)
        out.append(RequestRecord(f"r{i}", f, accepts, new_tokens=40, wall_s=1.0, prefill_s=0.01))
    return out


def test_the_prompt_lookup_feature_steers_the_choice_through_the_pca():
    """A cheap lookup drafter (chains of up to 3, ~1.2 nodes per step) and an SSM of fixed cost:
    copying prompts get prompt lookup at depth 3, the others the SSM at depth 1. The deciding
    scalar sits among 32 noisy hidden dimensions; without passing it by the PCA it would be lost."""
    dims = 32
    spec = FeatureSpec(hidden_size=dims, ngram_buckets=1, lookup=True)
    cost = CostModel(
        depths=(1, 3), nodes_per_ssm=((1, 3), (0.4, 1.2)), draft_s=((0.004, 0.012), (0.00002, 0.00002)),
        ssm_prefill_s_per_token=(0.0, 0.0), verify_nodes=(0, 1, 2, 4, 8), verify_s=(0.020, 0.021, 0.022, 0.024, 0.03),
        overhead_s=(0.0, 0.0),
    )
    cfg = SchedulerConfig(prompts="unused", depths=(1, 3), pca_components=2, ridge_alphas=(1e-3,), margin=0.0)
    records = lookup_records(dims)
    sched = fit_scheduler(records, cost, spec, (1, 1, 1), cfg)
    assert sched.model.passthrough == 3
    for rec in lookup_records(dims)[:6]:  # same kinds, fresh requests' features drawn alike
        choice = sched.choose(IDS, rec.features)
        copying = rec.features.lookup_hit_rate > 0.5
        assert not choice.fallback, choice.reason
        assert (choice.ssm_indices, choice.depth) == (((1,), 3) if copying else ((0,), 1)), rec.id


def test_cost_model_prices_each_drafters_own_tree_size():
    cost = CostModel(
        depths=(1, 2), nodes_per_ssm=((1, 2), (0.5, 1.0)), draft_s=((0.01, 0.02), (0.0, 0.0)),
        ssm_prefill_s_per_token=(0.0, 0.0), verify_nodes=(0, 2, 4), verify_s=(0.02, 0.03, 0.04), overhead_s=(0.0, 0.0),
    )
    assert cost.step_cost(0b10, 1) == pytest.approx(0.025)  # 1 node: verify(1) = 0.025
    assert cost.step_cost(0b11, 1) == pytest.approx(0.02 + 0.03 + 0.005 * 1)  # 3 nodes
    legacy = CostModel.from_json({**cost.to_json(), "nodes_per_ssm": [1, 2]})  # files before per-drafter sizes
    assert legacy.nodes_per_ssm == ((1.0, 2.0), (1.0, 2.0))
    assert CostModel.from_json(cost.to_json()) == cost


def test_a_scheduler_for_another_number_of_ssms_is_refused(scheduler):
    scheduler.check_drafters(["ssm-1", "ssm-2"])
    with pytest.raises(SchedulerFileError, match="trained for 2 SSMs, the bundle has 3"):
        scheduler.check_drafters(["ssm-1", "ssm-2", "ssm-3"])
    with pytest.raises(SchedulerFileError, match="ssm-1, ssm-2 vs ssm-1, ssm-3"):  # drafters are named, not counted
        scheduler.check_drafters(["ssm-1", "ssm-3"])
    with_lookup = Scheduler(SPEC, scheduler.model, scheduler.costs, (1, 1), 30, 6.0, Candidate(0, 0),
                            prompt_lookup=True)
    with_lookup.check_drafters(["ssm-1"])  # one SSM and prompt lookup
    with pytest.raises(SchedulerFileError, match="1 SSMs and prompt lookup, the bundle has 2"):
        with_lookup.check_drafters(["ssm-1", "ssm-2"])


def test_ssm_depth_saturates_while_prompt_lookup_drafts_deeper(scheduler):
    s = Scheduler(SPEC, scheduler.model, scheduler.costs, (1, 1), 30, 6.0, Candidate(0, 0), prompt_lookup=True)
    trees = s.trees(Candidate(0b11, 5))  # drafter 0 an SSM with two levels of widths, drafter 1 prompt lookup
    assert trees[0].widths == (1, 1) and trees[1].widths == (1,) * 5
    assert s.trees(Candidate(0b10, 3)) == {1: TreeConfig(widths=(1, 1, 1))} and s.trees(Candidate(0, 0)) is None
    # per-match lengths: prompt lookup drafts up to the label depth, cut per match; SSMs keep the depth
    trees = s.trees(Candidate(0b11, 1, (0, 2, 2)))
    assert trees[0].widths == (1,) and trees[1] == TreeConfig(widths=(1, 1), ngram_depths=(0, 2, 2))
    tabled = dataclasses.replace(s, lookup_depths=(0, 2, 2))
    assert tabled.with_table(Candidate(0b10, 1)) == Candidate(0b10, 1, (0, 2, 2))
    assert tabled.with_table(Candidate(0b01, 1)) == Candidate(0b01, 1)  # no prompt lookup: no table
    assert Scheduler.from_json(tabled.to_json()).lookup_depths == (0, 2, 2)


def test_lookup_hit_rate_agrees_with_the_drafters_own_search():
    """The O(T) feature must count exactly what ``find_match`` (the drafter's search) would guess."""
    from boosttune.serving.lookup import find_match

    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, 5, size=int(rng.integers(1, 40))).tolist()
        guesses = [find_match(np.array(ids[:t]), 1)[1] for t in range(1, len(ids))]
        hits = sum(g.size > 0 and g[0] == ids[t] for t, g in enumerate(guesses, start=1))
        assert lookup_hit_rate(ids) == pytest.approx(hits / max(1, len(ids) - 1)), ids


def test_paired_ratio_interval():
    from boosttune.scheduler.offline.evaluate import Outcome
    from boosttune.scheduler.offline.report import paired_ratio_ci

    def runs(rates):
        return [Outcome(Candidate(0, 0), new_tokens=10, tau=1.0, wall_s=10 / r, draft_s=0.0) for r in rates]

    base = [40.0, 50.0, 60.0, 45.0]
    same_edge = paired_ratio_ci(runs([1.1 * r for r in base]), runs(base))
    assert same_edge["ratio"] == pytest.approx(1.1) and same_edge["share_faster"] == 1.0
    assert same_edge["low"] == pytest.approx(1.1) and same_edge["high"] == pytest.approx(1.1)
    mixed = paired_ratio_ci(runs([44.0, 40.0, 66.0, 40.0]), runs(base))
    assert mixed["low"] < mixed["ratio"] < mixed["high"] and mixed["share_faster"] == 0.5


# -- cross-validated adoption (offline/crossval.py) -----------------------------------------------
def test_folds_deal_every_request_once():
    from boosttune.scheduler.offline.crossval import folds

    assert folds(5, 2) == [[0, 2, 4], [1, 3]] and folds(3, 10) == [[0], [1], [2]]
    assert folds(1, 10) == [] and folds(4, 0) == []


def test_too_few_requests_to_check_serve_the_fallback():
    """Three requests leave two to refit on, fewer than the model takes: nothing is compared, nothing
    learned is served."""
    cfg = SchedulerConfig(prompts="unused", depths=(1, 2), pca_components=4, ridge_alphas=(1e-3,), prompt_lookup=False)
    few = fit_scheduler(synthetic_records()[:3], costs(), SPEC, (1, 1), cfg)
    assert not few.per_request and few.meta["crossval"]["per_request"] == {**few.meta["crossval"]["per_request"],
                                                                          "adopted": False, "requests": 0}


def test_a_learned_part_is_served_only_with_a_confident_held_out_gain():
    from boosttune.scheduler.offline.crossval import verdict
    from boosttune.scheduler.offline.evaluate import Outcome

    def runs(rates):
        return [Outcome(Candidate(0, 0), new_tokens=10, tau=1.0, wall_s=10 / r, draft_s=0.0) for r in rates]

    base = [40.0, 50.0, 60.0, 45.0, 55.0, 42.0]
    assert verdict(runs([1.05 * r for r in base]), runs(base), margin=0.02).adopted
    small = verdict(runs([1.01 * r for r in base]), runs(base), margin=0.02)  # surely faster, by less than the margin
    assert not small.adopted and small.low > 1.0 and small.ratio == pytest.approx(1.01)
    noisy = verdict(runs([80.0, 40.0, 60.0, 35.0, 55.0, 42.0]), runs(base), margin=0.02)  # 6 % on average, by chance
    assert noisy.ratio > 1.02 and noisy.low < 1.0 and not noisy.adopted
    assert not verdict([], [], margin=0.0).adopted


def test_per_request_choice_is_served_where_it_generalises(scheduler):
    cv = scheduler.meta["crossval"]
    assert scheduler.per_request and cv["per_request"]["adopted"] and cv["per_request"]["requests"] == 12
    assert cv["per_request"]["low"] > 1.0


def _clustered_records(signal: bool, seed: int) -> list[RequestRecord]:
    """Six requests of each kind with 16-dim hidden-state features: around a centre per kind
    (``signal``), or the same noise for every kind (the features say nothing about the kind)."""
    rng = np.random.default_rng(seed)
    centres = {name: 2.0 * rng.normal(size=16) for name in KINDS}
    out = []
    for i in range(6):
        for name, (_, acc) in KINDS.items():
            h = rng.normal(size=16) + (centres[name] if signal else 0.0)
            f = RequestFeatures(prompt_tokens=len(IDS), chat=True, hidden_mean=h.astype(np.float32),
                                ngrams=np.ones(1, np.float32))
            out.append(RequestRecord(f"{name}{i}", f, np.array([acc] * 10, dtype=np.int64), new_tokens=30,
                                     wall_s=1.0, prefill_s=0.01))
    return out


def test_per_request_choice_is_served_only_where_the_features_carry_signal():
    """Negative control: with features that say nothing about the kind, the fit still makes a rule
    that leaves the fallback for a third of its own requests; held out, it does not pay, so every
    request gets the fallback. With signal, the same check serves the rule."""
    spec = FeatureSpec(hidden_size=16, ngram_buckets=1, lookup=False)
    cfg = SchedulerConfig(prompts="unused", depths=(1, 2), pca_components=8, ridge_alphas=(1e-3,), prompt_lookup=False)
    noise = _clustered_records(signal=False, seed=2)
    unchecked = fit_scheduler(noise, costs(), spec, (1, 1), dataclasses.replace(cfg, cv_folds=0))
    assert unchecked.per_request and "crossval" not in unchecked.meta
    own = [unchecked.choose(IDS, r.features).candidate for r in noise]
    assert sum(c != unchecked.fallback for c in own) >= 5  # an in-sample rule, not the fallback everywhere
    checked = fit_scheduler(noise, costs(), spec, (1, 1), cfg)
    assert not checked.per_request and not checked.meta["crossval"]["per_request"]["adopted"]
    for r in noise:
        choice = checked.choose(IDS, r.features)
        assert choice.fallback and "cross-validation" in choice.reason and choice.candidate == checked.fallback
    served = fit_scheduler(_clustered_records(signal=True, seed=0), costs(), spec, (1, 1), cfg)
    assert served.per_request and served.meta["crossval"]["per_request"]["low"] > 1.0
    # the file keeps the verdict; files written before it chose per request
    body = checked.to_json()
    assert Scheduler.from_json(body).per_request is False
    assert Scheduler.from_json({k: v for k, v in body.items() if k != "per_request"}).per_request is True


def test_recosted_takes_the_fixed_choice_again_on_the_served_forwards_costs(scheduler):
    """The same acceptance model over other costs: cheap drafts and flat verification make drafting the
    fixed choice; verification that grows steeply with the tree (int8 products) makes it plain decoding."""
    cheap = dataclasses.replace(costs(draft0=(0.001, 0.001), draft1=(0.001, 0.001)))
    drafting = scheduler.recosted(cheap, prompt_tokens=4)
    assert drafting.fallback == Candidate(0b11, 2) and drafting.costs is cheap  # τ 7/3 for 0.026 s
    assert drafting.meta["recosted"]["fallback_before"] == {"mask": 0, "depth": 0}
    pair = scheduler.candidates.index(Candidate(0b11, 2))  # τ replayed on the training requests
    assert drafting.meta["recosted"]["predicted_tau"] == pytest.approx(scheduler.fixed_tau[pair])
    assert drafting.choose(IDS, feats(1.0, 0.0)).ssm_indices == (0,)  # the per-request choice reads the new costs
    steep = dataclasses.replace(cheap, verify_s=(0.020, 0.040, 0.060, 0.100))
    assert drafting.recosted(steep, prompt_tokens=4).fallback == Candidate(0, 0)
    with pytest.raises(ValueError, match="depths"):
        scheduler.recosted(dataclasses.replace(cheap, depths=(1, 3)), prompt_tokens=4)


def test_the_calibrated_curve_is_fitted_monotone_by_the_timings_behind_each_median():
    """A running maximum of medians let one small group's slow median lift every larger tree after it (one
    demo calibration: 19 one-node verifications at 59.0 ms over 608 three-node ones at 57.3 ms). The fit
    pools a group that breaks the order with its neighbours, weighted by their sizes, and keeps the
    medians where they are already in order."""
    from boosttune.scheduler.calibrate import monotone_fit

    assert monotone_fit([[1.0, 1.2, 0.8], [2.0], [2.0, 3.0, 4.0]]) == pytest.approx([1.0, 2.0, 3.0])
    fit = monotone_fit([[1.0] * 10, [3.0] * 2, [2.0] * 98])  # running maximum: 1, 3, 3
    assert fit == pytest.approx([1.0, 2.02, 2.02])
    assert monotone_fit([[5.0, 7.0]]) == [6.0] and monotone_fit([]) == []


def test_the_fixed_choice_is_the_simplest_within_the_margin_of_the_fastest():
    """A drafter joins the fixed choice only where the costs give it ``margin`` more speed: near-ties
    (the demo's head with lookup against lookup alone, 0.03 % apart) go to fewer drafters, then the
    shallower tree; without a margin the fastest wins, and a ruled-out candidate (-inf) never does."""
    from boosttune.scheduler.policy import simplest_within

    cands = [Candidate(0, 0), Candidate(0b01, 1), Candidate(0b11, 1), Candidate(0b01, 2), Candidate(0b10, 1)]
    speeds = np.array([10.0, 20.0, 20.3, 20.1, -np.inf])
    assert simplest_within(speeds, cands, 0.02) == 1  # {0}@1: within 2 % of {0,1}@1, one drafter, shallowest
    assert simplest_within(speeds, cands, 0.0) == 2
    assert simplest_within(speeds, cands, 0.55) == 0  # plain decoding within 55 %: nothing to draft with
    assert simplest_within(np.array([10.0, 20.0, 30.0, 25.0, 40.0]), cands, 0.02) == 4  # -inf gone: {1}@1 fastest


def test_fitted_and_recosted_fallbacks_take_the_simpler_choice_in_a_near_tie():
    """SSM 1 covers SSM 0's misses on one request of 12, which makes the pair 2.4 % faster in replay
    (verification flat, SSM 1's drafts free): with a margin of 3 % the fitted fallback and the one
    ``recosted`` takes both leave SSM 1 out; with no margin both take the pair."""
    common = np.array([[2, 0]] * 20, dtype=np.int64)
    rare = np.array([[2, 0]] * 15 + [[0, 2]] * 5, dtype=np.int64)
    records = [RequestRecord(f"r{i}", feats(1.0, 0.0), rare if i == 0 else common, new_tokens=60, wall_s=1.0,
                             prefill_s=0.01) for i in range(12)]
    near = dataclasses.replace(costs(draft0=(0.001, 0.001), draft1=(0.0, 0.0)), verify_s=(0.02,) * 4)
    for margin, want in ((0.03, Candidate(0b01, 2)), (0.0, Candidate(0b11, 2))):
        cfg = SchedulerConfig(prompts="unused", depths=(1, 2), pca_components=4, ridge_alphas=(1e-3,),
                              prompt_lookup=False, margin=margin, cv_folds=0)
        fitted = fit_scheduler(records, near, SPEC, (1, 1), cfg)
        assert fitted.fallback == want, margin
        assert fitted.recosted(near, prompt_tokens=4).fallback == want, margin


def test_recosted_weighs_costs_with_the_tau_replayed_on_the_training_requests(scheduler, tmp_path):
    """``recosted`` ranks by each candidate's τ replayed from the training labels (``fixed_tau``), not by
    the model at the features' mean (the demo: prompt lookup τ 2.19 by the model, 1.16 replayed on held-out
    requests): a candidate whose replayed τ is raised becomes the choice. A file written before
    ``fixed_tau`` loads without it and ranks by the model, as before."""
    assert len(scheduler.fixed_tau) == len(scheduler.candidates) and min(scheduler.fixed_tau) >= 1.0
    cheap = costs(draft0=(0.001, 0.001), draft1=(0.001, 0.001))
    single = scheduler.candidates.index(Candidate(0b10, 1))
    raised = dataclasses.replace(scheduler, fixed_tau=tuple(10.0 if i == single else t
                                                            for i, t in enumerate(scheduler.fixed_tau)))
    assert raised.recosted(cheap, prompt_tokens=4).fallback == Candidate(0b10, 1)
    body = scheduler.to_json()
    del body["fixed_tau"]
    old = Scheduler.from_json(body)
    assert old.fixed_tau == () and old.recosted(cheap, prompt_tokens=4).fallback == Candidate(0b11, 2)
    assert old.recosted(cheap, prompt_tokens=4).meta["recosted"]["predicted_tau"] == pytest.approx(7 / 3, abs=0.02)
    scheduler.save(tmp_path / "s.json")
    assert Scheduler.load(tmp_path / "s.json").fixed_tau == scheduler.fixed_tau
    with pytest.raises(ValueError, match="fixed_tau"):
        dataclasses.replace(scheduler, fixed_tau=(1.0, 2.0))
    with pytest.raises(ValueError, match="fixed_tau"):
        Scheduler.from_json({**scheduler.to_json(), "fixed_tau": ["2.0"] * len(scheduler.candidates)})
