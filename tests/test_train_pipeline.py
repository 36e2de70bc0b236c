"""`boosttune train` end to end on configs/tiny.yaml: report, resumption after kill -9, 2-process DDP.

Runs go through the real command line in subprocesses (Lightning, torchrun and SIGKILL behave as
they do for users). Crashes are injected at named points with BOOSTTUNE_KILL_AT (boosttune.train.faults):
the process SIGKILLs itself, exactly like an external kill -9 at that moment.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import MT_BENCH, load_script

from boosttune.config import load_config
from boosttune.core.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
FAST = ["eval.limit=2", "eval.max_new_tokens=8"]


# `python -c COUNTING LOADS_JSON argv...` is `boosttune argv...` that writes the references it passed to
# load_model to LOADS_JSON at exit: the loader is wrapped before any module that calls it is imported, so
# every module's `from boosttune.core.models import load_model` binds the wrapper.
COUNTING = """
import atexit, json, sys
from pathlib import Path
from boosttune.core import models
refs, real = [], models.load_model
def load_model(ref, *args, **kwargs):
    refs.append(str(ref))
    return real(ref, *args, **kwargs)
models.load_model = load_model
atexit.register(lambda: Path(sys.argv[1]).write_text(json.dumps(refs)))
from boosttune.cli import main
sys.exit(main(sys.argv[2:]))
"""

# `python -c READ_ONLY RUN_DIR argv...` is `boosttune argv...` with RUN_DIR as on a read-only mount, also for
# root (whom chmod does not stop): an audit hook refuses, with EROFS, every open for writing, rename, removal,
# mode or time change and directory creation under RUN_DIR (creating one that exists fails with EEXIST, as
# there), so any write the command attempts fails, whether or not it would have changed a file.
READ_ONLY = """
import errno, os, sys
ROOT = os.path.realpath(sys.argv[1])
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def inside(path):
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    real = os.path.realpath(os.fsdecode(path))
    return real == ROOT or real.startswith(ROOT + os.sep)
def refuse(path):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
def hook(event, args):
    if event == "open" and isinstance(args[2], int) and args[2] & WRITE and inside(args[0]):
        refuse(args[0])
    elif event == "os.mkdir" and inside(args[0]) and not os.path.exists(args[0]):
        refuse(args[0])
    elif event in ("os.rename", "os.link", "os.symlink") and (inside(args[0]) or inside(args[1])):
        refuse(args[1])
    elif event in ("os.remove", "os.rmdir", "os.chmod", "os.chown", "os.utime", "os.truncate") and inside(args[0]):
        refuse(args[0])
