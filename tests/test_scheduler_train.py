"""`boosttune train-scheduler` end to end on a real (tiny) run directory."""

from __future__ import annotations

import dataclasses
import json

import pytest
from bundle_fixtures import write_ranking
from conftest import MT_BENCH, perturbed

from boosttune.cli import main
from boosttune.core.files import atomic_write_json, mark_complete
from boosttune.core.models import load_model
from boosttune.scheduler.offline.labels import RequestRecord
from boosttune.scheduler.policy import Candidate, Scheduler

pytestmark = pytest.mark.skipif(not MT_BENCH.is_file(), reason="needs ../shared/data/mt_bench")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """report.json + two complete SSMs: perturbed copies of the tiny random LLM."""
    run = tmp_path_factory.mktemp("run")
    llm = load_model("tiny-random")
    stages = []
    for k, noise in ((1, 0.02), (2, 0.5)):
        d = run / "ssms" / f"ssm-{k}"
        perturbed(llm.model, k, noise).save_pretrained(d)
        llm.tokenizer.save_pretrained(d)
        mark_complete(d)
        stages.append({"stage": k, "ssm_dir": f"ssms/ssm-{k}"})
    atomic_write_json(
        run / "report.json",
        {
            "format": 1,
            "llm": {"ref": "tiny-random", "path": llm.path, "dtype": "fp32"},
            "tree": {"kind": "expansion", "widths": [1, 2, 1]},
            "stages": stages,
        },
    )
    write_ranking(run, llm)
    return run


