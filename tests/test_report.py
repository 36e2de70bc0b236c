"""boosttune/report.py on reports of every age: keys that newer runs add, and older runs lack, are optional.

The runs themselves are in tests/test_train_pipeline.py (a finished, an interrupted, a feature-heads and a
scheduler run); here the report mappings are written out, to cover the shapes no current run writes.
"""

from __future__ import annotations

from pathlib import Path

from boosttune.core.rundir import RunDir
from boosttune.report import RunState, drafter_rows, summary_lines

LOOKUP = {"prompt_lookup": 8, "tau": 1.9, "speedup": 1.4}


def state(report: dict, pending: tuple[str, ...] | None = ()) -> RunState:
    return RunState(RunDir(Path("/runs/r")), {"stages": [], **report}, None, pending)


def test_feature_heads_and_their_merged_tree_are_drafters() -> None:
    evaluation = {"singles": [{"ssm": "ssm-1", "tau": 1.5, "c": 0.1, "speedup": 1.2, "lookup": LOOKUP}],
                  "feature": {"tau": 1.6}, "ensemble": None,
                  "feature_heads": [{"drafter": "feature", "tau": 1.6, "speedup": 1.3, "lookup": LOOKUP},
                                    {"drafter": "feature-2", "tau": 1.4, "speedup": 1.1}],
                  "feature_ensemble": {"tau": 1.8, "speedup": 1.25, "drafters": ["feature", "feature-2"]}}
    rows = drafter_rows(evaluation)
    assert [r.name for r in rows] == ["ssm-1", "feature", "feature-2", "heads merged"]  # the heads replace `feature`
    assert (rows[0].lookup_tau, rows[2].lookup_speedup, rows[3].c) == (1.9, None, None)
    lines = summary_lines(state({"evaluation": evaluation, "feature": {
        "heads": [{"head": "feature", "steps": 5, "held_out_top1": 0.3}, {"head": "feature-2", "steps": 5}],
        "coverage_k": 2, "union_coverage": 0.41}}))
    assert "feature heads: feature 5 steps, held-out top-1 0.300; feature-2 5 steps, held-out top-1 -; " \
           "union top-2 coverage 0.410" in lines
    assert next(x for x in lines if x.startswith("heads merged")).split() == ["heads", "merged", "1.80", "-", "1.25x",
                                                                            "-", "-"]


def test_an_old_report_without_the_newer_keys_reads() -> None:
    """No evaluation, no coverage fields, no speed-ups, a tree this version does not know, no config."""
    old = {"llm": {"ref": "default", "dtype": "fp32"}, "tree": {"kind": "expansion", "widths": [3], "unknown": 1},
           "prompts": {"count": 10, "train": 9, "held_out": 1}, "teacher": {},
           "stages": [{"stage": 1, "pool_before": 9, "pool_after": 2, "match_rate": 0.7}], "evaluation": None}
    lines = summary_lines(state(old, pending=None))
    assert lines[0] == "run /runs/r (state unknown: its config.yaml does not load)"
    assert lines[1] == "LLM default (fp32); each drafter's tree ?"
    assert lines[5].split() == ["1", "9", "->", "2", "0.700", "-", "-", "-", "-", "-", "-"]
    assert "evaluation: not run yet" in lines and "  export: boosttune export /runs/r --out /runs/r-bundle" in lines
    off = summary_lines(state({**old, "tree": {"kind": "expansion", "widths": [3]}}, pending=()))
    assert "evaluation: none (eval.enabled is off)" in off and off[1].endswith("tree 3")


def test_the_eagle3_head_has_its_line() -> None:
    e3 = {"layers": [2, 15, 29], "train": {"steps": 250}, "held_out": {"depth": 3, "tau": 1.837, "accept_rate": [0.489, 0.2]}}
    lines = summary_lines(state({"eagle3": e3}))
    assert ("EAGLE-3 head: LLM layers 2, 15, 29, 250 steps, held-out chains of 3: τ 1.837, first draft right 0.489 "
            "(export --format gguf / hf for llama.cpp, vLLM, SGLang)") in lines
    assert not any(x.startswith("EAGLE-3") for x in summary_lines(state({})))
