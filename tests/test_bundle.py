"""Bundles: export from a real (small) run directory, validation of every kind of damage, loading,
and `boosttune export` / `boosttune generate BUNDLE "prompt"` on the command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bundle_fixtures import TREE, make_run_dir, one_torch_thread  # noqa: F401 (autouse fixture)

from boosttune.cli import main
from boosttune.config import SchedulerConfig
from boosttune.core.files import atomic_write_json, sha256_file
from boosttune.core.rundir import REPORT_FORMAT, RunDir
from boosttune.export.bundle import export_bundle
from boosttune.scheduler.offline.train import fit_scheduler
from boosttune.serving.bundle import load_bundle, verify_bundle
from boosttune.serving.manifest import BUNDLE_FORMAT, MANIFEST, BundleError, parse_manifest


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("run"), scheduler=True)


@pytest.fixture(scope="module")
def bundle(run_dir, tmp_path_factory) -> Path:
    return export_bundle(run_dir, tmp_path_factory.mktemp("exported") / "bundle").bundle


@pytest.fixture
def copy(bundle, tmp_path) -> Path:
    """A private copy of the bundle to damage."""
    return Path(shutil.copytree(bundle, tmp_path / "bundle"))


def _manifest(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text())


def _write_manifest(root: Path, manifest: dict) -> None:
    (root / MANIFEST).write_text(json.dumps(manifest))


def copy_of(bundle: Path, dest: Path) -> Path:
    return Path(shutil.copytree(bundle, dest))


def test_export_lists_every_file_with_its_hash(bundle, run_dir):
    m = _manifest(bundle)
    assert m["format"] == BUNDLE_FORMAT and m["kind"] == "boosttune-bundle"
    assert set(m["versions"]) >= {"boosttune", "torch", "transformers"}
    files = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(m["files"]) == files
    for rel, entry in m["files"].items():
        assert entry == {"sha256": sha256_file(bundle / rel), "size": (bundle / rel).stat().st_size}
    # The incomplete third stage is left out; the two complete SSMs are there in stage order.
    assert [s["name"] for s in m["drafters"]] == ["ssm-1", "ssm-2"]
    assert [s["stage"] for s in m["drafters"]] == [1, 2] and {s["kind"] for s in m["drafters"]} == {"ssm"}
    s1 = m["drafters"][0]
    assert s1["weights"] == ["ssms/ssm-1/model.safetensors"] and s1["report"]["pool_before"] == 100
    stats = json.loads((run_dir / "ssms/ssm-1/stats.json").read_text())
    assert json.loads((bundle / s1["acceptance_profile"]).read_text()) == stats["acceptance_profile"]
    assert json.loads((bundle / s1["stats"]).read_text()) == stats
    # One tokenizer for all; none per SSM; no pickle anywhere.
    assert (bundle / "tokenizer" / "tokenizer.json").is_file()
    assert not any(p.name.startswith("tokenizer") for p in (bundle / "ssms").rglob("*"))
    assert not any(p.suffix in (".bin", ".pt", ".pkl", ".pickle") for p in bundle.rglob("*"))
    # The scheduler directory is copied file for file (its hidden temporary is not).
    assert m["scheduler"] == {"dir": "scheduler", "files": ["scheduler/features/names.txt", "scheduler/policy.json",
                                                            "scheduler/scheduler.json"]}
    assert all(s["tree"] == TREE for s in m["drafters"])  # each drafter carries its own tree
    assert m["llm"]["ref"] == "tiny-random" and len(m["llm"]["sha256"]) == 64
    assert set(m["llm"]["files"]) >= {"config.json", "model.safetensors"}


def test_the_manifest_has_one_owner_that_writes_and_reads_it(run_dir, bundle, copy, tmp_path):
    """Manifest.to_json is what export writes and parse_manifest reads back, every tree field included
    (export used to write its own dict, which dropped the tree's ngram_depths)."""
    m = verify_bundle(bundle).manifest
    assert parse_manifest(m.to_json()) == m and m.to_json() == _manifest(bundle)
    tabled = Path(shutil.copytree(run_dir, tmp_path / "tabled-run"))
    report = json.loads((tabled / "report.json").read_text())
    report["tree"]["ngram_depths"] = [2, 4]
    (tabled / "report.json").write_text(json.dumps(report))
    out = export_bundle(tabled, tmp_path / "tabled").bundle
    assert _manifest(out)["drafters"][0]["tree"]["ngram_depths"] == [2, 4]
    assert load_bundle(out).manifest.drafters[0].tree.ngram_depths == (2, 4)


def _as_format_1(m: dict) -> dict:
    """A format-2 manifest object as format 1 wrote it: an ``ssms`` list without kinds, one tree, and
    prompt lookup as a number (the tree as before it carried ngram_depths)."""
    models = [d for d in m["drafters"] if d["dir"] is not None]
    lookup = [d for d in m["drafters"] if d["kind"] == "prompt_lookup"]
    old = {k: v for k, v in m.items() if k != "drafters"}
    old["format"] = 1
    old["tree"] = {k: v for k, v in models[0]["tree"].items() if k != "ngram_depths"}
    old["ssms"] = [{k: v for k, v in d.items() if k not in ("kind", "tree")} for d in models]
    old["prompt_lookup"] = len(lookup[0]["tree"]["widths"]) if lookup else 0
    return old


def test_format_1_bundles_load_through_the_migration(run_dir, copy, tmp_path):
    """A bundle written before drafters had kinds loads: its SSMs become kind "ssm", a feature head
    (its directory lists feature_head.json) kind "feature", its one tree every drafter's, and its
    prompt-lookup number a prompt-lookup drafter."""
    new = verify_bundle(copy).manifest
    _write_manifest(copy, _as_format_1(_manifest(copy)))
    old = verify_bundle(copy).manifest
    assert old.format == BUNDLE_FORMAT and old.drafters == new.drafters and old.prompt_lookup == 0
    m = _as_format_1(new.to_json())
    m["prompt_lookup"] = 3
    m["ssms"][1]["dir"] = "ssms/feature"
    m["files"]["ssms/feature/feature_head.json"] = m["files"]["ssms/ssm-2/config.json"]
    migrated = parse_manifest(m)
    assert [(d.name, d.kind) for d in migrated.drafters] == [("ssm-1", "ssm"), ("ssm-2", "feature"),
                                                             ("prompt-lookup", "prompt_lookup")]
    assert migrated.prompt_lookup == 3 and migrated.drafters[2].dir is None


def test_load_bundle_gives_models_tree_and_scheduler(bundle):
    b = load_bundle(bundle)
    assert list(b.models) == b.model_names == ["ssm-1", "ssm-2"]
    assert all(d.tree.widths == (1, 2, 1) for d in b.manifest.drafters)
    assert b.scheduler_dir == bundle / "scheduler"
    assert b.acceptance_profiles["ssm-1"]["per_depth"][0] == pytest.approx(0.6)
    assert b.llm.ref == "tiny-random" and b.context_length == 2048
    assert all(s.tokenizer is b.llm.tokenizer for s in b.models.values())
    assert b.llm.model.dtype == b.models["ssm-1"].model.dtype


def _delete(root: Path) -> str:
    (root / "ssms/ssm-2/model.safetensors").unlink()
    return "ssms/ssm-2/model.safetensors"


def _truncate(root: Path) -> str:
    path = root / "tokenizer/tokenizer.json"
    path.write_bytes(path.read_bytes()[:-100])
    return "tokenizer/tokenizer.json"


def _flip_byte(root: Path) -> str:
    path = root / "ssms/ssm-1/model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return "ssms/ssm-1/model.safetensors"


def _wrong_hash(root: Path) -> str:
    m = _manifest(root)
    entry = m["files"]["ssms/ssm-1/config.json"]
    entry["sha256"] = ("0" if entry["sha256"][0] != "0" else "1") + entry["sha256"][1:]
    _write_manifest(root, m)
    return "ssms/ssm-1/config.json"


def _unknown_format(root: Path) -> str:
    m = _manifest(root)
    m["format"] = BUNDLE_FORMAT + 98
    _write_manifest(root, m)
    return MANIFEST


def _extra_file(root: Path) -> str:
    (root / "ssms/ssm-1/pytorch_model.bin").write_bytes(b"not listed")
    return "ssms/ssm-1/pytorch_model.bin"


def _escaping_path(root: Path) -> str:
    m = _manifest(root)
    m["files"]["../outside.json"] = m["files"].pop("scheduler/policy.json")
    _write_manifest(root, m)
    return "../outside.json"


def _no_manifest(root: Path) -> str:
    (root / MANIFEST).unlink()
    return MANIFEST


def _broken_manifest(root: Path) -> str:
    (root / MANIFEST).write_text('{"format": 1, ')
    return MANIFEST


def _missing_field(root: Path) -> str:
    m = _manifest(root)
    del m["drafters"][0]["config"]
    _write_manifest(root, m)
    return "drafters[0].config"


@pytest.mark.parametrize("damage", [_delete, _truncate, _flip_byte, _wrong_hash, _unknown_format, _extra_file,
                                    _escaping_path, _no_manifest, _broken_manifest, _missing_field])
def test_damaged_bundle_is_refused_naming_the_file(copy, damage):
    named = damage(copy)
    with pytest.raises(BundleError) as e:
        load_bundle(copy)
    assert named in str(e.value)


def test_refusal_messages_say_what_happened(bundle, copy):
    _truncate(copy)
    with pytest.raises(BundleError, match="truncated"):
        verify_bundle(copy)
    shutil.copyfile(bundle / "tokenizer/tokenizer.json", copy / "tokenizer/tokenizer.json")
    m = _manifest(copy)
    m["format"] = 3
    _write_manifest(copy, m)
    with pytest.raises(BundleError, match="unsupported bundle format 3"):
        verify_bundle(copy)


def test_llm_with_another_hash_is_refused(bundle, run_dir, tmp_path):
    # The wrong LLM: the right one's files with an SSM's weights (a llama of the same shape). Its
    # config.json is the LLM's own: the SSM's may name another transformers version.
    llm_dir = Path(_manifest(bundle)["llm"]["path"])
    wrong = Path(shutil.copytree(llm_dir, tmp_path / "wrong-llm"))
    shutil.copyfile(run_dir / "ssms/ssm-1/model.safetensors", wrong / "model.safetensors")
    with pytest.raises(BundleError, match="model.safetensors") as e:
        verify_bundle(bundle, llm=str(wrong))
    assert "--llm" in str(e.value)
    # The right LLM copied elsewhere is accepted (--llm overrides where it is, the hash decides).
    moved = Path(shutil.copytree(llm_dir, tmp_path / "moved-llm"))
    assert verify_bundle(bundle, llm=str(moved)).llm_dir == moved
    # ... but not once its config changes.
    config = json.loads((moved / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(BundleError, match="config.json"):
        verify_bundle(bundle, llm=str(moved))


def test_export_refuses_what_it_cannot_bundle(run_dir, bundle, tmp_path):
    with pytest.raises(ValueError, match="--force"):
        export_bundle(run_dir, bundle)
    empty = tmp_path / "empty-run"
    atomic_write_json(RunDir(empty).report_path, {"format": REPORT_FORMAT, "llm": {"ref": "tiny-random"}, "stages": []})
    with pytest.raises(ValueError, match="no complete SSM"):
        export_bundle(empty, tmp_path / "b1")
    pickled = tmp_path / "pickled-run"
    shutil.copytree(run_dir, pickled)
    weights = pickled / "ssms/ssm-1/model.safetensors"
    weights.rename(weights.with_name("pytorch_model.bin"))
    with pytest.raises(ValueError, match="safetensors"):
        export_bundle(pickled, tmp_path / "b2")
    assert not (tmp_path / "b2").exists() and not list(tmp_path.glob(".b2.*"))


def test_cli_export_then_generate_from_the_bundle(run_dir, tmp_path, capsys):
    out = tmp_path / "cli-bundle"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert "drafters ssm-1 (ssm, draft vocabulary whole), ssm-2 (ssm" in capsys.readouterr().out
    rc = main(["generate", str(out), "Hello there", "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert rc == 0 and "tau" in captured.err and captured.out.strip()
    # Damage is reported as one line naming the file, exit code 2.
    _flip_byte(out)
    assert main(["generate", str(out), "Hello there"]) == 2
    assert "ssms/ssm-1/model.safetensors" in capsys.readouterr().err
    assert main(["generate", str(out), "Hello", "--ssm", "x"]) == 2
    bare = make_run_dir(tmp_path / "bare-run", n_ssms=1, scheduler=False, ranking=False)
    assert main(["export", str(bare), "--out", str(tmp_path / "bare-bundle")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "bare-bundle"), "Hello", "--draft-vocab", "8"]) == 2
    assert "no token ranking" in capsys.readouterr().err


def test_cli_serve_refuses_a_damaged_bundle_before_listening(copy, capsys):
    _delete(copy)
    assert main(["serve", str(copy), "--port", "0"]) == 2
    assert "ssms/ssm-2/model.safetensors" in capsys.readouterr().err
    assert main(["serve", str(copy), "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


def test_bundle_with_a_draft_vocabulary_decodes_losslessly(run_dir, tmp_path):
    from boosttune.assemble import engine_from_models
    from boosttune.serving.decode import incremental_generate
    from boosttune.serving.draft_vocab import load_ranking
    from boosttune.serving.stops import StopCriteria

    out = export_bundle(run_dir, tmp_path / "cut", draft_vocab=12).bundle
    m = _manifest(out)
    assert all(d["tree"]["draft_vocab"] == 12 for d in m["drafters"]) and m["draft_vocab"] == "draft_vocab.json"
    assert m["files"]["draft_vocab.json"]["sha256"] == sha256_file(run_dir / "draft_vocab.json")
    b = load_bundle(out)
    tree = b.manifest.drafters[0].tree
    assert tree.draft_vocab == 12
    assert b.ranking.tolist() == load_ranking(run_dir / "draft_vocab.json").tolist()
    engine = engine_from_models(b.llm.model, [s.model for s in b.models.values()], tree, ranking=b.ranking)
    ids = b.llm.tokenizer("Tell me a story")["input_ids"]
    stop = StopCriteria(max_new_tokens=20)
    res = engine.generate(ids, stop)
    assert res.tokens == incremental_generate(b.llm.model, ids, stop).tokens
    assert [d.runner.head_ids.numel() for d in engine.drafters.values()] == [12, 12]
    # A manifest asking for a draft vocabulary without shipping the ranking is refused.
    del m["draft_vocab"]
    _write_manifest(out, m)
    with pytest.raises(BundleError, match="tree.draft_vocab"):
        verify_bundle(out)


def test_export_of_a_draft_vocabulary_needs_the_run_ranking(tmp_path):
    bare = make_run_dir(tmp_path / "bare-run", n_ssms=1, scheduler=False, ranking=False)
    with pytest.raises(ValueError, match="--draft-vocab 8"):
        export_bundle(bare, tmp_path / "b", draft_vocab=8)
    assert _manifest(export_bundle(bare, tmp_path / "b").bundle)["draft_vocab"] is None


def test_bundle_default_prompt_lookup_serves_without_a_scheduler(tmp_path):
    """`export --prompt-lookup N` makes the server (no scheduler) draft with prompt lookup too."""
    from boosttune.http.server import ServerConfig, create_app
    from boosttune.serving.decode import incremental_generate
    from boosttune.serving.lookup import LOOKUP_NAME, PromptLookupDrafter
    from boosttune.serving.stops import StopCriteria

    bare = make_run_dir(tmp_path / "run", n_ssms=1, scheduler=False)
    out = export_bundle(bare, tmp_path / "b", prompt_lookup=4).bundle
    assert [(d["name"], d["kind"], d["dir"]) for d in _manifest(out)["drafters"]] == [
        ("ssm-1", "ssm", "ssms/ssm-1"), ("prompt-lookup", "prompt_lookup", None)]
    b = load_bundle(out)
    assert b.manifest.prompt_lookup == 4
    state = create_app(b, ServerConfig(model_name="m", torch_threads=1, warmup=False)).state.boosttune
    assert state.scheduler is None and state.drafter_names == ["ssm-1", "prompt-lookup"]
    engine = state.served.engine
    assert isinstance(engine.drafters[LOOKUP_NAME], PromptLookupDrafter) and engine.plan.trees[LOOKUP_NAME].max_depth == 4
    ids = b.llm.tokenizer("the cat sat on the mat and the cat sat on the")["input_ids"]
    stop = StopCriteria(max_new_tokens=16)
    assert engine.generate(ids, stop).tokens == incremental_generate(b.llm.model, ids, stop).tokens
    # a per-match table in the manifest's prompt-lookup tree (a scheduler's, exported without it) is served
    table = Path(shutil.copytree(out, tmp_path / "table"))
    m = _manifest(table)
    m["drafters"][1]["tree"]["ngram_depths"] = [1, 2]
    _write_manifest(table, m)
    from boosttune.assemble import from_bundle

    served = from_bundle(load_bundle(table))
    assert served.engine.plan.trees[LOOKUP_NAME].ngram_depths == (1, 2)
    assert served.engine.generate(ids, stop).tokens == incremental_generate(b.llm.model, ids, stop).tokens
    with pytest.raises(ValueError, match="--prompt-lookup"):
        export_bundle(bare, tmp_path / "b2", prompt_lookup=-1)
    m = _manifest(out)
    m["drafters"][1]["tree"]["widths"] = []
    _write_manifest(out, m)
    with pytest.raises(BundleError, match=r"drafters\[1\]\.tree"):
        verify_bundle(out)
    m = _as_format_1(_manifest(copy_of(out, tmp_path / "old")))
    m["prompt_lookup"] = -2
    _write_manifest(tmp_path / "old", m)
    with pytest.raises(BundleError, match="prompt_lookup"):
        verify_bundle(tmp_path / "old")


# -- Damage that the hashes cannot see (issue 14): the manifest itself, and files re-hashed after the change.


def _rehash(root: Path, rel: str) -> None:
    """Make the manifest agree with ``rel`` as it is now (size and sha256), as a forger would."""
    m = _manifest(root)
    m["files"][rel] = {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
    _write_manifest(root, m)


def _deep_manifest(root: Path) -> str:
    (root / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    return MANIFEST


def _huge_manifest(root: Path) -> str:
    """A valid manifest padded past the size cap: refused before it is parsed."""
    (root / MANIFEST).write_text(json.dumps(_manifest(root)) + " " * (1 << 20))
    return MANIFEST


def _float_format(root: Path) -> str:
    m = _manifest(root)
    m["format"] = float(BUNDLE_FORMAT)
    _write_manifest(root, m)
    return MANIFEST


def _bad_safetensors_header(root: Path) -> str:
    rel = "ssms/ssm-1/model.safetensors"
    data = bytearray((root / rel).read_bytes())
    data[8:16] = b"not json"  # the header's first bytes: its length prefix still says how long it is
    (root / rel).write_bytes(bytes(data))
    _rehash(root, rel)
    return rel


def _huge_safetensors_header_length(root: Path) -> str:
    rel = "ssms/ssm-2/model.safetensors"
    data = bytearray((root / rel).read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")
    (root / rel).write_bytes(bytes(data))
    _rehash(root, rel)
    return rel


def _config_wrong_type(root: Path) -> str:
    rel = "ssms/ssm-1/config.json"
    config = json.loads((root / rel).read_text())
    config["num_hidden_layers"] = "two"
    (root / rel).write_text(json.dumps(config))
    _rehash(root, rel)
    return rel


def _config_not_an_object(root: Path) -> str:
    rel = "ssms/ssm-2/config.json"
    (root / rel).write_text("[1, 2, 3]")
    _rehash(root, rel)
    return rel


def _symlinked_directory(root: Path) -> str:
    (root / "ssms" / "alias").symlink_to(root / "ssms" / "ssm-1", target_is_directory=True)
    return "ssms/alias"


@pytest.mark.parametrize("damage", [_deep_manifest, _huge_manifest, _float_format, _bad_safetensors_header,
                                    _huge_safetensors_header_length, _config_wrong_type, _config_not_an_object,
                                    _symlinked_directory])
def test_damage_behind_matching_hashes_is_refused_naming_the_file(copy, damage):
    """Each of these once ended in a raw traceback (RecursionError, a safetensors or transformers error)
    or was accepted; now load_bundle refuses it with a BundleError naming the file."""
    named = damage(copy)
    with pytest.raises(BundleError) as e:
        load_bundle(copy)
    assert named in str(e.value)


def test_a_manifest_at_the_size_cap_is_read(copy):
    """The cap refuses only what no export writes: a manifest padded up to just under it still loads."""
    from boosttune.serving.manifest import MAX_MANIFEST_BYTES

    text = json.dumps(_manifest(copy))
    (copy / MANIFEST).write_text(text + " " * (MAX_MANIFEST_BYTES - len(text)))
    assert verify_bundle(copy).manifest.format == BUNDLE_FORMAT


def _evaluation(speedups: dict[str, float]) -> dict:
    """A run report's evaluation section with these speed-ups (labels: ssm-K, feature, ensemble)."""
    singles = [{"ssm": k, "tau": 1.3, "speedup": v} for k, v in speedups.items() if k.startswith("ssm-")]
    out: dict = {"singles": singles, "plain": {"tau": 1.0}}
    for label in ("feature", "ensemble"):
        if label in speedups:
            out[label] = {"tau": 1.4, "speedup": speedups[label]}
    return out


def test_fastest_drafters_picks_the_measured_best_among_what_ships():
    from boosttune.export.bundle import fastest_drafters

    ev = _evaluation({"ssm-1": 1.05, "ssm-2": 1.17, "feature": 1.39, "ensemble": 0.7})
    best = fastest_drafters(ev, ["ssm-1", "ssm-2", "feature"])
    assert best.drafters == ["feature"] and best.speedup == 1.39
    assert best.others == {"ssm-1": 1.05, "ssm-2": 1.17, "ensemble": 0.7}
    # the feature head did not finish: the best SSM
    assert fastest_drafters(ev, ["ssm-1", "ssm-2"]).drafters == ["ssm-2"]
    # the ensemble is every evaluated SSM merged
    ens = fastest_drafters(_evaluation({"ssm-1": 0.9, "ssm-2": 0.95, "ensemble": 1.1}), ["ssm-1", "ssm-2"])
    assert ens.drafters == ["ssm-1", "ssm-2"] and ens.speedup == 1.1
    # an ensemble missing one of its SSMs is not an option
    assert fastest_drafters(_evaluation({"ssm-1": 0.9, "ssm-2": 0.95, "ensemble": 1.1}), ["ssm-1"]).drafters == ["ssm-1"]
    # not evaluated, or evaluated before speed was measured: no choice
    assert fastest_drafters(None, ["ssm-1"]) is None
    assert fastest_drafters({"singles": [{"ssm": "ssm-1", "tau": 1.2}]}, ["ssm-1"]) is None


def test_fastest_drafters_weighs_prompt_lookup_where_the_evaluation_measured_it(tmp_path):
    from boosttune.export.bundle import fastest_drafters

    ev = _evaluation({"ssm-1": 1.05, "ssm-2": 1.17, "feature": 1.39})
    ev["feature"]["lookup"] = {"prompt_lookup": 8, "tau": 1.9, "speedup": 1.52}
    ev["singles"][1]["lookup"] = {"prompt_lookup": 8, "tau": 1.6, "speedup": 1.12}
    best = fastest_drafters(ev, ["ssm-1", "ssm-2", "feature"])
    assert best.drafters == ["feature"] and best.prompt_lookup == 8 and best.speedup == 1.52
    assert best.others == {"ssm-1": 1.05, "ssm-2": 1.17, "ssm-2 + lookup 8": 1.12, "feature": 1.39}
    ev["feature"]["lookup"]["speedup"] = 1.2  # lookup slower with the head: the head alone
    best = fastest_drafters(ev, ["ssm-1", "ssm-2", "feature"])
    assert best.drafters == ["feature"] and best.prompt_lookup == 0
    # export ships the chosen lookup length unless --prompt-lookup says otherwise
    run = make_run_dir(tmp_path / "run", n_ssms=2, scheduler=False, ranking=False)
    report = json.loads((run / "report.json").read_text())
    report["evaluation"] = _evaluation({"ssm-1": 0.98, "ssm-2": 1.15})
    report["evaluation"]["singles"][0]["lookup"] = {"prompt_lookup": 6, "tau": 1.7, "speedup": 1.3}
    (run / "report.json").write_text(json.dumps(report))
    res = export_bundle(run, tmp_path / "b")
    assert res.choice.drafters == ["ssm-1"] and res.manifest.prompt_lookup == 6
    assert export_bundle(run, tmp_path / "b0", prompt_lookup=0).manifest.prompt_lookup == 0
    assert load_bundle(res.bundle).manifest.prompt_lookup == 6


def test_export_ships_what_the_run_measured_fastest_unless_told(tmp_path, capsys):
    """Without a learned scheduler every request drafts with every drafter a bundle ships, so export
    ships the run's fastest option (here SSM 2 alone, not the slower merged pair), says why, and ships
    what --drafters names or, with a scheduler, every SSM."""
    run = make_run_dir(tmp_path / "run", n_ssms=2, scheduler=False, ranking=False)
    report = json.loads((run / "report.json").read_text())
    report["evaluation"] = _evaluation({"ssm-1": 0.98, "ssm-2": 1.15, "ensemble": 0.86})
    (run / "report.json").write_text(json.dumps(report))
    res = export_bundle(run, tmp_path / "b")
    assert [s["name"] for s in _manifest(res.bundle)["drafters"]] == ["ssm-2"] and res.choice.drafters == ["ssm-2"]
    state = load_bundle(res.bundle)
    assert state.model_names == ["ssm-2"]
    assert main(["export", str(run), "--out", str(tmp_path / "cli")]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("drafters ssm-2: fastest in the run's evaluation, 1.15x") and "ensemble 0.86x" in line
    both = export_bundle(run, tmp_path / "both", drafters=["ssm-1", "ssm-2"])
    assert both.choice is None and [s["name"] for s in _manifest(both.bundle)["drafters"]] == ["ssm-1", "ssm-2"]
    # all slower than plain decoding: the fastest still ships, with a warning
    report["evaluation"] = _evaluation({"ssm-1": 0.7, "ssm-2": 0.8, "ensemble": 0.5})
    (run / "report.json").write_text(json.dumps(report))
    assert main(["export", str(run), "--out", str(tmp_path / "slow")]) == 0
    assert "slower than plain decoding" in capsys.readouterr().out
    # a learned scheduler chooses per request among the drafters it was trained for: ship those
    from test_scheduler import SPEC, costs, synthetic_records

    cfg = SchedulerConfig(prompts="unused", depths=(1, 2), pca_components=4, ridge_alphas=(1e-3,), prompt_lookup=False)
    fit_scheduler(synthetic_records(), costs(), SPEC, (1, 1), cfg, ["ssm-1", "ssm-2"]).save(RunDir(run).scheduler_file)
    sched = export_bundle(run, tmp_path / "sched")
    assert sched.choice is None and [s["name"] for s in _manifest(sched.bundle)["drafters"]] == ["ssm-1", "ssm-2"]
    fit_scheduler(synthetic_records(), costs(), SPEC, (1, 1), cfg, ["ssm-2", "ssm-1"]).save(RunDir(run).scheduler_file)
    assert [s["name"] for s in _manifest(export_bundle(run, tmp_path / "s2").bundle)["drafters"]] == ["ssm-1", "ssm-2"]
    # --drafters other than the scheduler's: the bundle ships without it (it would be refused at load)
    one = export_bundle(run, tmp_path / "one", drafters=["ssm-2"])
    assert one.manifest.scheduler_dir is None and load_bundle(one.bundle).scheduler_dir is None
    assert export_bundle(run, tmp_path / "same", drafters=["ssm-2", "ssm-1"]).manifest.scheduler_dir is not None
    atomic_write_json(RunDir(run).scheduler_file, {"kind": "test"})
    with pytest.raises(ValueError, match="scheduler"):
        export_bundle(run, tmp_path / "broken")


# -- Every file checked against what its kind needs and against the limits, before anything
# is allocated; each refusal one line naming the file (or the manifest field).

HEAD = "ssms/ssm-2"


def _make_feature_head(root: Path, tensors: dict | None = None, marker: object = None) -> None:
    """Turn drafter ssm-2 into a feature head (kind "feature": its marker and projection listed in the
    manifest and hashed), with ``tensors`` as its projection file and ``marker`` as its marker."""
    import torch
    from safetensors.torch import save_file

    from boosttune.core.feature_head import FORMAT, VERSION

    hidden = json.loads((root / HEAD / "config.json").read_text())["hidden_size"]
    save_file(tensors if tensors is not None else {"weight": torch.zeros(hidden, 2 * hidden)},
              str(root / HEAD / "feature_fc.safetensors"))
    marker = marker if marker is not None else {"format": FORMAT, "version": VERSION, "hidden_size": hidden}
    (root / HEAD / "feature_head.json").write_text(json.dumps(marker))
    m = _manifest(root)
    entry = next(d for d in m["drafters"] if d["dir"] == HEAD)
    entry["kind"] = "feature"
    entry["weights"].append(f"{HEAD}/feature_fc.safetensors")
    _write_manifest(root, m)
    for name in ("feature_fc.safetensors", "feature_head.json"):
        _rehash(root, f"{HEAD}/{name}")


def _edit_json(root: Path, rel: str, edit) -> None:
    data = json.loads((root / rel).read_text())
    edit(data)
    (root / rel).write_text(json.dumps(data))
    _rehash(root, rel)


def _unlist(root: Path, rel: str) -> None:
    (root / rel).unlink()
    m = _manifest(root)
    del m["files"][rel]
    if m.get("scheduler"):
        m["scheduler"]["files"] = [f for f in m["scheduler"]["files"] if f != rel]
    _write_manifest(root, m)


def _fc_without_weight(root: Path) -> str:
    import torch

    _make_feature_head(root, tensors={"bias": torch.zeros(4)})
    return f"{HEAD}/feature_fc.safetensors"


def _fc_wrong_shape(root: Path) -> str:
    import torch

    _make_feature_head(root, tensors={"weight": torch.zeros(3, 5)})
    return f"{HEAD}/feature_fc.safetensors"


def _marker_is_a_list(root: Path) -> str:
    _make_feature_head(root, marker=[])
    return f"{HEAD}/feature_head.json"


def _feature_without_marker(root: Path) -> str:
    _make_feature_head(root)
    _unlist(root, f"{HEAD}/feature_head.json")
    return "feature_head.json"


def _format_1_head_without_marker(root: Path) -> str:
    """Format 1 told a head by its listed marker: one listed without it was served as a plain SSM."""
    _make_feature_head(root)
    _unlist(root, f"{HEAD}/feature_head.json")
    _write_manifest(root, _as_format_1(_manifest(root)))
    return "feature_head.json"


def _unknown_hidden_act(root: Path) -> str:
    _edit_json(root, "ssms/ssm-1/config.json", lambda c: c.update(hidden_act="no-such-activation"))
    return "ssms/ssm-1/config.json"


def _bad_rope_scaling(root: Path) -> str:
    _edit_json(root, "ssms/ssm-1/config.json", lambda c: c.update(rope_scaling={"rope_type": "no-such-rope"}))
    return "ssms/ssm-1/config.json"


def _more_layers(root: Path) -> str:
    _edit_json(root, "ssms/ssm-1/config.json", lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 1))
    return "ssms/ssm-1"


def _fewer_layers(root: Path) -> str:
    _edit_json(root, "ssms/ssm-1/config.json", lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] - 1))
    return "ssms/ssm-1"


def _missing_tensor(root: Path) -> str:
    from safetensors.torch import load_file, save_file

    rel = "ssms/ssm-1/model.safetensors"
    tensors = load_file(str(root / rel))
    del tensors["model.norm.weight"]
    save_file(tensors, str(root / rel), metadata={"format": "pt"})
    _rehash(root, rel)
    return "ssms/ssm-1"


def _raising_chat_template(root: Path) -> str:
    rel = "tokenizer/chat_template.jinja"
    # the message has a line break: the refusal must still be one line
    (root / rel).write_text("{{ raise_exception('refused\\nby the template') }}")
    _rehash(root, rel)
    return rel


def _bad_tokenizer_json(root: Path) -> str:
    rel = "tokenizer/tokenizer.json"
    (root / rel).write_text('{"version": "1.0", ')
    _rehash(root, rel)
    return rel


def _huge_tree(root: Path) -> str:
    m = _manifest(root)
    m["drafters"][0]["tree"]["widths"] = [1000, 1000, 1000]
    _write_manifest(root, m)
    return "drafters[0].tree"


def _huge_format_1_lookup(root: Path) -> str:
    m = _as_format_1(_manifest(root))
    m["prompt_lookup"] = 10**9
    _write_manifest(root, m)
    return "prompt_lookup"


def _manifest_links_out(root: Path) -> str:
    outside = root.parent / "elsewhere.json"
    (root / MANIFEST).rename(outside)
    (root / MANIFEST).symlink_to(outside)
    return MANIFEST


def _no_scheduler_json(root: Path) -> str:
    _unlist(root, "scheduler/scheduler.json")
    return "scheduler.json"


def _deep_scheduler(root: Path) -> str:
    rel = "scheduler/scheduler.json"
    (root / rel).write_text("[" * 50_000 + "]" * 50_000)
    _rehash(root, rel)
    return rel


def _edit_scheduler(root: Path, edit) -> str:
    """Change the scheduler's body and its self-check digest, as a forger would."""
    from boosttune.scheduler.persist import digest

    rel = "scheduler/scheduler.json"

    def change(envelope: dict) -> None:
        edit(envelope["body"])
        envelope["sha256"] = digest(envelope["body"])

    _edit_json(root, rel, change)
    return rel


def _scheduler_wrong_type(root: Path) -> str:
    return _edit_scheduler(root, lambda body: body.update(meta=[], drafters=[]))


def _scheduler_huge_widths(root: Path) -> str:
    return _edit_scheduler(root, lambda body: body.update(widths=[100000]))


@pytest.mark.parametrize("damage", [
    _fc_without_weight, _fc_wrong_shape, _marker_is_a_list, _feature_without_marker, _format_1_head_without_marker,
    _unknown_hidden_act, _bad_rope_scaling, _more_layers, _fewer_layers, _missing_tensor, _raising_chat_template,
    _bad_tokenizer_json, _huge_tree, _huge_format_1_lookup, _manifest_links_out, _no_scheduler_json, _deep_scheduler,
    _scheduler_wrong_type, _scheduler_huge_widths,
])
def test_bundles_that_would_not_serve_as_trained_are_refused_in_one_line(copy, damage):
    """Each of these once crashed with a traceback, allocated without bound, or loaded silently
    degraded (random or dropped layers, a head served as a plain SSM, no scheduler). Now loading (and
    assembling what it serves, which reads the scheduler) refuses it with one line naming the file."""
    from boosttune.assemble import from_bundle

    named = damage(copy)
    with pytest.raises(ValueError) as e:  # BundleError, or SchedulerFileError from the assembly
        from_bundle(load_bundle(copy))
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_valid_feature_head_passes_its_kinds_checks(copy):
    """The positive control of the feature-head damage above: the same head, well formed, verifies."""
    _make_feature_head(copy)
    assert [d.kind for d in verify_bundle(copy).manifest.drafters] == ["ssm", "feature"]


def test_tree_limits_are_one_place_and_admit_the_shipped_trees():
    from boosttune.serving.lookup import lookup_tree
    from boosttune.serving.tree import MAX_TREE_DEPTH, MAX_TREE_NODES, TreeConfig

    TreeConfig(widths=(1, 1, 3, 1, 1, 1, 1, 1))
    TreeConfig(kind="dynamic", topk=10, depth=10, budget=MAX_TREE_NODES)
    lookup_tree(MAX_TREE_DEPTH)
    for bad in ({"widths": (1000, 1000, 1000)}, {"widths": (1,) * (MAX_TREE_DEPTH + 1)},
                {"kind": "dynamic", "topk": 64, "depth": 8}, {"kind": "dynamic", "budget": MAX_TREE_NODES + 1}):
        with pytest.raises(ValueError, match="tree"):
            TreeConfig(**bad)


def test_low_rank_ssms_travel_in_the_bundle_and_draft_stacked(tmp_path):
    """An SSM saved as SSM 1 plus rank-2 deltas with its factors (``boost.delta_rank``): the bundle carries
    and hashes the factor file, loading gives the model its factors, and a stacked engine drafts it with
    SSM 1's weights read once; the output stays plain decoding's."""
    from transformers import AutoModelForCausalLM

    from boosttune.assemble import engine_from_models
    from boosttune.core.low_rank import DELTA_FILE, cut_to_rank, save_factors
    from boosttune.http.server import ServerConfig, create_app
    from boosttune.serving.decode import incremental_generate
    from boosttune.serving.stacked import StackedMember
    from boosttune.serving.stops import StopCriteria
    from boosttune.serving.tree import TreeConfig

    run = make_run_dir(tmp_path / "run", n_ssms=2)
    ssm2 = RunDir(run).ssm_dir(2)
    first = AutoModelForCausalLM.from_pretrained(RunDir(run).ssm_dir(1))
    second = AutoModelForCausalLM.from_pretrained(ssm2)
    second.model.embed_tokens, second.lm_head = first.model.embed_tokens, first.lm_head  # frozen, shared
    factors, _ = cut_to_rank(first, second, 2)
    second.save_pretrained(ssm2)
    save_factors(ssm2, factors)
    out = export_bundle(run, tmp_path / "bundle").bundle
    files = _manifest(out)["files"]
    assert f"ssms/ssm-2/{DELTA_FILE}" in files and f"ssms/ssm-1/{DELTA_FILE}" not in files
    loaded = load_bundle(out)
    assert not hasattr(loaded.models["ssm-1"].model, "low_rank_delta")
    assert set(loaded.models["ssm-2"].model.low_rank_delta) == set(factors)
    llm = loaded.llm.model
    engine = engine_from_models(llm, {n: m.model for n, m in loaded.models.items()}, TreeConfig(widths=(2, 1)),
                                stack_ssms=True)
    group = engine.drafters["ssm-1"].group
    assert all(ly[n].low_rank is not None for ly in group._layers for n in ("qkv", "o", "gate_up", "down"))
    assert group._full_head.shared
    prompt, stop = [5, 9, 13, 2, 7], StopCriteria(max_new_tokens=16)
    assert engine.generate(prompt, stop).tokens == incremental_generate(llm, prompt, stop).tokens
    # the server stacks them by default (its --stack-ssms auto), and keeps them apart when told to
    for mode, stacked in (("auto", True), ("off", False)):
        config = ServerConfig(model_name="m", torch_threads=1, warmup=False, stack_ssms=mode)
        drafters = create_app(loaded, config).state.boosttune.served.engine.drafters
        assert [isinstance(drafters[n], StackedMember) for n in ("ssm-1", "ssm-2")] == [stacked] * 2
    with pytest.raises(ValueError, match="stack_ssms"):
        ServerConfig(stack_ssms="yes")
