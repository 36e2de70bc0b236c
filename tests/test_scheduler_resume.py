"""A scheduler fit interrupted after its costs were measured: the resumed fit reuses that cost table, so
it chooses as the interrupted one would have, and its report says the costs were reused."""

from __future__ import annotations

import json

import pytest
from conftest import MT_BENCH, perturbed

from boosttune.config import SchedulerConfig
from boosttune.core.files import atomic_write_json, mark_complete
from boosttune.core.models import load_model
from boosttune.scheduler.offline import train as offline

pytestmark = pytest.mark.skipif(not MT_BENCH.is_file(), reason="needs ../shared/data/mt_bench")


@pytest.fixture
def run_dir(tmp_path):
    """report.json and one complete SSM, a perturbed copy of the tiny random LLM."""
    llm = load_model("tiny-random")
    d = tmp_path / "ssms" / "ssm-1"
    perturbed(llm.model, 1, 0.05).save_pretrained(d)
    llm.tokenizer.save_pretrained(d)
    mark_complete(d)
    atomic_write_json(tmp_path / "report.json", {
        "format": 1, "llm": {"ref": "tiny-random", "path": llm.path, "dtype": "fp32"},
        "tree": {"kind": "expansion", "widths": [1, 1]}, "stages": [{"stage": 1, "ssm_dir": "ssms/ssm-1"}]})
    return tmp_path


def test_a_resumed_scheduler_fit_keeps_the_first_cost_table(run_dir, monkeypatch):
    cfg = SchedulerConfig(prompts=str(MT_BENCH), limit=4, train_fraction=0.75, max_new_tokens=4, depths=(1, 2), calib_prompts=1,
                          calib_tokens=4, real_policies=("learned",), prompt_lookup=False, draft_vocab=0, cv_folds=0)
    measured = []
    real_calibrate = offline.calibrate

    def calibrate(*args, **kwargs):
        measured.append(real_calibrate(*args, **kwargs))
        return measured[-1]

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the run stops after the scheduler was fitted, before its evaluation

    monkeypatch.setattr(offline, "calibrate", calibrate)
    monkeypatch.setattr(offline, "real_policies", killed)
    with pytest.raises(KeyboardInterrupt):
        offline.train_scheduler(run_dir, cfg, log=lambda s: None)
    first = json.loads((run_dir / "scheduler" / "scheduler.json").read_text())["body"]  # what the first fit chose with
    assert len(measured) == 1 and not (run_dir / "scheduler" / "complete.json").exists()

    monkeypatch.undo()
    monkeypatch.setattr(offline, "calibrate", lambda *a, **k: pytest.fail("costs measured again"))
    report = offline.train_scheduler(run_dir, cfg, log=lambda s: None)
    assert report["costs"] == {"file": "scheduler_costs.json", "reused": True}
    again = json.loads((run_dir / "scheduler" / "scheduler.json").read_text())["body"]
    first["meta"].pop("created"), again["meta"].pop("created")
    assert again == first  # the same costs and labels: the same fitted scheduler, the same choices
    assert report["cost_model"] == {k: v for k, v in measured[0].to_json().items() if k != "type"}

    # a table measured for other settings (or with other threads) is not used
    run = offline.RunDir(run_dir)
    key = json.loads((run_dir / "scheduler_costs.json").read_text())["key"]
    assert offline.saved_costs(run, key) is not None
    assert offline.saved_costs(run, {**key, "threads": key["threads"] + 1}) is None
    assert offline.saved_costs(run, {**key, "widths": [3]}) is None
