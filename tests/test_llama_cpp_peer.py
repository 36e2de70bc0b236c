"""llama.cpp's llama-server as bench's peer, against a real binary (skipped where none is built: CI never builds it).

The binary comes from $BOOSTTUNE_LLAMA_SERVER or where scripts/build_llama_server.sh puts it by default.
Every server runs with one thread, on the default LLM's own GGUF (also the stand-in draft model).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import MT_BENCH

from boosttune.cli import main
from boosttune.core.models import default_gguf_path, eos_token_ids, load_model
from boosttune.core.prompts import encode_prompt
from boosttune.llama_cpp import LlamaServer, default_server_path, find_server, method_args
from boosttune.serving.decode import incremental_generate
from boosttune.serving.stops import StopCriteria


def _binary():
    try:
        return find_server(None)
    except ValueError:
        return None


BINARY = _binary()
needs_binary = pytest.mark.skipif(
    BINARY is None,
    reason=f"no llama-server binary (set BOOSTTUNE_LLAMA_SERVER or build one at {default_server_path()} with "
           "`bash scripts/build_llama_server.sh`)",
)


@pytest.fixture(scope="module")
def default_llm():
    return load_model("default")


def _server(tmp_path, extra=(), name="llama"):
    return LlamaServer(BINARY, default_gguf_path(), threads=1, ctx_size=512, extra=list(extra),
                       log_path=tmp_path / f"{name}.log")


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2):
            return True
    except (urllib.error.URLError, ConnectionError):
        return False


@needs_binary
def test_greedy_completion_from_token_ids_without_prompt_reuse(tmp_path, default_llm):
    ids = encode_prompt(default_llm.tokenizer, "Name three colours.")
    with _server(tmp_path) as server:
        first = server.complete(ids, 16)
        again = server.complete(ids, 16)
        url = server.url
    assert 0 < len(first.tokens) <= 16 and first.tokens == again.tokens  # greedy: the same answer twice
    assert first.timings["predicted_n"] == len(first.tokens) and first.timings["predicted_per_second"] > 0
    assert first.timings["prompt_n"] == len(ids)  # the ids as sent: no BOS added, nothing cut
    assert again.timings["cache_n"] == 0 and again.timings["prompt_n"] == len(ids)  # no reuse between requests
    assert first.wall_time > 0 and not _alive(url)  # stopped on leaving the block


@needs_binary
def test_stops_at_eos_like_our_decoding(tmp_path, default_llm):
    """A short answer: both llama.cpp and incremental decoding end with the EOS token and keep it."""
    ids = encode_prompt(default_llm.tokenizer, "Answer with one word: is water wet?")
    eos = eos_token_ids(default_llm)
    ours = incremental_generate(default_llm.model, ids, StopCriteria(max_new_tokens=48, eos_token_ids=eos))
    with _server(tmp_path) as server:
        peer = server.complete(ids, 48)
    assert ours.finish_reason == "stop" and ours.tokens[-1] in eos
    assert peer.finish_reason == "stop" and peer.tokens[-1] in eos
    assert len(peer.tokens) < 48


@needs_binary
def test_stopped_on_errors_and_ctrl_c(tmp_path):
    server = _server(tmp_path)
    with pytest.raises(KeyboardInterrupt), server:
        url, proc = server.url, server.proc
        raise KeyboardInterrupt
    assert proc.poll() is not None and not _alive(url)


@needs_binary
def test_bench_runs_the_llama_cpp_methods(tmp_path, capsys):
    out = tmp_path / "bench"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bench gives llama-server as many threads as torch has
    try:
        rc = main([
            "bench", "--llm", "default", "--questions", str(MT_BENCH), "--limit", "2", "--max-new-tokens", "16",
            "--methods", "baseline,llama,llama_draft,llama_ngram", "--draft-gguf", str(default_gguf_path()),
            "--llama-server", str(BINARY), "--out", str(out),
        ])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    info = summary["llama_cpp"]
    assert info["threads"] == 1 and info["llm_gguf"] == str(default_gguf_path())
    for m in ["llama", "llama_draft", "llama_ngram"]:
        assert summary[f"{m}_tokens_per_s"] > 0 and summary[f"{m}_identical"] in range(3)
        assert info["methods"][m]["prompt_cache_n"] == 0 and info["methods"][m]["predicted_n"] > 0
        rows = [json.loads(line) for line in (out / f"{m}.jsonl").read_text().splitlines()]
        assert [r["question_id"] for r in rows] == ["81", "82"]
        choice = rows[0]["choices"][0]
        assert 0 < choice["new_tokens"][0] <= 16 and choice["llama_timings"][0]["predicted_n"] == choice["new_tokens"][0]
        assert (out / f"{m}.llama-server.log").is_file()
    assert info["methods"]["llama_draft"]["args"][:2] == ["--model-draft", str(default_gguf_path())]
    # the LLM drafting for itself: llama.cpp accepts (nearly) every drafted token
    assert info["methods"]["llama_draft"]["draft_n"] > 0 and summary["llama_draft_acceptance"] > 0.8
    assert summary["llama_acceptance"] is None
    for m in ["llama_draft", "llama_ngram"]:  # llama.cpp's greedy speculation keeps its own plain answers
        assert info["methods"][m]["identical_to_llama"] == 2
    assert summary["methods"] == ["baseline", "llama", "llama_draft", "llama_ngram"]
    table = capsys.readouterr().out.split("\n{")[0]  # the table, before the summary's JSON
    assert "llama_draft (llama.cpp)" in table and "accept" in table and "hf_assisted" not in table


@needs_binary
def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path, capsys):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(64))  # the right magic bytes, then garbage: llama.cpp refuses it
    rc = main([
        "bench", "--llm", "default", "--questions", str(MT_BENCH), "--limit", "1", "--max-new-tokens", "4",
        "--methods", "baseline,llama_draft", "--draft-gguf", str(broken), "--llama-server", str(BINARY),
        "--out", str(tmp_path / "o"),
    ])
    err = capsys.readouterr().err
    assert rc == 1 and "llama-server" in err and "exited" in err


def test_method_flags_name_llama_cpp_options():
    assert method_args("llama", None, None, None) == []
    assert method_args("llama_ngram", None, None, 5)[:2] == ["--spec-type", "ngram-simple"]
    assert "--spec-ngram-simple-size-m" in method_args("llama_ngram", None, 4, None)
    with pytest.raises(ValueError, match="--draft-gguf"):
        method_args("llama_draft", None, None, None)
    eagle3 = Path("eagle3.f16.gguf")
    assert method_args("llama_eagle3", None, 4, None, eagle3) == [
        "--model-draft", "eagle3.f16.gguf", "--spec-type", "draft-eagle3", "--spec-draft-n-max", "4"]
    with pytest.raises(ValueError, match="--eagle3-gguf"):
        method_args("llama_eagle3", None, None, None)


def test_eagle3_method_and_its_gguf_come_together(tmp_path):
    from boosttune.bench import BenchConfig

    head = tmp_path / "eagle3.f16.gguf"
    head.write_bytes(b"GGUF" + bytes(60))
    base = {"questions": str(MT_BENCH), "out": str(tmp_path / "o"), "llm": "default", "llama_server": sys.executable}
    with pytest.raises(ValueError, match="needs --eagle3-gguf"):
        BenchConfig(**base, methods=("baseline", "llama_eagle3")).llama_paths()
    with pytest.raises(ValueError, match="--eagle3-gguf is used by the 'llama_eagle3' method only"):
        BenchConfig(**base, methods=("baseline", "llama"), eagle3_gguf=str(head)).llama_paths()
    assert BenchConfig(**base, methods=("llama", "llama_eagle3"), eagle3_gguf=str(head)).llama_paths()[3] == head


@needs_binary
def test_forward_cost_script_prints_one_row_per_size(capsys):
    from conftest import load_script

    script = load_script("llama_forward_cost")
    assert script.main([str(default_gguf_path()), "--tokens", "1,3", "--repeats", "1", "--llama-server", str(BINARY)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert [r[1] for r in rows] == ["1", "3"] and rows[0][3] == "1.00" and float(rows[1][2]) > 0
