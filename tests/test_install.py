"""A wheel install and an editable install both provide boosttune's four packages, and nothing top level.

PyPI has unrelated distributions called `kernels` and `scheduler` (DESIGN.md, "Layout and import
names"), so our folders must install only as `boosttune.kernels`, `boosttune.scheduler` and
`boosttune.serving`. Each install goes into a fresh virtual environment without system site
packages and without torch or transformers, which also proves that the package `__init__` files stay
import-light. Nothing is downloaded: builds use this environment's setuptools (--no-build-isolation)
and installs use --no-deps --no-index.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {  # import name -> folder in the repository
    "boosttune": "boosttune",
    "boosttune.core": "boosttune/core",
    "boosttune.train": "boosttune/train",
    "boosttune.train.teacher": "boosttune/train/teacher",
    "boosttune.export": "boosttune/export",
    "boosttune.cli": "boosttune/cli",
    "boosttune.serving": "serving",
    "boosttune.http": "boosttune/http",
    "boosttune.kernels": "boosttune/kernels",
    "boosttune.scheduler": "scheduler",
    "boosttune.scheduler.offline": "scheduler/offline",
    "boosttune.data": "data",
}
FOREIGN = ["kernels", "scheduler", "serving"]  # must not be importable as top-level modules

# Run by the fresh environment's python: where each module comes from, whether the foreign names
# resolve, which non-stdlib modules importing ours pulled in, and the default prompts' line count (the
# data files install with the code: sources.py reads them through importlib.resources).
PROBE = f"""
import importlib, importlib.resources, importlib.util, json, sys
files = {{name: importlib.import_module(name).__file__ for name in {list(PACKAGES)!r}}}
foreign = {{name: importlib.util.find_spec(name) is not None for name in {FOREIGN!r}}}
loaded = sorted({{m.split(".")[0] for m in sys.modules}} - set(sys.stdlib_module_names) - {{"__main__"}})
seeds = importlib.resources.files("boosttune.data").joinpath("prompts/seeds.jsonl").read_text(encoding="utf-8")
print(json.dumps({{"files": files, "foreign": foreign, "loaded": loaded, "seeds": len(seeds.splitlines())}}))
"""


def run(*args: str | Path, cwd: Path | None = None, stderr: bool = False) -> str:
    """The command's standard output (``stderr``: followed by its standard error); it must succeed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + (result.stderr if stderr else "")


def no_packaging_warnings(build_output: str) -> None:
    """setuptools found nothing to warn about in our packaging (a data folder left out of ``packages``
    printed a screenful at every install)."""
    assert "_Warning:" not in build_output and "`packages` configuration" not in build_output, build_output


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's build inputs copied to a temporary folder, so build outputs never touch the repo."""
    src = tmp_path_factory.mktemp("install") / "src"
    src.mkdir()
    shutil.copy2(REPO / "pyproject.toml", src)
    readme = REPO / "README.md"
    if readme.is_file():
        shutil.copy2(readme, src)
    else:  # pyproject names a readme; it may not be written yet
        (src / "README.md").write_text("# boosttune\n")
    for folder in sorted({f.split("/")[0] for f in PACKAGES.values()}):  # subpackages come with their parents
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


def fresh_venv(path: Path) -> Path:
    """A new virtual environment without system site packages; returns its python."""
    # --without-pip: installs are done by this environment's pip (--python or --prefix), which is
    # much faster than bootstrapping pip into every venv.
    run(sys.executable, "-m", "venv", "--without-pip", path)
    python = path / "bin" / "python"
    assert python.exists()
    return python


def probe(python: Path, cwd: Path) -> dict:
    # -I: ignore PYTHON* variables and keep the working directory off sys.path.
    return json.loads(run(python, "-I", "-c", PROBE, cwd=cwd))


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def test_wheel_install(source_copy: Path) -> None:
    work = source_copy.parent
    dist = work / "dist"
    built = run(sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index",
                "-w", dist, source_copy, stderr=True)  # fmt: skip
    no_packaging_warnings(built)
    (wheel,) = dist.glob("boosttune-*.whl")
    venv = work / "venv-wheel"
    python = fresh_venv(venv)
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel)

    outside = work / "elsewhere"
    outside.mkdir()
    result = probe(python, outside)
    site = site_packages(venv).resolve()
    for name, file in result["files"].items():
        expected = site.joinpath(*name.split("."), "__init__.py")
        assert Path(file).resolve() == expected, name
    assert not any(result["foreign"].values()), result["foreign"]
    assert result["loaded"] == ["boosttune"]  # no torch, transformers, ... at package import time
    assert result["seeds"] > 10
    assert not any((site / name).exists() for name in FOREIGN)


def test_editable_install(source_copy: Path) -> None:
    work = source_copy.parent
    venv = work / "venv-editable"
    python = fresh_venv(venv)
    # The fresh venv has no setuptools and there is no network, so this environment builds the
    # editable wheel (PEP 660, setuptools' build_editable) and pip --python installs it there.
    # Not `pip install --prefix VENV -e`: that uninstalls this environment's own boosttune first.
    dist = work / "dist-editable"
    dist.mkdir()
    built = run(sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_editable({str(dist)!r}))",
                cwd=source_copy, stderr=True)
    no_packaging_warnings(built)
    (wheel,) = dist.glob("*.whl")
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel)

    outside = work / "elsewhere-editable"
    outside.mkdir()
    result = probe(python, outside)
    for name, folder in PACKAGES.items():
        expected = source_copy.resolve() / folder / "__init__.py"
        assert Path(result["files"][name]).resolve() == expected, name
    assert not any(result["foreign"].values()), result["foreign"]
    assert [m for m in result["loaded"] if not m.startswith("__editable__")] == ["boosttune"]
    assert result["seeds"] > 10


def test_no_top_level_folder_shadows_an_installed_module() -> None:
    """From the repo root (on sys.path under ``python -m``), no folder of ours hides a real module.

    transformers 5.25 depends on HF's ``kernels`` and imports it; a top-level ``kernels/`` folder
    made ``python -m pytest`` and every ``python -m boosttune.cli`` run from a clone fail there.
    """
    import importlib.metadata

    installed = importlib.metadata.packages_distributions()
    ours = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    assert {"boosttune", "serving", "scheduler"} <= ours
    clashes = {name: installed[name] for name in ours - {"boosttune"} if name in installed}
    assert not clashes, f"top-level folders shadow installed modules: {clashes}"
    # The import that broke: transformers' model classes, with the repo root first on sys.path.
    run(sys.executable, "-c", "from transformers import LlamaConfig", cwd=REPO)