sys.addaudithook(hook)
from boosttune.cli import main
sys.exit(main(sys.argv[2:]))
"""


def train(run: Path, *overrides: str, kill_at: str | None = None, timeout: int = 300,
          loads: Path | None = None, read_only: bool = False) -> subprocess.CompletedProcess:
    """`boosttune train` of configs/tiny.yaml in ``run``; ``loads``: a file that receives the references of
    every model it loads (:data:`COUNTING`); ``read_only``: ``run`` as on a read-only mount (:data:`READ_ONLY`)."""
    # One torch thread per process: tiny models gain nothing from two, and two threads stall badly
    # whenever the other core is busy (seen here: 10-60x slower steps).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env.pop("BOOSTTUNE_KILL_AT", None)
    if kill_at:
        env["BOOSTTUNE_KILL_AT"] = kill_at
    assert loads is None or not read_only
    cli = ["-c", READ_ONLY, str(run)] if read_only else ["-m", "boosttune.cli"] if loads is None \
        else ["-c", COUNTING, str(loads)]
    cmd = [sys.executable, *cli, "train", "--config", str(TINY), "--run-dir", str(run), *FAST, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("tiny") / "run"
    proc = train(run)
    ok(proc)
    (run.parent / "stderr.txt").write_text(proc.stderr)
    (run.parent / "stdout.txt").write_text(proc.stdout)
    return run


def test_progress_is_plain_lines_when_output_is_not_a_terminal(tiny_run: Path) -> None:
    """Cluster jobs write to files, where tqdm hides its bars: each phase still reports its figures."""
    lines = (tiny_run.parent / "stderr.txt").read_text().splitlines()
    teacher = [x for x in lines if x.startswith("[boosttune] teacher[rank 0, batched]: ")]
    assert teacher and "(done)" in teacher[-1] and "tok_s=" in teacher[-1], lines[-20:]
    n = json.loads((tiny_run / "prompts" / "complete.json").read_text())["count"]
    assert f": {n}/{n} prompt (100%)" in teacher[-1]


def test_report_has_one_entry_per_stage(tiny_run: Path) -> None:
    report = json.loads((tiny_run / "report.json").read_text())
    assert report["format"] == 1 and report["llm"]["ref"] == "tiny-random"
    stages = report["stages"]
    assert [s["stage"] for s in stages] == [1, 2, 3]
    for s in stages:
        for key in ("pool_before", "pool_after", "match_rate", "ensemble_match_rate", "train_loss", "stage_seconds",
                    "train_tokens_per_s", "heldout_top1", "acceptance_profile"):
            assert s[key] is not None, key
        assert s["pool_after"] <= s["pool_before"]
        assert (tiny_run / s["ssm_dir"] / "complete.json").is_file()
        assert (tiny_run / s["ssm_dir"] / "model.safetensors").is_file()
    # boost-tuning: stage 2 trains on what stage 1 left unmatched (on everything when too little is left)
    run = RunDir(tiny_run)
    first, second = (json.loads(run.stage_match(k).read_text()) for k in (1, 2))
    assert first["pool_after"] == [i for i in first["pool"] if not first["train_matched"][i]]
    if len(first["pool_after"]) >= load_config(TINY).boost.min_pool:
        assert second["pool"] == first["pool_after"] and not any(first["train_matched"][i] for i in second["pool"])
    else:
        assert second["pool"] == first["pool"]
    assert stages[1]["pool_before"] == len(second["pool"])
    # the ensemble never matches fewer held-out samples than any stage alone
    for k, s in enumerate(stages):
        assert s["ensemble_match_rate"] >= max(t["heldout_match_rate"] for t in stages[: k + 1]) - 1e-9
    check_coverage(stages)
    ev = report["evaluation"]
    assert [x["ssm"] for x in ev["singles"]] == ["ssm-1", "ssm-2", "ssm-3"]
    assert ev["ensemble"]["tau"] >= 1.0 and ev["prompts"] == 2
    assert report["teacher"]["samples"] == 60 and report["teacher"]["tokens"] > 0
    assert report["teacher"]["dtypes"] == ["fp32"]  # configs/tiny.yaml: teacher_dtype fp32, recorded as used
    assert (tiny_run / "config.yaml").is_file()
    assert (tiny_run / "stages" / "stage-1" / "logs" / "version_0" / "metrics.csv").is_file()
    # The draft vocabulary ranking counts the teacher's tokens on the training prompts only.
    ranking = json.loads((tiny_run / "draft_vocab.json").read_text())
    assert ranking["vocab_size"] == len(ranking["ranking"]) == len(set(ranking["ranking"]))
    assert report["prompts"]["held_out"] > 0 and 0 < ranking["tokens_counted"] < report["teacher"]["tokens"]


def test_train_ends_with_the_runs_report(tiny_run: Path) -> None:
    """`boosttune train` ends with what `boosttune report RUN` prints: stages, each drafter's τ / c / speed-up
    alone, with prompt lookup and merged, and the next commands with the run's paths."""
    from boosttune.report import collect, summary_lines

    out = (tiny_run.parent / "stdout.txt").read_text().splitlines()
    lines = summary_lines(collect(RunDir(tiny_run)))
    assert out[-len(lines):] == lines
    assert lines[0] == f"run {tiny_run} (finished)"
    header = next(x for x in lines if x.startswith("drafter "))
    assert header.split() == ["drafter", "τ", "c", "speed-up", "τ", "with", "lookup", "speed-up", "with", "lookup"]
    assert drafters(lines) == ["ssm-1", "ssm-2", "ssm-3", "SSMs merged"]
    assert f"  export: boosttune export {tiny_run} --out {tiny_run}-bundle" in lines
    assert f"  serve:  boosttune serve {tiny_run}-bundle --port 8000" in lines
    stderr = (tiny_run.parent / "stderr.txt").read_text()
    for noise in ("💡 Tip", "weights_only", "LeafSpec", "Epoch 0/"):  # Lightning's, silenced
        assert noise not in stderr + "\n".join(out)
    assert "[boosttune] stage 1: 12/12 step (100%)" in stderr  # our progress line instead of Lightning's bar


def drafters(lines: list[str]) -> list[str]:
    """The first column of the summary's table of drafters."""
    start = next(i for i, x in enumerate(lines) if x.startswith("drafter ")) + 2  # past the header and its rule
    rows = lines[start:]
    return [x.split("  ")[0] for x in rows[:next(i for i, x in enumerate(rows) if not x[:1].strip() or ":" in x)]]


def _report(run: Path, capsys) -> list[str]:
    """`boosttune report RUN`'s lines; the figure must be a PNG."""
    from boosttune.cli import main

    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    png = (run / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    return capsys.readouterr().out.splitlines()


def test_report_of_a_finished_and_of_an_interrupted_run(tiny_run: Path, tmp_path: Path, capsys) -> None:
    weights = shutil.ignore_patterns("*.safetensors", "checkpoints", "ssm-init")  # the report reads none of them
    run = Path(shutil.copytree(tiny_run, tmp_path / "run", ignore=weights))
    lines = _report(run, capsys)
    assert lines[0] == f"run {run} (finished)" and lines[-1] == f"figure: {run / 'report.png'}"
    assert any(x.startswith("3 ") and "-> " in x for x in lines)  # stage 3's row

    # killed during stage 3, before its report was written: what exists is reported, with the way to go on
    shutil.rmtree(run / "stages" / "stage-3")
    shutil.rmtree(run / "ssms" / "ssm-3")
    (run / "report.json").unlink()
    (run / "report.png").unlink()
    lines = _report(run, capsys)
    assert lines[0] == f"run {run} (unfinished: stage 3, the evaluation to go)"
    assert [x.split()[0] for x in lines if x[:2] in ("1 ", "2 ", "3 ")] == ["1", "2"]  # the two finished stages
    assert "prompts: 60 (48 train, 12 held out)" in lines[2] and "evaluation: not run yet" in lines
    assert f"  resume: boosttune train --config {run / 'config.yaml'} --run-dir {run}" in lines


def test_report_of_a_directory_that_is_not_a_run(tmp_path: Path, capsys) -> None:
    from boosttune.cli import main

    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a `boosttune train` run directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "report.png").exists()


