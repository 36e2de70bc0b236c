"""Drafter kinds (serving/kinds.py): a kind registered from outside the package is exported, checked,
loaded and served like the built-in ones, with no other file changed; an unknown kind is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bundle_fixtures import make_run_dir, one_torch_thread  # noqa: F401 (autouse fixture)

from boosttune.assemble import from_bundle
from boosttune.core.kind_file import KIND_FILE, declare_kind, declared_kind
from boosttune.core.rundir import RunDir
from boosttune.export.bundle import export_bundle
from boosttune.http.server import ServerConfig, create_app
from boosttune.serving import kinds
from boosttune.serving.bundle import load_bundle, verify_bundle
from boosttune.serving.decode import incremental_generate
from boosttune.serving.drafter import SSMDrafter
from boosttune.serving.manifest import MANIFEST, BundleError
from boosttune.serving.stops import StopCriteria

TOY = "toy-chain"
NOTE = "toy.json"


class ChainDrafter(SSMDrafter):
    """An SSM that drafts a chain of its argmaxes whatever widths its tree asks for."""

    def draft(self, committed, tree, sampling, generator):
        from dataclasses import replace

        return super().draft(committed, replace(tree, widths=(1,) * tree.max_depth), sampling, generator)


class ToyKind(kinds.DrafterKind):
    """A model kind with a file of its own, which it requires and ships."""

    name = TOY
    phase = "stages"

    def check(self, directory):
        super().check(directory)
        if not (directory / NOTE).is_file():
            raise ValueError(f"a {TOY} drafter needs {NOTE}")

    def ships(self, directory):
        return ["config.json", "model.safetensors", NOTE]

    def drafter(self, model, vocab_size, ranking):
        from boosttune.serving.lean import drafter_runner

        return ChainDrafter(drafter_runner(model), vocab_size=vocab_size, ranking=ranking)


@pytest.fixture
def toy_kind():
    kinds.register(ToyKind)
    yield
    kinds.unregister(TOY)


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory) -> Path:
    root = make_run_dir(tmp_path_factory.mktemp("toy-run"), n_ssms=2, scheduler=False)
    second = RunDir(root).ssm_dir(2)
    declare_kind(second, TOY)
    (second / NOTE).write_text("{}\n")
    return root


def test_a_registered_kind_is_exported_and_served(toy_kind, toy_run, tmp_path):
    out = export_bundle(toy_run, tmp_path / "bundle").bundle
    m = json.loads((out / MANIFEST).read_text())
    assert [(d["name"], d["kind"]) for d in m["drafters"]] == [("ssm-1", "ssm"), ("ssm-2", TOY)]
    assert f"ssms/ssm-2/{NOTE}" in m["files"] and "ssms/ssm-1/" + NOTE not in m["files"]
    bundle = load_bundle(out)
    state = create_app(bundle, ServerConfig(model_name="m", torch_threads=1, warmup=False)).state.boosttune
    engine = state.served.engine
    assert type(engine.drafters["ssm-2"]) is ChainDrafter and type(engine.drafters["ssm-1"]) is SSMDrafter
    ids = bundle.llm.tokenizer("Tell me a story about a cat")["input_ids"]
    stop = StopCriteria(max_new_tokens=16)
    res = engine.generate(ids, stop)
    assert res.tokens == incremental_generate(bundle.llm.model, ids, stop).tokens  # lossless whatever drafts
    assert set(res.proposer_hits) <= {"ssm-1", "ssm-2"}
    # its own check runs at load: without its file, the bundle is refused naming the directory
    (out / "ssms/ssm-2" / NOTE).unlink()
    del m["files"][f"ssms/ssm-2/{NOTE}"]
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(BundleError, match=f"ssms/ssm-2.*{NOTE}"):
        verify_bundle(out)


def test_an_unregistered_kind_is_refused_by_name(toy_run, tmp_path):
    with kinds_registered(ToyKind):
        out = export_bundle(toy_run, tmp_path / "bundle").bundle
    with pytest.raises(BundleError, match=f"unknown drafter kind '{TOY}'"):
        verify_bundle(out)
    with pytest.raises(ValueError, match="unknown drafter kind"):
        kinds.directory_kind(RunDir(toy_run).ssm_dir(2))


def test_kinds_are_named_once_and_declared_in_directories(tmp_path):
    assert {"ssm", "feature", "prompt_lookup"} <= set(kinds.kind_names())
    with pytest.raises(ValueError, match="registered already"):
        class Other(kinds.DrafterKind):
            name = "ssm"

        kinds.register(Other)
    assert declared_kind(tmp_path) == "ssm"  # nothing declared, no feature-head file: an SSM (migration)
    (tmp_path / "feature_head.json").write_text("{}")
    assert declared_kind(tmp_path) == "feature"  # a feature head from before kinds were declared
    declare_kind(tmp_path, "ssm")
    assert declared_kind(tmp_path) == "ssm"  # the declaration wins
    (tmp_path / KIND_FILE).write_text("[1]")
    with pytest.raises(ValueError, match=KIND_FILE):
        declared_kind(tmp_path)


def test_the_bundle_default_plan_gives_each_drafter_its_own_tree(toy_kind, toy_run, tmp_path):
    """Each drafter drafts on the tree the manifest records for it (one owner, no reconciliation)."""
    out = export_bundle(toy_run, tmp_path / "bundle", prompt_lookup=3).bundle
    m = json.loads((out / MANIFEST).read_text())
    m["drafters"][1]["tree"]["widths"] = [2]
    (out / MANIFEST).write_text(json.dumps(m))
    served = from_bundle(load_bundle(out), use_scheduler=False)
    trees = served.engine.plan.trees
    assert trees["ssm-1"].widths == (1, 2, 1) and trees["ssm-2"].widths == (2,)
    assert trees["prompt-lookup"].max_depth == 3


class kinds_registered:
    """``with kinds_registered(K):`` the kind ``K`` is registered inside the block only."""

    def __init__(self, cls: type[kinds.DrafterKind]):
        self.cls = cls

    def __enter__(self):
        kinds.register(self.cls)

    def __exit__(self, *exc):
        kinds.unregister(self.cls.name)
