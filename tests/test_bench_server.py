"""scripts/bench_server.py against real `boosttune serve` processes: one at a time and batched, in one run."""

from __future__ import annotations

import json

from bundle_fixtures import make_run_dir, one_torch_thread  # noqa: F401 (autouse fixture)
from conftest import load_script

from boosttune.export.bundle import export_bundle


def test_one_at_a_time_and_batched_servers_in_one_run_give_the_same_answers(tmp_path, capsys):
    bundle = export_bundle(make_run_dir(tmp_path / "run"), tmp_path / "bundle").bundle
    out = tmp_path / "server.json"
    code = load_script("bench_server").main([
        str(bundle), "--servers", "one,batched", "--max-batch", "4", "--concurrency", "1,4", "--requests", "6",
        "--max-tokens", "8", "--threads", "1", "--no-chat", "--out", str(out)])
    assert code == 0
    summary = json.loads(out.read_text())
    levels = {(r["server"], r["concurrency"]): r for r in summary["levels"]}
    assert set(levels) == {("one", 1), ("one", 4), ("batched", 1), ("batched", 4)}
    for (server, _), r in levels.items():
        assert r["requests"] == 6 and r["completion_tokens"] > 0
        assert r["latency_p50_s"] <= r["latency_p95_s"] <= r["latency_p99_s"]
        # fp32 greedy: the batched server's answers are the one-at-a-time server's, request by request
        assert r["identical_to_one_at_a_time"] == (None if server == "one" else 6)
    ratios = {}
    for server in ("one", "batched"):  # 4 clients' p50 against the same server's 1-client p50
        ratios[server] = levels[(server, 4)]["latency_p50_s"] / levels[(server, 1)]["latency_p50_s"]
        assert levels[(server, 4)]["p50_over_one_client"] == ratios[server]
        assert levels[(server, 1)]["p50_over_one_client"] is None
    table = capsys.readouterr().out
    assert "same answers" in table and "6/6" in table
    assert "p50 / 1 client" in table and all(f"{r:.2f}x" in table for r in ratios.values())