def check_coverage(stages: list[dict]) -> None:
    """Each stage's held-out coverage: its own SSM's, every SSM's so far, their union (never below any one,
    never shrinking as SSMs join)."""
    for k, s in enumerate(stages):
        assert s["coverage_k"] >= 1 and len(s["ssm_coverages"]) == k + 1
        assert s["ssm_coverages"] == [t["heldout_coverage"] for t in stages[: k + 1]]
        assert 0 <= max(s["ssm_coverages"]) <= s["union_coverage"] <= 1
        assert s["union_gain_over_best_single"] == pytest.approx(s["union_coverage"] - max(s["ssm_coverages"]))
        assert k == 0 or s["union_coverage"] >= stages[k - 1]["union_coverage"]


def mtimes(path: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in path.rglob("*")}


def test_rerun_of_a_finished_run_redoes_nothing(tiny_run: Path) -> None:
    """Not a file of the run is written again: not config.yaml, not report.json (the τ evaluation is
    not re-run for the same settings); no write is even attempted, so a finished run re-runs on a
    read-only mount."""
    before = mtimes(tiny_run)
    ok(train(tiny_run, read_only=True))
    assert mtimes(tiny_run) == before


def test_the_read_only_check_refuses_writes(tiny_run: Path, tmp_path: Path) -> None:
    """The read-only stand-in of the test above can fail: a run missing its config must write it (first)."""
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    (run / "config.yaml").unlink()
    one_line_error(train(run, read_only=True), f"cannot write {run / 'config.yaml'}: Read-only file system")


