"""scripts/bench_scale.py on its tiny shapes: the JSON it writes, the tables it prints, the formula."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_script


@pytest.fixture(scope="module")
def bench_scale():
    """scripts/bench_scale.py (not a package), loaded from its file."""
    return load_script("bench_scale")


def test_tiny_run_writes_every_figure_and_prints_the_tables(bench_scale, tmp_path, capsys):
    out = tmp_path / "scale" / "bench_scale.json"
    assert bench_scale.main(["--shapes", "tiny", "--device", "cpu", "--dtype", "fp32", "--repeats", "1",
                             "--prefixes", "16,32", "--tree-tokens", "1,4", "--tau", "1.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dtype"] == "fp32" and result["formula"] == bench_scale.FORMULA
    assert result["taus"] == {"SpS tau 2.29": 2.29, "EAGLE tau 3.57": 3.57, "tau 1.5": 1.5}
    tiny = result["shapes"]["tiny"]
    assert tiny["runner"] == "LeanRunner" and tiny["params"] > 0 and tiny["peak_memory_mib"] > 0
    for p in ("16", "32"):
        assert tiny["plain_ms"][p] > 0 and set(tiny["verify_ms"][p]) == set(tiny["verify_ratio"][p]) == {"1", "4"}
    assert set(tiny["drafters"]) == {"ssm-135m", "ssm-4layer", "feature-head"}
    for d in tiny["drafters"].values():
        assert set(d["draft_ms"]) == set(d["c"]) == {"16", "32"}
        assert d["c"]["16"] == pytest.approx(d["draft_ms"]["16"] / tiny["plain_ms"]["16"])
    assert tiny["drafters"]["feature-head"]["config"]["hidden"] == tiny["config"]["hidden"]
    assert {d["config"]["vocab"] for d in tiny["drafters"].values()} == {tiny["config"]["vocab"]}
    assert len(tiny["predicted"]) == 3 * 2  # drafters x prefixes, T = 4 only (T = 1 verifies no tree)
    printed = capsys.readouterr().out
    assert "tiny:" in printed and "T=4 ms (ratio)" in printed and "feature-head" in printed
    assert "EAGLE tau 3.57" in printed and bench_scale.FORMULA in printed


def test_predicted_speedup_is_the_stated_formula(bench_scale):
    llm = {"verify_ratio": {"512": {"1": 1.0, "16": 1.5}}}
    (row,) = bench_scale.predict(llm, {"ssm": {"c": {"512": 0.1}}}, {"x": 3.0}, depth=4)
    assert row["tree_tokens"] == 16 and row["speedup"]["x"] == pytest.approx(3.0 / (1 + 0.1 * 4 + (1.5 - 1)))


def test_the_verified_tree_is_binary_over_the_fed_tokens(bench_scale):
    tree = bench_scale.tree_of(7, 50, torch.Generator().manual_seed(0))
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2] and tree.depth.tolist() == [1, 2, 2, 3, 3, 3]
    assert bench_scale.tree_of(1, 50, torch.Generator()).size == 0


def test_bad_flags_are_refused_naming_them(bench_scale, capsys):
    for argv, says in ((["--shapes", "70b"], "--shapes"), (["--device", "gpu"], "--device"),
                       (["--tau", "0.5"], "--tau")):
        with pytest.raises(SystemExit):
            bench_scale.main(argv)
        assert says in capsys.readouterr().err
