"""Top-k coverage of the LLM's tokens by drafters and their union (boosttune/train/coverage.py), against
numbers worked out by hand; the pool and weights boosting derives from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_script

from boosttune.core.ranks import NOT_DRAFTABLE
from boosttune.train.coverage import (
    coverage,
    coverage_summary,
    lookup_rank_rows,
    remove_best_covered,
    sample_union_coverage,
    token_weights,
    tree_taus,
    union_coverage,
    union_rank_rows,
    walked_tau,
)

# Three drafters, six positions. With k = 2 (rank 0 or 1 covers):
#   A covers positions 0, 1, 2      -> 3/6
#   B covers positions 2, 3         -> 2/6 (position 5 is outside its draft vocabulary)
#   C covers position 0             -> 1/6
#   union covers 0, 1, 2, 3         -> 4/6; best single A 3/6; gain 1/6
# top-1 (rank 0): A at 0 and 2, B at 3, C none; union 0, 2, 3 -> 3/6
RANKS = [[0, 1, 0, 5, 9, 2],
         [4, 3, 1, 0, 7, NOT_DRAFTABLE],
         [1, 2, 2, 6, 3, 8]]


def test_coverage_and_union_by_hand() -> None:
    np.testing.assert_allclose(coverage(RANKS, 2), [3 / 6, 2 / 6, 1 / 6])
    np.testing.assert_allclose(coverage(RANKS, 1), [2 / 6, 1 / 6, 0])
    assert union_coverage(RANKS, 2) == pytest.approx(4 / 6)
    assert union_coverage(RANKS, 1) == pytest.approx(3 / 6)
    s = coverage_summary(torch.tensor(RANKS), 2)  # tensors work as arrays do
    assert s["topk"] == pytest.approx([3 / 6, 2 / 6, 1 / 6]) and s["top1"] == pytest.approx([2 / 6, 1 / 6, 0])
    assert s["union_topk"] == pytest.approx(4 / 6) and s["union_top1"] == pytest.approx(3 / 6)
    assert s["best_single_topk"] == pytest.approx(3 / 6) and s["union_gain"] == pytest.approx(1 / 6)
    assert s["k"] == 2 and s["tokens"] == 6
    # a drafter that misses what another misses adds nothing; a large k covers all but the undraftable
    assert union_coverage([RANKS[0], RANKS[0]], 2) == pytest.approx(coverage(RANKS, 2)[0])
    assert union_coverage([RANKS[1]], 10**6) == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="ranks"):
        coverage([0, 1], 1)


def test_per_sample_union_coverage_and_union_ranks() -> None:
    # two samples (lengths 2 and 4) cut from RANKS's first two drafters
    rows = [[r[:2], r[2:]] for r in RANKS[:2]]
    # sample 0: A covers both -> 1; sample 1: positions 2, 3 covered of 2..5 -> 2/4
    assert sample_union_coverage(rows, 2) == pytest.approx([1.0, 0.5])
    assert union_rank_rows(rows) == [[0, 1], [0, 0, 7, 2]]


def test_quantile_pool_removes_the_best_covered_share() -> None:
    cov = {0: 0.9, 1: 0.1, 2: 0.5, 3: 0.5, 4: 0.8, 5: 0.0, 6: 0.3}  # sample index -> union coverage
    pool = [6, 1, 2, 3, 4, 0]
    # half of 6 leave: the best covered 0 (.9), 4 (.8), then 2 of the tie 2/3 (lower index first)
    assert remove_best_covered(pool, cov, 0.5) == [6, 1, 3]
    # 0.25 of 6 = 1.5, rounded half up: 2 leave
    assert remove_best_covered(pool, cov, 0.25) == [6, 1, 2, 3]
    assert remove_best_covered([5], cov, 0.4) == [5]  # 0.4 of one rounds to none
    assert remove_best_covered([], cov, 0.5) == []


def test_token_weights_count_covered_tokens_less() -> None:
    assert token_weights([[0, 3, 1], [NOT_DRAFTABLE]], 2, 0.1) == [[0.1, 1.0, 0.1], [1.0]]


def test_lookup_ranks_mark_where_its_first_drafted_token_is_the_llms() -> None:
    """Prompt 5 6 7 5 6, answer 7 8 5 6 7 9, by hand (the newest 3-, 2-, then 1-gram's latest earlier use):
    t=0 "5 6" was followed by 7: right; t=1 "5 6 7" by 5, not 8; t=2 nothing before ends in 8; t=3 "5"
    (at 3) by 6: right; t=4 "5 6" (at 3) by 7: right; t=5 "5 6 7" (at 3) by 8, not 9."""
    from boosttune.train.distill import Sample

    sample = Sample(ids=[5, 6, 7, 5, 6, 7, 8, 5, 6, 7, 9], prompt_len=5)
    n = NOT_DRAFTABLE
    assert lookup_rank_rows([sample, Sample(ids=[1, 2], prompt_len=1)]) == [[0, n, n, 0, 0, n], [n]]
    # one candidate: it covers at every k >= 1, as a merged tree's lookup branch does
    assert coverage([lookup_rank_rows([sample])[0]], 1).tolist() == pytest.approx([0.5])


def test_coverage_by_category_groups_answers() -> None:
    from boosttune.train.coverage import coverage_by_category

    # two drafters, three answers: RANKS cut into [0:2] (math), [2:3] (writing), [3:6] (math)
    ranks = [[np.asarray(r[:2]), np.asarray(r[2:3]), np.asarray(r[3:])] for r in RANKS[:2]]
    table = coverage_by_category(ranks, ["math", "writing", "math"], 2)
    assert list(table) == ["all", "math", "writing"]
    assert table["all"]["union_topk"] == pytest.approx(union_coverage(RANKS[:2], 2))
    # math = positions 0, 1, 3, 4, 5: A covers 0, 1; B covers 3; union 3/5
    assert table["math"]["answers"] == 2 and table["math"]["tokens"] == 5
    assert table["math"]["topk"] == pytest.approx([2 / 5, 1 / 5]) and table["math"]["union_topk"] == pytest.approx(3 / 5)
    assert table["writing"]["topk"] == pytest.approx([1.0, 1.0]) and table["writing"]["union_gain"] == 0


# Two SSMs, one answer of six tokens: A ranks the LLM's tokens 0 and 1 first, B tokens 3 and 4.
#   One level of 1 (a step accepts token t when the drafter ranks it first):
#     A accepts [1,1,0,0,0,0]: steps at 0 (2 tokens), 2, 3, 4, 5 -> 5 steps, τ 6/5
#     B accepts [0,0,0,1,1,0]: steps at 0, 1, 2, 3 (2 tokens), 5 -> 5 steps, τ 6/5
#     merged    [1,1,0,1,1,0]: steps at 0 (2), 2, 3 (2), 5 -> 4 steps, τ 6/4 (+25 %)
#   Two levels of 1 (a chain of two):
#     A accepts [2,1,0,0,0,0]: steps at 0 (3 tokens), 3, 4, 5 -> 4 steps, τ 6/4
#     B accepts [0,0,0,2,1,0]: steps at 0, 1, 2, 3 (3 tokens) -> 4 steps, τ 6/4
#     merged    [2,1,0,2,1,0]: steps at 0 (3), 3 (3) -> 2 steps, τ 3 (+100 %)
TREE_RANKS = [[np.array([0, 0, 9, 9, 9, 9])], [np.array([9, 9, 9, 0, 0, 9])]]


def test_walked_tau_counts_tokens_per_step_over_answers() -> None:
    assert walked_tau([np.array([2, 1, 0, 0, 0, 0])]) == pytest.approx(6 / 4)
    assert walked_tau([np.array([2, 1, 0]), np.array([0, 0])]) == pytest.approx(5 / 3)  # 1 step + 2 steps
    assert walked_tau([]) == 1.0 and walked_tau([np.zeros(0, dtype=np.int64)]) == 1.0


def test_merged_trees_accept_the_longest_path_any_drafter_holds() -> None:
    one = tree_taus(TREE_RANKS, (1,))
    assert one["taus"] == pytest.approx([6 / 5, 6 / 5]) and one["merged"] == pytest.approx(6 / 4)
    assert one["gain_over_best_single"] == pytest.approx(0.25)
    two = tree_taus(TREE_RANKS, (1, 1))
    assert two["taus"] == pytest.approx([6 / 4, 6 / 4]) and two["merged"] == pytest.approx(3.0)
    assert two["gain_over_best_single"] == pytest.approx(1.0)  # coverage adds up along the path
    # NOT_DRAFTABLE is below no width: a token outside a drafter's vocabulary is never accepted
    assert tree_taus([[np.array([NOT_DRAFTABLE, 0])]], (3,))["taus"] == pytest.approx([1.0])


# ------------------------------------------------------------------------------ scripts/coverage.py
def _coverage_script():
    return load_script("coverage")


def test_coverage_script_on_a_run_and_its_bundle(tmp_path, capsys) -> None:
    """The tiny fixtures' two SSMs (noisy copies of the LLM) on four MT-bench questions: a table per
    category, the same figures from the run and from its bundle, and the JSON the table prints."""
    import json

    from bundle_fixtures import make_run_dir
    from conftest import MT_BENCH

    from boosttune.export.bundle import export_bundle

    torch.set_num_threads(1)
    run = make_run_dir(tmp_path / "run", n_ssms=2, scheduler=False)
    bundle = export_bundle(run, tmp_path / "bundle").bundle
    script = _coverage_script()
    figures = {}
    for name, source in (("run", run), ("bundle", bundle)):
        out = tmp_path / f"{name}.json"
        assert script.main([str(source), "--questions", str(MT_BENCH), "--limit", "4", "--max-new-tokens", "8",
                            "--top", "2", "--json", str(out)]) == 0
        text = capsys.readouterr().out
        figures[name] = json.loads(out.read_text())
        table = figures[name]["categories"]
        assert figures[name]["drafters"] == ["ssm-1", "ssm-2"] and figures[name]["k"] == 2
        questions = [json.loads(x) for x in MT_BENCH.read_text().splitlines()[:4]]
        assert set(table) == {"all"} | {q["category"] for q in questions}
        assert table["all"]["answers"] == 4 and table["all"]["tokens"] > 0
        for s in table.values():
            assert max(s["topk"]) <= s["union_topk"] <= 1 and s["union_gain"] >= 0
            assert all(a <= b for a, b in zip(s["top1"], s["topk"], strict=True))
        assert "| all | **union** |" in text and f"{table['all']['union_topk']:.3f}" in text
    assert figures["run"]["categories"] == figures["bundle"]["categories"]
    # --lookup: prompt lookup's one candidate scored too, and counted in the union
    out = tmp_path / "lookup.json"
    assert script.main([str(run), "--questions", str(MT_BENCH), "--limit", "4", "--max-new-tokens", "8",
                        "--top", "2", "--lookup", "--trees", "2", "2,1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    with_lookup = json.loads(out.read_text())
    # --trees: the SSMs alone (prompt lookup has no ranks of a tree), merged at least as good as either
    assert list(with_lookup["trees"]) == ["2", "2,1"] and "| 2,1 |" in text
    for t in with_lookup["trees"].values():
        assert len(t["taus"]) == 2 and min(t["taus"]) >= 1 and t["merged"] >= max(t["taus"])
    with pytest.raises(SystemExit):
        script.main([str(run), "--questions", str(MT_BENCH), "--trees", "0,1"])
    assert with_lookup["drafters"] == ["ssm-1", "ssm-2", "prompt-lookup"]
    both, alone = with_lookup["categories"]["all"], figures["run"]["categories"]["all"]
    assert both["topk"][:2] == alone["topk"] and both["union_topk"] >= alone["union_topk"]
    assert both["topk"][2] == both["top1"][2]  # one candidate: top-1 is top-2


def test_coverage_script_reads_answers_from_a_bench_output(tmp_path, capsys) -> None:
    import json

    from bundle_fixtures import make_run_dir
    from conftest import MT_BENCH

    torch.set_num_threads(1)
    run = make_run_dir(tmp_path / "run", n_ssms=1, scheduler=False, ranking=False)
    questions = [json.loads(x) for x in MT_BENCH.read_text().splitlines()[:2]]
    answers = tmp_path / "ours.jsonl"
    answers.write_text("".join(json.dumps({"question_id": q["question_id"], "choices": [{"turns": ["Paris is nice."]}]})
                               + "\n" for q in questions))
    script = _coverage_script()
    out = tmp_path / "c.json"
    assert script.main([str(run), "--questions", str(MT_BENCH), "--limit", "2", "--answers", str(answers),
                        "--json", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["k"] == 1  # the run's tree's first width (bundle_fixtures.TREE)
    n = len(script.load_drafters(run, None)[0].tokenizer("Paris is nice.", add_special_tokens=False)["input_ids"])
    assert table["categories"]["all"]["tokens"] == 2 * n
    capsys.readouterr()


# --------------------------------------------------------------------------- scripts/ablate_heads.py
def test_ablation_variants_share_the_run_but_not_its_heads_or_scheduler(tmp_path) -> None:
    """A variant is the run's hard-linked copy without its feature heads, scheduler and report (it trains
    and writes its own); its budget is per head, the longer single head's N times that."""
    import json

    script = load_script("ablate_heads")
    src = tmp_path / "run"
    for rel in ("config.yaml", "report.json", "teacher/shard-00000.arrow", "ssms/ssm-1/model.safetensors",
                "ssms/feature/model.safetensors", "ssms/feature-2/model.safetensors", "scheduler/scheduler.json",
                "scheduler_costs.json", "stages/stage-1/summary.json"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    script.link_copy(src, tmp_path / "v")
    kept = sorted(str(p.relative_to(tmp_path / "v")) for p in (tmp_path / "v").rglob("*") if p.is_file())
    assert kept == ["config.yaml", "ssms/ssm-1/model.safetensors", "stages/stage-1/summary.json", "teacher/shard-00000.arrow"]
    assert (tmp_path / "v" / "teacher" / "shard-00000.arrow").stat().st_ino == (src / "teacher" / "shard-00000.arrow").stat().st_ino
    assert script.budget(2.5, 0, 2) == ["feature.minutes=5.0", "feature.max_steps=0"]
    assert script.budget(0, 200, 2) == ["feature.minutes=0", "feature.max_steps=400"]
    (src / "ssms" / "feature" / "complete.json").write_text("{}")
    (src / "ssms" / "feature" / "stats.json").write_text(json.dumps({"config": {"minutes": 5.0, "max_steps": 0},
                                                                     "train": {"steps": 400}}))
    assert script.reusable_single(src, 5.0, 0) and script.reusable_single(src, 0, 400)
    assert not script.reusable_single(src, 2.5, 0) and not script.reusable_single(src, 0, 200)


# --------------------------------------------------------------------------- scripts/ablate_kinds.py
def test_routing_by_category_takes_each_categorys_head_weighted_by_its_positions() -> None:
    """Coding's 30 positions go to the coding head (top-k 0.8), math's 10 to ``all`` (no math head); so
    (30 * 0.8 + 10 * 0.5) / 40, against ``all``'s (30 * 0.6 + 10 * 0.5) / 40."""
    script = load_script("ablate_kinds")
    assert script.parse_route("coding=coding, stem=qa") == {"coding": "coding", "stem": "qa"}
    with pytest.raises(ValueError, match="CATEGORY=KIND"):
        script.parse_route("coding")

    def fig(coding: float, math: float) -> dict:
        return {"all": {"tokens": 40, "topk": [0.0]}, "coding": {"tokens": 30, "topk": [coding]},
                "math": {"tokens": 10, "topk": [math]}}

    tables = {"all": fig(0.6, 0.5), "kind:coding": fig(0.8, 0.1)}
    assert script.routed_topk(tables, {"coding": "coding", "math": "math"}, "all") == pytest.approx(29 / 40)
    assert script.routed_topk(tables, {}, "all") == pytest.approx(23 / 40)
    # in hindsight each category takes the better of its routed head and ``all``: coding the math head's 0.9,
    # math ``all``'s 0.5 (its own head covers 0.1)
    assert script.routed_topk({**tables, "kind:math": fig(0.9, 0.1)}, {"coding": "math", "math": "math"}, "all",
                              hindsight=True) == pytest.approx((30 * 0.9 + 10 * 0.5) / 40)
    assert script.routed_topk(tables, {"coding": "coding"}, "all", hindsight=True) == pytest.approx(29 / 40)


# --------------------------------------------------------------------------- scripts/ablate_ssms.py
def test_ssm_ablation_links_stage_one_only_where_its_record_does_not_steer_the_pool(tmp_path) -> None:
    """Stage 1 trains on every sample with one seed in every mode, but what it leaves is stage 2's pool in
    match and quantile modes: a variant links the source's stage 1 (not its checkpoints) only where that
    record is unused or was made in the variant's own mode."""
    script = load_script("ablate_ssms")
    assert script.keeps_stage_one("weighted", "match") and script.keeps_stage_one("independent", "quantile")
    assert script.keeps_stage_one("match", "match") and script.keeps_stage_one("quantile", "quantile")
    assert not script.keeps_stage_one("quantile", "match") and not script.keeps_stage_one("match", "weighted")
    src = tmp_path / "run"
    for rel in ("ssm-init/model.safetensors", "stages/stage-1/match.json", "stages/stage-1/checkpoints/last.ckpt",
                "stages/stage-2/match.json", "ssms/ssm-1/model.safetensors", "ssms/ssm-2/model.safetensors",
                "ssms/feature/model.safetensors", "teacher/shard-00000.arrow"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    script.link_stage_one(src, tmp_path / "v")
    kept = sorted(str(p.relative_to(tmp_path / "v")) for p in (tmp_path / "v").rglob("*") if p.is_file())
    assert kept == ["ssm-init/model.safetensors", "ssms/ssm-1/model.safetensors", "stages/stage-1/match.json"]
    assert (tmp_path / "v" / "ssms" / "ssm-1" / "model.safetensors").stat().st_ino == \
        (src / "ssms" / "ssm-1" / "model.safetensors").stat().st_ino


def test_ssm_ablation_gains_compare_each_boosted_union_with_both_baselines() -> None:
    """Relative union coverage: over the independent ensemble, over one SSM trained N x as long, over the
    variant's own best SSM; the baselines get no row of gains."""
    script = load_script("ablate_ssms")
    rows = [{"variant": "match", "coverage": [0.40, 0.30], "union_coverage": 0.48, "eval_tau": 1.43},
            {"variant": "independent", "coverage": [0.40, 0.41], "union_coverage": 0.45, "eval_tau": 1.40},
            {"variant": "single", "coverage": [0.42], "union_coverage": 0.42, "union_same_candidates": 0.50,
             "eval_tau": 1.46}]
    g = script.gains_of(rows)
    assert list(g) == ["match"]
    assert g["match"]["ensemble_gain_over_independent"] == pytest.approx(0.48 / 0.45 - 1)
    assert g["match"]["ensemble_gain_over_longer_single"] == pytest.approx(0.48 / 0.42 - 1)
    assert g["match"]["ensemble_gain_over_best_single_questions"] == pytest.approx(0.48 / 0.40 - 1)
    # the fair ones: the single SSM with as many candidates as the union, and the runs' merged τ
    assert g["match"]["ensemble_gain_over_longer_single_same_candidates"] == pytest.approx(0.48 / 0.50 - 1)
    assert g["match"]["tau_gain_over_independent"] == pytest.approx(1.43 / 1.40 - 1)
    assert g["match"]["tau_gain_over_longer_single"] == pytest.approx(1.43 / 1.46 - 1)
    rows[0].pop("eval_tau")  # a run without its evaluation: no τ gains, the coverage ones stay
    assert "tau_gain_over_independent" not in script.gains_of(rows)["match"]


def test_coverage_script_scores_a_runs_eagle3_head(tmp_path, capsys) -> None:
    """A run with an EAGLE-3 head (here untrained, from the tiny LLM's layers): the table gains an
    ``eagle3`` row beside the SSMs."""
    import json

    from bundle_fixtures import make_run_dir
    from conftest import MT_BENCH

    from boosttune.core.eagle3_head import Eagle3Spec
    from boosttune.core.files import mark_complete
    from boosttune.core.models import load_model
    from boosttune.core.rundir import RunDir
    from boosttune.train.eagle3 import init_head

    torch.set_num_threads(1)
    run = make_run_dir(tmp_path / "run", n_ssms=1, scheduler=False)
    llm = load_model(json.loads((run / "report.json").read_text())["llm"]["ref"])
    n = llm.model.config.num_hidden_layers
    spec = Eagle3Spec.from_llm(llm.model.config, 32, (0, n - 1, n - 1))
    init_head(llm.model, spec, torch.arange(32)).save(RunDir(run).eagle3_dir)
    mark_complete(RunDir(run).eagle3_dir)
    out = tmp_path / "cov.json"
    assert _coverage_script().main([str(run), "--questions", str(MT_BENCH), "--limit", "2", "--max-new-tokens", "8",
                                    "--top", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["drafters"] == ["ssm-1", "eagle3"]
    s = figures["categories"]["all"]
    assert 0 <= s["top1"][1] <= s["topk"][1] <= s["union_topk"] <= 1
    assert "| all | eagle3 |" in capsys.readouterr().out


def test_coverage_script_refuses_trees_without_ssms_before_the_llm_answers(tmp_path, capsys, monkeypatch) -> None:
    """A run whose only drafter is a feature head: ``--trees`` (SSMs only) stops with a usage error
    naming the run, before any answer is written; without ``--trees`` the head is scored."""
    import json

    from bundle_fixtures import make_run_dir
    from conftest import MT_BENCH

    from boosttune.core.feature_head import save_head
    from boosttune.core.files import mark_complete
    from boosttune.core.models import load_model
    from boosttune.core.rundir import RunDir
    from boosttune.train.feature import build_head

    torch.set_num_threads(1)
    run = make_run_dir(tmp_path / "run", n_ssms=0, scheduler=False)
    llm = load_model(json.loads((run / "report.json").read_text())["llm"]["ref"])
    head_dir = RunDir(run).feature_dir
    save_head(build_head(llm.model, [-1]), head_dir)
    llm.tokenizer.save_pretrained(head_dir)
    mark_complete(head_dir)
    script = _coverage_script()
    writes = script.llm_answers

    def no_answers(*args, **kwargs):
        raise AssertionError("the LLM wrote answers before the refusal")

    monkeypatch.setattr(script, "llm_answers", no_answers)
    with pytest.raises(SystemExit) as stop:
        script.main([str(run), "--questions", str(MT_BENCH), "--limit", "2", "--trees", "2"])
    assert stop.value.code == 2
    assert "has no SSM" in capsys.readouterr().err
    monkeypatch.setattr(script, "llm_answers", writes)
    out = tmp_path / "cov.json"
    assert script.main([str(run), "--questions", str(MT_BENCH), "--limit", "2", "--max-new-tokens", "8",
                        "--top", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["drafters"] == ["feature"]