def test_rerun_with_other_evaluation_settings_reevaluates(tiny_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    ssms = mtimes(run / "ssms")
    ok(train(run, "eval.max_new_tokens=6"))
    assert json.loads((run / "report.json").read_text())["evaluation"]["max_new_tokens"] == 6
    assert load_config(run / "config.yaml").eval.max_new_tokens == 6 and mtimes(run / "ssms") == ssms


def _chmod_restricts() -> bool:
    """Whether a directory without write permission refuses this process (not for root, or for a
    process with CAP_DAC_OVERRIDE)."""
    with tempfile.TemporaryDirectory() as d:
        locked = Path(d) / "locked"
        locked.mkdir(mode=0o555)
        try:
            (locked / "probe").touch()
        except PermissionError:
            return True
        finally:
            locked.chmod(0o755)
        return False


needs_chmod = pytest.mark.skipif(not _chmod_restricts(), reason="chmod does not restrict this user (root)")


def test_run_killed_before_its_report_listed_the_last_stage_evaluates_every_ssm(tiny_run: Path, tmp_path: Path) -> None:
    """Every stage finished (summary.json written) but the report not yet written: the rerun trains
    nothing, and the evaluation (handed the stages by the boost-tuning phase) still sees every SSM."""
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    report = json.loads((run / "report.json").read_text())
    report["stages"], report["evaluation"] = report["stages"][:2], None
    (run / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    ok(train(run))
    report = json.loads((run / "report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == [1, 2, 3]
    assert [x["ssm"] for x in report["evaluation"]["singles"]] == ["ssm-1", "ssm-2", "ssm-3"]


@needs_chmod
def test_finished_run_reopens_read_only(tiny_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    paths = [run, *run.rglob("*")]
    for p in paths:
        p.chmod(p.stat().st_mode & ~0o222)
    try:
        ok(train(run))
    finally:
        for p in paths:
            p.chmod(p.stat().st_mode | 0o200)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode not in (0, -9), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("boosttune train: error: ") and all(n in last for n in needles), last


@needs_chmod
@pytest.mark.parametrize("where", ["read-only run dir", "unwritable parent"])
def test_unwritable_run_dir_is_one_clear_line(tmp_path: Path, where: str) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    run = locked if where == "read-only run dir" else locked / "run"
    locked.chmod(0o555)
    try:
        one_line_error(train(run), str(locked), "--run-dir")
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_file_system_errors_are_one_clear_line(tmp_path: Path, monkeypatch, capsys, code: int) -> None:
    """A write that fails (disk full simulated at the first write, config.yaml) names the file and the fix."""
    from boosttune.cli import main
    from boosttune.train import pipeline

    def fail(path: Path, text: str) -> None:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(pipeline, "atomic_write_text", fail)
    run = tmp_path / "run"
    assert main(["train", "--config", str(TINY), "--run-dir", str(run)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run / "config.yaml") in err[0] and "--run-dir" in err[0], err


def test_independent_ablation_reuses_the_teacher(tiny_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "ablation"
    ok(train(run, f"teacher.reuse_from={tiny_run}", "boost.mode=independent", "boost.num_ssms=2", "eval.enabled=false"))
    shard = "shard-00000.arrow"
    assert (run / "teacher" / shard).stat().st_ino == (tiny_run / "teacher" / shard).stat().st_ino  # linked, not redone
    stages = json.loads((run / "report.json").read_text())["stages"]
    assert [s["pool_before"] for s in stages] == [48, 48] and all(s["mode"] == "independent" for s in stages)
    bad = train(tmp_path / "other", f"teacher.reuse_from={tiny_run}", "teacher.max_new_tokens=5")
    assert bad.returncode == 2 and "teacher.max_new_tokens=24" in bad.stderr


def test_stages_finished_before_coverage_gain_it_on_resume(tiny_run: Path, tmp_path: Path) -> None:
    """A run whose stages lack the coverage fields and the cached ranks (one from before they existed, its
    config saying ``mode: boost``) gets them, recomputed from its saved SSMs: the same figures."""
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    want = json.loads((run / "report.json").read_text())["stages"]
    keys = ("coverage_k", "heldout_coverage", "ssm_coverages", "union_coverage", "union_gain_over_best_single")
    for k in (1, 2, 3):
        for f in RunDir(run).stage_dir(k).glob("ranks-*.json"):
            f.unlink()
        path = RunDir(run).stage_summary(k)
        path.write_text(json.dumps({x: v for x, v in json.loads(path.read_text()).items() if x not in keys}))
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("mode: match", "mode: boost"))
    ok(train(run))
    got = json.loads((run / "report.json").read_text())["stages"]
    assert [{x: s[x] for x in keys} for s in got] == [{x: s[x] for x in keys} for s in want]
    assert all(RunDir(run).stage_scores_files(k, "ranks-heldout") for k in (1, 2, 3))


@pytest.mark.parametrize("mode", ["quantile", "weighted"])
def test_quantile_and_weighted_boosting(tiny_run: Path, tmp_path: Path, mode: str) -> None:
    """Two stages on the tiny run's teacher (~15 s each): quantile drops the half of the pool SSM 1 covers
    best; weighted keeps every sample and weighs down the tokens SSM 1 covers."""
    from boosttune.train.coverage import remove_best_covered, sample_union_coverage

    run = tmp_path / mode
    ok(train(run, f"teacher.reuse_from={tiny_run}", f"boost.mode={mode}", "boost.num_ssms=2", "boost.top_k=4",
             "boost.min_pool=2", "eval.enabled=false"))
    stages = json.loads((run / "report.json").read_text())["stages"]
    assert [s["mode"] for s in stages] == [mode, mode] and stages[0]["coverage_k"] == 4
    check_coverage(stages)
    rd = RunDir(run)
    first, second = (json.loads(rd.stage_match(k).read_text()) for k in (1, 2))
    ranks = {int(i): v for i, v in json.loads(rd.stage_scores(1, "ranks-train", 0).read_text()).items()}
    ranks1 = [ranks[i] for i in range(len(ranks))]
    if mode == "quantile":
        assert [s["pool_before"] for s in stages] == [48, 24]
        assert second["pool"] == first["pool_after"] == remove_best_covered(
            first["pool"], sample_union_coverage([ranks1], 4), 0.5)
    else:
        assert [s["pool_before"] for s in stages] == [48, 48] and second["pool"] == list(range(48))
        covered = sum(r < 4 for row in ranks1 for r in row) / sum(len(row) for row in ranks1)
        assert stages[1]["train_covered_before"] == pytest.approx(covered) and 0 < covered < 1
        assert "train_covered_before" not in stages[0]


def test_warm_start_trains_ssm_k_from_ssm_k_minus_1(tiny_run: Path, tmp_path: Path) -> None:
    """``boost.warm_start``: stage 2 starts from SSM 1's weights, not the initial SSM's. With the tiny run's
    trained SSM 1 linked in and a learning rate too small to move anything, SSM 2 comes out as SSM 1."""
    import torch
    from conftest import load_script
    from safetensors.torch import load_file

    run = tmp_path / "warm"
    load_script("ablate_ssms").link_stage_one(tiny_run, run)
    proc = train(run, f"teacher.reuse_from={tiny_run}", "boost.mode=weighted", "boost.num_ssms=2",
                 "boost.warm_start=true", "optim.lr=1e-12", "eval.enabled=false")
    ok(proc)
    assert "stage 2/2: training on 48 of 48 samples (weighted, from SSM 1)" in proc.stdout
    weights = {name: load_file(str(run / rel / "model.safetensors")) for name, rel in
               (("init", "ssm-init"), ("ssm-1", "ssms/ssm-1"), ("ssm-2", "ssms/ssm-2"))}
    moved = [n for n, t in weights["ssm-1"].items() if not torch.equal(t, weights["init"][n])]
    assert moved  # SSM 1 trained away from the initial SSM
    for n in moved:
        assert torch.allclose(weights["ssm-2"][n], weights["ssm-1"][n], atol=1e-6), n


def test_delta_rank_saves_later_ssms_as_ssm_1_plus_low_rank_deltas(tiny_run: Path, tmp_path: Path) -> None:
    """``boost.delta_rank``: SSM 2 and 3 come out as SSM 1 plus rank-2 deltas in every layer matrix, their
    factors beside their weights rebuild them, and what the stage scored is what was saved."""
    import torch
    from conftest import load_script
    from safetensors.torch import load_file

    from boosttune.core.low_rank import DELTA_FILE, is_layer_matrix, load_factors, rebuilds

    run = tmp_path / "delta"
    load_script("ablate_ssms").link_stage_one(tiny_run, run)
    proc = train(run, f"teacher.reuse_from={tiny_run}", "boost.mode=weighted", "boost.num_ssms=3",
                 "boost.warm_start=true", "boost.delta_rank=2", "eval.enabled=false")
    ok(proc)
    assert "stage 2: cut to SSM 1 plus rank-2 deltas" in proc.stdout
    assert not (run / "ssms" / "ssm-1" / DELTA_FILE).exists()
    first = load_file(str(run / "ssms" / "ssm-1" / "model.safetensors"))
    layer = [n for n, t in first.items() if is_layer_matrix(n, t)]
    assert layer
    for k in (2, 3):
        weights = load_file(str(run / "ssms" / f"ssm-{k}" / "model.safetensors"))
        factors = load_factors(run / "ssms" / f"ssm-{k}")
        assert set(factors) == set(layer)
        for n in layer:
            assert torch.linalg.matrix_rank(weights[n] - first[n], atol=1e-5) <= 2, n
            assert rebuilds(first[n], weights[n], *factors[n]), n
        assert torch.equal(factors["model.layers.0.self_attn.q_proj.weight"][0],
                           factors["model.layers.0.self_attn.v_proj.weight"][0])  # q, k, v cut together
        stats = json.loads((run / "ssms" / f"ssm-{k}" / "stats.json").read_text())
        assert stats["delta_rank"] == 2 and 0 < stats["delta_energy_kept"] <= 1


def test_kill_during_teacher_keeps_whole_shards_and_ignores_the_half_written_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(run, "boost.num_ssms=1", "eval.enabled=false", kill_at="teacher-shard-tmp:2")
    assert proc.returncode == -9
    shards = sorted((run / "teacher").glob("shard-*.arrow"))
    assert [p.name for p in shards] == ["shard-00000.arrow"]  # the second is only a temporary file
    assert list((run / "teacher").glob(".shard-00001.arrow.*.tmp"))
    first = shards[0].read_bytes()
    ok(train(run, "boost.num_ssms=1", "eval.enabled=false"))
    assert (run / "teacher" / "shard-00000.arrow").read_bytes() == first  # not redone
    assert len(list((run / "teacher").glob("shard-*.arrow"))) == 4
    assert not list((run / "teacher").glob(".shard-*.tmp"))  # the killed run's temporary is cleaned up
    assert len(json.loads((run / "report.json").read_text())["stages"]) == 1


def test_kill_during_training_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # SSM 1 finishes; SSM 2 dies right after its first checkpoint (step 4 of 12)
    proc = train(run, "boost.num_ssms=2", "eval.enabled=false", kill_at="checkpoint:4")
    assert proc.returncode == -9
    ssm1 = digest(run / "ssms" / "ssm-1")
    assert (run / "stages" / "stage-2" / "checkpoints" / "last.ckpt").is_file()
    assert not (run / "ssms" / "ssm-2").exists()
    ok(train(run, "boost.num_ssms=2", "eval.enabled=false"))
    report = json.loads((run / "report.json").read_text())
    assert digest(run / "ssms" / "ssm-1") == ssm1  # completed work is never redone
    assert report["stages"][1]["resumed_from_step"] == 4
    assert report["stages"][1]["steps"] == 12


def test_kill_after_saving_an_ssm_finishes_the_stage(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(run, "boost.num_ssms=1", "eval.enabled=false", kill_at="ssm-saved:1")
    assert proc.returncode == -9
    assert not (run / "stages" / "stage-1" / "summary.json").exists()
    before = json.loads((run / "ssms" / "ssm-1" / "stats.json").read_text())
    ok(train(run, "boost.num_ssms=1", "eval.enabled=false"))
    report = json.loads((run / "report.json").read_text())
    assert report["stages"][0]["steps"] == 12 and report["stages"][0]["resumed_from_step"] == 12
    # resumed from its final checkpoint, the stage trains no step: its metrics come from the checkpoint
    after = json.loads((run / "ssms" / "ssm-1" / "stats.json").read_text())
    for stats in (report["stages"][0], after):
        assert stats["train_loss"] == before["train_loss"] is not None
        assert stats["train_tokens"] == before["train_tokens"] > 0
        assert stats["train_tokens_per_s"] is not None and stats["train_tokens_per_s"] > 0


def test_two_process_ddp_on_cpu(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(train(run, "optim.devices=2", "optim.strategy=ddp", "boost.num_ssms=2", "eval.enabled=false", timeout=600))
    report = json.loads((run / "report.json").read_text())
    assert report["world_size"] == 2
    assert all(s["world_size"] == 2 and s["strategy"] == "DDPStrategy" for s in report["stages"])
    # each rank wrote its own teacher shards and its share of the match scores
    assert sorted(p.name for p in (run / "teacher").glob("stats-rank*.json")) == ["stats-rank000.json",
                                                                                  "stats-rank001.json"]
    assert len(list((run / "stages" / "stage-1").glob("train-rank*.json"))) == 2
    assert len(report["stages"]) == 2


def test_kl_loss_with_lora(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ok(train(run, "boost.num_ssms=1", "eval.enabled=false", "teacher.topk_logprobs=4", "optim.loss=ce+kl",
             "lora.enabled=true", "lora.r=4", "ssm.freeze_embeddings=true"))
    metrics = (run / "stages" / "stage-1" / "logs" / "version_0" / "metrics.csv").read_text()
    assert "train/kl" in metrics.splitlines()[0]
    cfg = json.loads((run / "ssms" / "ssm-1" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1  # LoRA merged back into a plain model
    assert not (run / "ssms" / "ssm-1" / "adapter_config.json").exists()


# A learned scheduler that chooses among the SSM, the feature head and prompt lookup, on 6 MT-bench prompts.
SCHEDULER = (f"scheduler.prompts={MT_BENCH}", "scheduler.skip=2", "scheduler.limit=6", "scheduler.max_prompt_tokens=500",
             "scheduler.max_new_tokens=6", "scheduler.depths=[1,2]", "scheduler.widths=[2,1]",
             "scheduler.calib_prompts=1", "scheduler.calib_tokens=4", "scheduler.real_policies=[learned]")


def test_feature_head_trains_after_the_ssms_and_is_evaluated(tmp_path: Path, capsys) -> None:
    """A run with a feature head; then other feature settings and a scheduler: the head is trained again
    and the scheduler fitted, choosing among it. Each process loads the LLM once, though the teacher, the
    head, the evaluation and the scheduler all use it. A re-run of the finished run trains and writes
    nothing (no scheduler work), and its report holds the scheduler's."""
    run = tmp_path / "feature"
    args = ("boost.num_ssms=1", "feature.enabled=true", "feature.minutes=0", "feature.max_steps=4",
            "feature.batch_tokens=512")
    loads = tmp_path / "loads.json"
    ok(train(run, *args, loads=loads))
    assert json.loads(loads.read_text()).count("tiny-random") == 1  # the LLM; the others are the SSM and the head
    report = json.loads((run / "report.json").read_text())
    feature = report["feature"]
    assert feature["train"]["steps"] == 4 and feature["samples"] == 48 and feature["held_out_samples"] == 12
    assert feature["recorded_by_teacher"] == 60  # the teacher kept the features: no second pass
    assert set(feature["held_out"]) == {"reg", "ce", "top1", "reg2", "ce2", "top1_2"}  # depth 1, and depth 2 from its own features
    assert 0 <= feature["held_out"]["top1_2"] <= 1
    from boosttune.core.feature_head import is_feature_head
    from boosttune.core.models import load_model

    head = load_model(str(run / "ssms" / "feature"))
    assert is_feature_head(head.model)
    row = report["evaluation"]["feature"]
    assert row["tau"] >= 1.0 and row["tokens"] > 0 and row["draft_vocab"] == 8192
    assert row["lookup"]["prompt_lookup"] == 8 and row["lookup"]["tau"] >= 1.0  # also measured with prompt lookup
    assert all("lookup" in s for s in report["evaluation"]["singles"])

    from boosttune.assemble import load
    from boosttune.export.bundle import export_bundle
    from boosttune.serving.decode import incremental_generate
    from boosttune.serving.feature_drafter import FeatureDrafter
    from boosttune.serving.stops import StopCriteria

    with pytest.raises(ValueError, match="--drafters"):
        export_bundle(run, tmp_path / "bad", drafters=["ssm-9"])
    export_bundle(run, tmp_path / "bundle", drafters=["feature"])
    served = load(bundle=tmp_path / "bundle")
    assert list(served.engine.drafters) == ["feature"] and isinstance(served.engine.drafters["feature"], FeatureDrafter)
    stop = StopCriteria(max_new_tokens=16)
    out = served.generate([1, 2, 3, 4, 5], stop)
    assert out.tokens == incremental_generate(served.llm.model, [1, 2, 3, 4, 5], stop).tokens

    other = (*args[:-2], "feature.max_steps=3", "feature.batch_tokens=512", *SCHEDULER)
    proc = train(run, *other, loads=loads)  # other settings: trained again; a finished run gains a scheduler
    ok(proc)
    assert "scheduler: learned vs best fixed (" in proc.stdout and "eval requests: " in proc.stdout
    assert json.loads(loads.read_text()).count("tiny-random") == 1
    report = json.loads((run / "report.json").read_text())
    assert report["feature"]["train"]["steps"] == 3 and report["evaluation"]["feature"]["tau"] >= 1.0
    assert report["scheduler"] == json.loads((run / "scheduler_report.json").read_text())
    before = mtimes(run)
    ok(train(run, *other, read_only=True))  # finished: nothing retrained, no write tried, the scheduler not fitted again
    assert mtimes(run) == before

    # the learned scheduler chooses among the SSM, the feature head and prompt lookup; export ships what it chooses among
    labels = [json.loads(x) for x in (run / "scheduler_labels.jsonl").read_text().splitlines()]
    assert len(labels) == 6 and all(len(r["accepts"][0]) == 3 for r in labels)  # ssm-1, feature, prompt lookup
    res = export_bundle(run, tmp_path / "sched-bundle")
    assert [(d.name, d.kind) for d in res.manifest.models] == [("ssm-1", "ssm"), ("feature", "feature")]
    served = load(bundle=tmp_path / "sched-bundle")
    assert served.scheduler is not None and "feature" in served.scheduler.drafters
    out = served.generate([1, 2, 3, 4, 5], stop)
    assert out.tokens == incremental_generate(served.llm.model, [1, 2, 3, 4, 5], stop).tokens

    # scripts/ablate_kinds.py on this run: its head fine-tuned on every sample and on each kind's, scored per
    # question category, and the top-k of routing each category to its kind's head
    assert load_script("ablate_kinds").main([str(run), "--questions", str(MT_BENCH), "--limit", "2", "--max-new-tokens",
                                             "4", "--steps", "1", "--route", "writing=writing,stem=nothing",
                                             "--out", str(tmp_path / "kinds")]) == 0
    fig = json.loads((tmp_path / "kinds" / "kinds.json").read_text())
    assert set(fig["tables"]) == {"run", "all", "kind:writing"}  # no sample of kind "nothing": left out
    assert fig["tables"]["all"]["all"]["tokens"] == 8 and fig["tables"]["all"]["writing"]["answers"] == 2
    assert fig["routed"]["routed"] == fig["tables"]["kind:writing"]["all"]["topk"][0]  # both questions are writing

    from boosttune.report import collect
    from boosttune.report_plot import panels

    lines = _report(run, capsys)  # every panel: stages, τ, speed-up, coverage, the scheduler's choices
    assert len(panels(collect(RunDir(run)).report)) == 5
    assert drafters(lines) == ["ssm-1", "feature"]


def test_boosted_feature_heads_train_in_turn_and_serve_merged(tmp_path: Path) -> None:
    """``feature.heads=2``: head 2 trains on what head 1 misses (its loss weighted by head 1's coverage), both
    are measured alone and merged, and a bundle of both serves their merged tree exactly. Both are boosted
    over prompt lookup too (``feature.lookup_weight``), and the report gives the heads' union with it. A
    third head added later trains alone: the first two are kept."""
    run = tmp_path / "heads"
    args = ("boost.num_ssms=1", "feature.enabled=true", "feature.minutes=0", "feature.max_steps=4",
            "feature.batch_tokens=512", "feature.covered_weight=0.2", "feature.lookup_weight=0.5")
    proc = train(run, *args, "feature.heads=2")
    ok(proc)
    shown = proc.stdout.splitlines()  # the summary: each head, their union, each measured alone and merged
    assert any(x.startswith("feature heads: feature 4 steps") and "; feature-2 4 steps" in x and "union top-" in x
               for x in shown)
    assert drafters(shown) == ["ssm-1", "feature", "feature-2", "heads merged"]
    report = json.loads((run / "report.json").read_text())
    feature = report["feature"]
    assert [h["head"] for h in feature["heads"]] == ["feature", "feature-2"]
    assert feature["heads"][0]["boost"] is None and feature["heads"][1]["boost"] == "weighted"
    assert 0 <= feature["heads"][1]["covered_by_earlier"] <= 1
    assert all(0 <= h["covered_by_lookup"] <= 1 for h in feature["heads"])
    assert feature["union_coverage"] <= feature["union_coverage_with_lookup"] <= 1
    assert 0 <= feature["lookup_coverage"] <= feature["union_coverage_with_lookup"]
    assert len(feature["head_coverages"]) == 2 and feature["coverage_k"] >= 1
    assert max(feature["head_coverages"]) <= feature["union_coverage"] <= sum(feature["head_coverages"])
    ev = report["evaluation"]
    assert [h["drafter"] for h in ev["feature_heads"]] == ["feature", "feature-2"]
    assert ev["feature_ensemble"]["drafters"] == ["feature", "feature-2"] and ev["feature_ensemble"]["tau"] >= 1.0
    assert "feature_ensemble_gain_over_best_single" in ev

    from boosttune.assemble import load
    from boosttune.export.bundle import export_bundle
    from boosttune.serving.decode import incremental_generate
    from boosttune.serving.stops import StopCriteria

    res = export_bundle(run, tmp_path / "bundle", drafters=["feature", "feature-2"])
    assert [(d.name, d.kind) for d in res.manifest.models] == [("feature", "feature"), ("feature-2", "feature")]
    served = load(bundle=tmp_path / "bundle")
    assert list(served.engine.drafters) == ["feature", "feature-2"]
    stop = StopCriteria(max_new_tokens=16)
    assert served.generate([1, 2, 3, 4, 5], stop).tokens == incremental_generate(served.llm.model, [1, 2, 3, 4, 5], stop).tokens

    kept = {d: (run / "ssms" / d / "model.safetensors").stat().st_mtime_ns for d in ("feature", "feature-2")}
    ok(train(run, *args, "feature.heads=3"))
    assert {d: (run / "ssms" / d / "model.safetensors").stat().st_mtime_ns for d in kept} == kept
    report = json.loads((run / "report.json").read_text())
    assert [h["head"] for h in report["feature"]["heads"]] == ["feature", "feature-2", "feature-3"]
    assert len(report["evaluation"]["feature_ensemble"]["drafters"]) == 3


def test_a_head_recorded_before_a_feature_field_existed_is_not_trained_again() -> None:
    """A finished head whose stats predate a ``feature:`` field (its default keeps the old recipe) counts as
    trained with today's settings at that default, and not with another value of it."""
    from dataclasses import asdict

    from boosttune.config import FeatureConfig
    from boosttune.train.pipeline import _same_feature_settings

    now = FeatureConfig(enabled=True, minutes=2.0)
    old = {k: v for k, v in json.loads(json.dumps(asdict(now))).items() if k not in ("prompt_weight", "weight_decay")}
    assert _same_feature_settings(old, now)
    assert not _same_feature_settings(old, FeatureConfig(enabled=True, minutes=2.0, prompt_weight=1.0))
    assert not _same_feature_settings({**old, "minutes": 3.0}, now)
    assert not _same_feature_settings(None, now)
    # how many heads follow never matters; how later heads are boosted does not matter to the first
    assert _same_feature_settings(old, FeatureConfig(enabled=True, minutes=2.0, heads=3, boost="independent"))
    assert not _same_feature_settings(old, FeatureConfig(enabled=True, minutes=2.0, boost="independent"), k=2)


# --------------------------------------------------------------------------------- the README's path
def _readme_blocks(section: str, lang: str) -> list[str]:
    """The ``lang`` code blocks of README.md's ``## section``, in order."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [b.split("```", 1)[0] for b in body.split(f"```{lang}\n")[1:]]


def _readme_commands(block: str) -> list[list[str]]:
    """Each command line of a bash block (continuations joined, comments dropped), split as the shell would."""
    import shlex

    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_the_readmes_path_from_a_run_to_a_request_works_as_written(tiny_run: Path, tmp_path: Path) -> None:
    """README's "From training to a request", run as written on the tiny run in place of runs/demo (the
    LLM tiny-random, answers and benchmarks shortened): export, serve, the curl request and the openai
    snippet against that server, generate greedy and sampled, bench."""
    import socket
    import time
    import urllib.request

    section = "From training to a request"
    bash, python = _readme_blocks(section, "bash"), _readme_blocks(section, "python")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "demo").symlink_to(tiny_run)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def local(cmd: list[str]) -> list[str]:
        """The README's command for this test: our interpreter, the free port, the shared data, fewer tokens."""
        swap = {"8000": str(port), "20": "2", "128": "8"}
        out = [sys.executable, "-m", "boosttune.cli", *cmd[1:]] if cmd[0] == ".venv/bin/boosttune" else list(cmd)
        out = [x.replace("../shared/data/mt_bench/question.jsonl", str(MT_BENCH)).replace(":8000/", f":{port}/")
               for x in out]
        return [swap.get(x, x) if i and out[i - 1] in ("--port", "--limit", "--max-new-tokens") else x
                for i, x in enumerate(out)]

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    export, serve = _readme_commands(bash[0])
    ok(subprocess.run(local(export), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300))
    server = subprocess.Popen([*local(serve), "--threads", "1"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read() if server.poll() else ""
                time.sleep(0.3)
        (curl,) = _readme_commands(bash[1])
        url, body = next(x for x in curl if x.startswith("http")), curl[curl.index("-d") + 1]
        req = urllib.request.Request(local([url])[0], data=body.encode(), headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert answer["model"] == "demo-bundle" and answer["choices"][0]["message"]["content"]
        snippet = python[0].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        printed = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=120)
        ok(printed)
        assert printed.stdout.strip()
    finally:
        server.terminate()
        server.wait(timeout=60)
    for cmd in _readme_commands(bash[2]):
        proc = subprocess.run(local(cmd), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        ok(proc)
    assert json.loads((tmp_path / "bench_out" / "demo" / "summary.json").read_text())


def test_eagle3_head_trains_on_a_finished_run_and_exports_for_llama_cpp(tiny_run: Path, tmp_path: Path) -> None:
    """``eagle3.enabled`` on a finished run trains only the EAGLE-3 head (the rest is reused), publishes it in
    the Hugging Face EAGLE-3 layout, is not trained again by a rerun; `export --format hf` copies that folder
    and `export --format gguf` writes it as llama.cpp's eagle3 architecture, beside the SSMs."""
    import gguf

    from boosttune.core.eagle3_head import is_eagle3_dir
    from boosttune.export.gguf import export_gguf
    from boosttune.export.hf import export_hf

    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    ssm_before = (run / "ssms" / "ssm-1" / "model.safetensors").stat().st_mtime_ns
    args = ("eagle3.enabled=true", "eagle3.minutes=0", "eagle3.max_steps=3", "eagle3.layers=[0,1,1]",
            "eagle3.batch_tokens=512")
    ok(train(run, *args))
    report = json.loads((run / "report.json").read_text())
    e3 = report["eagle3"]
    assert e3["train"]["steps"] == 3 and e3["samples"] == 48 and e3["held_out_samples"] == 12
    assert e3["layers"] == [0, 1, 1] and 1.0 <= e3["held_out"]["tau"] <= 1 + e3["config"]["depth"]
    served_e3 = report["evaluation"]["eagle3"]  # the run's evaluation serves it beside the SSMs
    assert served_e3["widths"] == [1, 1, 1] and served_e3["tau"] >= 1.0 and served_e3["speedup"] > 0
    assert len(e3["held_out"]["accept_rate"]) == 3 and e3["held_out"]["chains"] > 0
    assert is_eagle3_dir(run / "eagle3") and (run / "eagle3" / "complete.json").is_file()
    assert (run / "ssms" / "ssm-1" / "model.safetensors").stat().st_mtime_ns == ssm_before  # SSMs reused
    before = (run / "eagle3" / "model.safetensors").stat().st_mtime_ns
    proc = train(run, *args)
    ok(proc)
    assert any(line.startswith("EAGLE-3 head: LLM layers 0, 1, 1, 3 steps") for line in proc.stdout.splitlines())
    assert (run / "eagle3" / "model.safetensors").stat().st_mtime_ns == before
    hf = export_hf(run, tmp_path / "hf")
    assert hf.eagle3 == tmp_path / "hf" / "eagle3" and is_eagle3_dir(hf.eagle3)
    assert json.loads((hf.eagle3 / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (hf.eagle3 / "tokenizer.json").is_file()
    res = export_gguf(run, tmp_path / "gguf", gguf_type="f32")
    written = json.loads((res.out / "export.json").read_text())
    assert written["eagle3"] == "eagle3.f32.gguf"
    reader = gguf.GGUFReader(res.out / "eagle3.f32.gguf")
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "eagle3"
    assert {t.name for t in reader.tensors} >= {"fc.weight", "d2t", "blk.0.attn_q.weight", "output.weight"}
    # a bundle ships it as a drafter of kind eagle3, and serving it is lossless
    from boosttune.assemble import load
    from boosttune.export.bundle import export_bundle
    from boosttune.serving.decode import incremental_generate
    from boosttune.serving.stops import StopCriteria

    bundle = export_bundle(run, tmp_path / "bundle", drafters=["eagle3"], prompt_lookup=3)
    entry = bundle.manifest.drafters[0]
    assert (entry.name, entry.kind, entry.tree.draft_vocab, len(entry.tree.widths)) == ("eagle3", "eagle3", 0, 3)
    served = load(bundle=bundle.bundle)
    assert served.engine.llm.taps == (0, 1)
    prompt = served.llm.tokenizer("the cat sat on the mat and the cat")["input_ids"]
    stop = StopCriteria(max_new_tokens=16)
    assert served.generate(prompt, stop, chat=False).tokens == incremental_generate(served.llm.model, prompt, stop).tokens