def test_train_scheduler_writes_scheduler_and_report(run_dir, capsys):
    rc = main(
        [
            "train-scheduler",
            str(run_dir),
            "--prompts",
            str(MT_BENCH),
            "--limit",
            "6",
            "--max-new-tokens",
            "6",
            "--depths",
            "1,2",
            "--calib-prompts",
            "1",
            "--calib-tokens",
            "4",
            "--real-policies",
            "learned,all,none",
            "--draft-vocab",
            "40",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    report = json.loads((run_dir / "scheduler_report.json").read_text())
    assert report["llm"]["device"] == "cpu"  # where the costs were timed
    assert (run_dir / "scheduler_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "scheduler" / "complete.json").is_file()
    policies = report["policies"]
    assert set(policies) == {
        "learned",
        "learned_per_request",
        "oracle",
        "random",
        "none",
        "all",
        "single:ssm-1",
        "single:ssm-2",
        "single:prompt-lookup",
        "best_fixed",
    }
    for name, p in policies.items():
        assert {"tau", "tokens_per_s", "draft_s_per_request"} <= set(p["replay"]), name
        assert (p["real"] is not None) == (name in ("learned", "all", "none")), name
    oracle = policies["oracle"]["replay"]["tokens_per_s"]
    assert all(p["replay"]["tokens_per_s"] <= oracle * (1 + 1e-9) for p in policies.values())
    assert policies["none"]["replay"]["tau"] == 1.0 and policies["none"]["real"]["draft_s_per_request"] == 0.0
    assert report["requests"] == {**report["requests"], "train": 3, "eval": 3}
    overhead = report["scheduler_overhead"]
    # < 2 % of a real request's latency is measured on SmolLM2 (a 6-token tiny request takes ~30 ms)
    assert overhead["measured"] and overhead["mean_ms"] < 5.0
    assert "learned/best fixed" in capsys.readouterr().err

    scheduler = Scheduler.load(run_dir / "scheduler" / "scheduler.json")
    # two SSMs and prompt lookup (the last drafter, chains of up to the label depth)
    assert scheduler.n_ssms == 3 and scheduler.costs.depths == (1, 2) and scheduler.widths == (1, 2)
    assert scheduler.prompt_lookup and scheduler.lookup_length == 2 and scheduler.spec.lookup
    assert scheduler.model.passthrough == 3  # prompt length, chat, lookup hit rate skip the PCA
    assert scheduler.draft_vocab == 40 and scheduler.trees(Candidate(0b1, 2))[0].draft_vocab == 40 and report["llm"]["draft_vocab"] == 40
    assert sorted(p.name for p in (run_dir / "scheduler").iterdir()) == ["complete.json", "scheduler.json"]
    line = (run_dir / "scheduler_labels.jsonl").read_text().splitlines()[0]
    record = RequestRecord.from_json(json.loads(line), n_ssms=3)
    assert record.features.lookup_hit_rate is not None
    choice = scheduler.choose(list(range(record.prompt_tokens)), record.features)
    assert set(choice.ssm_indices) <= {0, 1, 2} and choice.depth in (0, 1, 2)


def test_a_finished_scheduler_is_known_by_its_settings(run_dir):
    """`boosttune train` keeps a run's scheduler only when its marker records today's settings (the test
    above fitted it)."""
    from boosttune.config import SchedulerConfig, from_dict
    from boosttune.core.rundir import RunDir
    from boosttune.scheduler.offline.train import RunModels, finished_scheduler

    run = RunDir(run_dir)
    settings = json.loads((run.scheduler_dir / "complete.json").read_text())["settings"]
    assert settings["drafters"] == ["ssm-1", "ssm-2"] and settings["dtype"] == "fp32"
    cfg = from_dict(SchedulerConfig, settings["config"], "scheduler")
    models = RunModels.of_run(run)
    assert finished_scheduler(run, cfg, models) == json.loads(run.scheduler_report.read_text())
    assert finished_scheduler(run, cfg.replace(seed=cfg.seed + 1), models) is None
    assert finished_scheduler(run, cfg, dataclasses.replace(models, ssm_dirs=models.ssm_dirs[:1])) is None  # other SSMs


def test_train_scheduler_refuses_bad_configs_by_name(run_dir, tmp_path, capsys):
    assert main(["train-scheduler", str(run_dir)]) == 2
    assert "scheduler.prompts is not set" in capsys.readouterr().err
    bad = tmp_path / "cfg.yaml"
    bad.write_text("scheduler:\n  prompts: x.jsonl\n  budgets: [1, 2]\n")
    assert main(["train-scheduler", str(run_dir), "--config", str(bad)]) == 2
    assert "scheduler.budgets" in capsys.readouterr().err
    assert main(["train-scheduler", str(tmp_path), "--prompts", str(MT_BENCH)]) == 2
    assert "no report.json" in capsys.readouterr().err


def test_server_uses_the_exported_scheduler_and_stays_lossless(run_dir, tmp_path):
    """The scheduler trained above travels in the bundle; the server plans every request with it."""
    from openai import OpenAI

    from boosttune.core.models import eos_token_ids
    from boosttune.core.prompts import encode_prompt
    from boosttune.export.bundle import export_bundle
    from boosttune.http.server import ServerConfig, ServerThread, create_app
    from boosttune.serving.bundle import load_bundle
    from boosttune.serving.decode import incremental_generate
    from boosttune.serving.stops import StopCriteria

    assert (run_dir / "scheduler" / "scheduler.json").is_file()  # written by the test above
    for k in (1, 2):  # export carries each SSM's training statistics
        (run_dir / "ssms" / f"ssm-{k}" / "stats.json").write_text(json.dumps({"stage": k}))
    bundle = load_bundle(export_bundle(run_dir, tmp_path / "bundle").bundle)
    app = create_app(bundle, ServerConfig(model_name="m", torch_threads=1, warmup=False))
    assert app.state.boosttune.scheduler is not None
    # the scheduler chooses among the SSMs and prompt lookup: the engine is built with all three
    assert app.state.boosttune.drafter_names == ["ssm-1", "ssm-2", "prompt-lookup"]
    assert len(app.state.boosttune.served.engine.drafters) == 3
    with ServerThread(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model="m", prompt="Name three colours.", max_tokens=10, temperature=0,
                                      extra_body={"return_token_ids": True})
    stats = r.model_extra["boosttune"]
    tok = bundle.llm.tokenizer
    ids = encode_prompt(tok, "Name three colours.", chat=False)
    plain = incremental_generate(bundle.llm.model, ids, StopCriteria(max_new_tokens=10, eos_token_ids=eos_token_ids(bundle.llm)))
    assert stats["token_ids"] == plain.tokens
    assert bundle.ranking is not None and app.state.boosttune.scheduler.draft_vocab == 40
    assert set(stats["drafters"]) <= {"ssm-1", "ssm-2", "prompt-lookup"}  # what the scheduler chose (possibly none)


def test_calibration_repeats_script_recosts_a_bundle_and_times_its_choices(run_dir, tmp_path, capsys):
    """scripts/calibration_repeats.py on a bundle of the scheduler trained above: one table row per
    repeat whose fixed choice is ``recosted``'s (so the fastest or a simpler one within the margin), then
    plain decoding and every choice it met, timed for real."""
    from conftest import load_script

    from boosttune.export.bundle import export_bundle

    assert (run_dir / "scheduler" / "scheduler.json").is_file()  # written by the first test
    bundle = export_bundle(run_dir, tmp_path / "bundle").bundle
    script = load_script("calibration_repeats")
    assert script.main([str(bundle), "--repeats", "2", "--tokens", "4", "--questions", str(MT_BENCH), "--limit", "1",
                        "--max-new-tokens", "4", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{bundle}: shipped fixed choice ") and "(margin 0.02)" in lines[0]
    repeats = [line.split("  ") for line in lines[3:5]]
    assert [r[0] for r in repeats] == ["1", "2"] and lines[5].startswith("choice")
    timed = [line.split("  ")[0] for line in lines[7:]]
    assert timed[0] == "plain decoding" and len(timed) >= 2
    with pytest.raises(SystemExit):
        script.main([str(bundle), "--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_export_says_prompt_lookup_comes_with_the_scheduler(run_dir, tmp_path, capsys):
    """A bundle whose scheduler plans prompt lookup lists no lookup entry of its own; export's summary
    says lookup runs where the scheduler plans it, not that it is off."""
    assert (run_dir / "scheduler" / "scheduler.json").is_file()  # written by the first test, with prompt lookup
    assert main(["export", str(run_dir), "--out", str(tmp_path / "planned")]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert "scheduler scheduler, prompt lookup where the scheduler plans it" in line
    assert main(["export", str(run_dir), "--out", str(tmp_path / "fixed"), "--prompt-lookup", "4"]) == 0
    assert "prompt lookup 4" in capsys.readouterr().out


@pytest.mark.parametrize("no_scheduler", [False, True])
def test_generate_serve_and_bench_assemble_the_same_engine_from_one_bundle(run_dir, tmp_path, monkeypatch, capsys,
                                                                          no_scheduler):
    """One bundle, three commands, one assembly: the same drafters, default trees, draft vocabulary
    and learned scheduler (`generate BUNDLE` used to leave the scheduler and its prompt lookup out)."""
    import torch
    import uvicorn

    from boosttune import assemble
    from boosttune.export.bundle import export_bundle
    from boosttune.serving.lookup import LOOKUP_NAME

    assert (run_dir / "scheduler" / "scheduler.json").is_file()  # written by the first test
    for k in (1, 2):  # export carries each SSM's training statistics
        (run_dir / "ssms" / f"ssm-{k}" / "stats.json").write_text(json.dumps({"stage": k}))
    bundle = str(export_bundle(run_dir, tmp_path / "bundle", prompt_lookup=4).bundle)
    built = []
    from_bundle = assemble.from_bundle

    def spy(*args, **kwargs):
        built.append(from_bundle(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(assemble, "from_bundle", spy)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # serve assembles, then would listen
    extra = ["--no-scheduler"] if no_scheduler else []
    assert main(["generate", bundle, "Name three colours.", "--max-new-tokens", "2", *extra]) == 0
    assert main(["serve", bundle, "--port", "0", *extra]) == 0
    assert main(["bench", "--bundle", bundle, "--questions", str(MT_BENCH), "--limit", "1", "--max-new-tokens", "2",
                 "--out", str(tmp_path / "bench"), *extra]) == 0
    generate, serve, bench = built
    for other in (serve, bench):
        assert list(other.engine.drafters) == list(generate.engine.drafters)
        assert other.engine.plan == generate.engine.plan
        assert torch.equal(other.ranking, generate.ranking)
        assert (other.scheduler is None) == (generate.scheduler is None)
        if other.scheduler is not None:
            assert other.scheduler.to_json() == generate.scheduler.to_json()
    if no_scheduler:  # every SSM, and the bundle's prompt-lookup default
        assert generate.scheduler is None and generate.lookup == 4
    else:  # the drafters the scheduler chooses among: both SSMs and prompt lookup at the label depth
        assert generate.scheduler is not None and generate.lookup == generate.scheduler.lookup_length == 2
    assert list(generate.engine.drafters) == ["ssm-1", "ssm-2", LOOKUP_NAME]
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert summary["scheduler"] == (not no_scheduler) and summary["greedy_identical"] == 1
    # the answer records the plan the request drafted with: the scheduler's choice (a subset of the drafters,
    # possibly none), else the bundle's default plan
    (answer,) = [json.loads(line) for line in (tmp_path / "bench" / "ours.jsonl").read_text().splitlines()]
    plan = answer["choices"][0]["plan"]
    assert set(plan) <= set(generate.engine.drafters) and sum(summary["plans"].values()) == 1
    assert set(answer["choices"][0]["proposer_hits"]) == set(plan)
    if no_scheduler:
        assert plan == summary["plan"]
    # a tree the learned scheduler would override is refused, naming the way out; without it, it applies
    capsys.readouterr()
    assert main(["generate", bundle, "Hi", "--max-new-tokens", "2", "--widths", "1", *extra]) == (0 if no_scheduler else 2)
    assert no_scheduler or "--no-scheduler" in capsys.readouterr().err
    assert not no_scheduler or built[-1].engine.plan.trees["ssm-1"].widths == (1,)
