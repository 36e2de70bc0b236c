"""A run killed at any kill point (boosttune.train.faults.POINTS) and run again ends exactly where a run
that was never interrupted ends: the same SSM weights bit for bit, the same pools and match rates.

One uninterrupted reference run per module; every case kills a run of the same settings once
(SIGKILL, through the real command line) and finishes it with a second run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_train_pipeline import ok, train

from boosttune.core.rundir import RunDir
from boosttune.train.faults import POINTS

SETTINGS = ("boost.num_ssms=2", "eval.enabled=false")
# What a resumed run must reproduce (timings, and the step a stage resumed from, may differ).
SAME = ("stage", "pool_before", "pool_after", "match_rate", "heldout_match_rate", "ensemble_match_rate",
        "heldout_top1", "heldout_mean_prefix", "train_top1", "acceptance_profile", "steps", "train_samples",
        "train_tokens", "train_loss")
# (kill point, extra overrides): configs/tiny.yaml trains 12 steps a stage, 4 batches a pass over
# the data, a checkpoint every 4 steps.
CASES = {
    "teacher-shard-tmp:2": (),
    "teacher-shard:2": (),
    "checkpoint:1": (),                          # stage 1's first checkpoint: the end of a pass
    "checkpoint:5": (),                          # stage 2's second: a later stage, its pool from stage 1
    "checkpoint:1 every 3": ("optim.checkpoint_every=3",),  # in the middle of a pass
    "ssm-saved:1": (),                           # resumed from the final checkpoint: no step left
}


def results(run: Path) -> dict:
    """Everything a resumed run must reproduce: weights, pools and match flags, the report's numbers."""
    r = RunDir(run)
    stages = json.loads(r.report_path.read_text())["stages"]
    return {
        "weights": [hashlib.sha256((run / s["ssm_dir"] / "model.safetensors").read_bytes()).hexdigest()
                    for s in stages],
        "matches": [json.loads(r.stage_match(s["stage"]).read_text()) for s in stages],
        "stages": [{k: s.get(k) for k in SAME} for s in stages],
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    run = tmp_path_factory.mktemp("reference") / "run"
    ok(train(run, *SETTINGS))
    return results(run)


def test_every_kill_point_is_tested() -> None:
    assert {case.split(":")[0] for case in CASES} == set(POINTS)


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_ends_as_the_uninterrupted_one(case: str, reference: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    kill_at, extra = case.split()[0], CASES[case]
    assert train(run, *SETTINGS, *extra, kill_at=kill_at).returncode == -9
    ok(train(run, *SETTINGS, *extra))
    got = results(run)
    assert got["stages"] == reference["stages"]
    assert got["matches"] == reference["matches"]
    assert got["weights"] == reference["weights"]


def test_resumed_run_with_dropout_ends_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """Dropout draws from the global RNG: the checkpoint carries its state."""
    settings = ("boost.num_ssms=1", "eval.enabled=false", "lora.enabled=true", "lora.r=4", "lora.dropout=0.2")
    ok(train(tmp_path / "reference", *settings))
    run = tmp_path / "run"
    assert train(run, *settings, kill_at="checkpoint:1").returncode == -9
    ok(train(run, *settings))
    assert results(run) == results(tmp_path / "reference")
