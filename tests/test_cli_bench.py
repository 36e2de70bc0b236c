"""`boosttune bench` / `generate` end to end on tiny random models with the default's tokenizer."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import MT_BENCH, load_script, perturbed, tiny_llama
from transformers import AutoTokenizer

from boosttune.cli import main
from boosttune.core.models import resolve_model_path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """An LLM and an SSM (a noisy copy) with the default LLM's 49,152-token tokenizer."""
    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    root = tmp_path_factory.mktemp("models")
    llm = tiny_llama(21, vocab=len(tok), hidden=32, init=0.1)
    llm.config.eos_token_id = tok.eos_token_id
    ssm = perturbed(llm, 22, noise=0.1)
    for name, model in [("llm", llm), ("ssm", ssm)]:
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    other = tiny_llama(23, vocab=64, hidden=32)
    other.save_pretrained(root / "other")
    AutoTokenizer.from_pretrained(resolve_model_path("default")).save_pretrained(root / "other")
    return root


def test_bench_writes_spec_bench_answers_and_summary(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main([
        "bench", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "--questions", str(MT_BENCH),
        "--limit", "3", "--max-new-tokens", "12", "--widths", "2,1,1", "--out", str(out),
    ])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ["tau", "tokens_per_s", "baseline_tokens_per_s", "hf_assisted_tokens_per_s", "speedup_vs_baseline",
                "speedup_vs_hf_assisted", "greedy_identical", "total", "dtype"]:
        assert key in summary, key
    assert summary["total"] == 3 and summary["greedy_identical"] == 3 and summary["dtype"] == "fp32"
    assert summary["tau"] >= 1.0
    for method in ["baseline", "hf_assisted", "ours"]:
        rows = [json.loads(line) for line in (out / f"{method}.jsonl").read_text().splitlines()]
        assert [r["question_id"] for r in rows] == ["81", "82", "83"]
        choice = rows[0]["choices"][0]
        assert set(choice) >= {"turns", "new_tokens", "wall_time", "accept_lengths"}
        assert choice["new_tokens"][0] > 0 and choice["wall_time"][0] > 0
    ours = [json.loads(line) for line in (out / "ours.jsonl").read_text().splitlines()]
    assert all(sum(r["choices"][0]["accept_lengths"]) == r["choices"][0]["new_tokens"][0] for r in ours)
    # what each request drafted with (here the default plan), per answer and counted in the summary
    assert all(r["choices"][0]["plan"] == summary["plan"] for r in ours)
    assert summary["plans"] == {"ssm-1[2,1,1]": 3}
    assert all(set(r["choices"][0]["proposer_hits"]) == {"ssm-1"} for r in ours)
    printed = capsys.readouterr().out
    assert "greedy_identical=3" in printed and "ours drafted with: ssm-1[2,1,1] x3" in printed


def test_bench_baseline_runs_through_the_engines_llm_runner_beside_transformers(tiny_dirs, tmp_path, capsys):
    """The baseline is plain decoding through the runner ours verifies with (speed-ups measure speculation
    alone); hf_plain is transformers' own incremental decoding, the same tokens in fp32."""
    out = tmp_path / "bench"
    assert main(["bench", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "--questions", str(MT_BENCH),
                 "--limit", "2", "--max-new-tokens", "8", "--methods", "baseline,hf_plain,ours", "--out", str(out),
                 "--device", "cpu"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["llm_runner"] == "LeanRunner" and summary["hf_plain_tokens_per_s"] > 0
    assert summary["device"] == "cpu"  # every method's models and inputs
    assert summary["hf_plain_identical"] == summary["greedy_identical"] == 2
    assert "hf_plain (transformers)" in capsys.readouterr().out
    baseline = [json.loads(line) for line in (out / "baseline.jsonl").read_text().splitlines()]
    assert all(r["choices"][0]["plan"] == {} and set(r["choices"][0]["accept_lengths"]) == {1} for r in baseline)


def test_bench_with_a_compiled_llm_stays_identical_to_transformers(tiny_dirs, tmp_path, capsys):
    """--compile: baseline and ours run the compiled LLM forward; fp32 answers are transformers' own."""
    out = tmp_path / "bench"
    assert main(["bench", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "--questions", str(MT_BENCH),
                 "--limit", "2", "--max-new-tokens", "8", "--methods", "baseline,hf_plain,ours", "--out", str(out),
                 "--compile"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["llm_compiled"] is True and summary["compile_s"] > 0
    assert summary["hf_plain_identical"] == summary["greedy_identical"] == 2
    assert "LLM runner=LeanRunner compiled" in capsys.readouterr().out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_bench_with_a_quantized_llm_compares_speculation_with_its_plain_decoding(tiny_dirs, tmp_path, capsys, scheme):
    """--quantize: baseline and ours run the quantized LLM, and ours equals its plain decoding (fp32);
    hf_plain stays the unquantized LLM, the reference its answers are compared with."""
    out = tmp_path / "bench"
    assert main(["bench", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "--questions", str(MT_BENCH),
                 "--limit", "2", "--max-new-tokens", "8", "--methods", "baseline,hf_plain,ours", "--out", str(out),
                 "--quantize", scheme]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["llm_quantized"] == scheme and summary["greedy_identical"] == 2
    assert f"LLM runner=LeanRunner {scheme}" in capsys.readouterr().out


def test_bench_with_prompt_lookup_alone_against_hf_prompt_lookup(tiny_dirs, tmp_path):
    """No SSM: ours drafts by prompt lookup only; HF's prompt lookup decoding is the peer."""
    out = tmp_path / "bench"
    rc = main([
        "bench", "--llm", str(tiny_dirs / "llm"), "--questions", str(MT_BENCH), "--limit", "3",
        "--max-new-tokens", "16", "--prompt-lookup", "4", "--methods", "baseline,hf_lookup,ours", "--out", str(out),
    ])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompt_lookup"] == 4 and summary["ssms"] == []
    assert summary["greedy_identical"] == 3 and summary["hf_lookup_identical"] == 3
    assert summary["hf_lookup_tokens_per_s"] > 0 and summary["tau"] >= 1.0
    for method in ["baseline", "hf_lookup", "ours"]:
        assert len((out / f"{method}.jsonl").read_text().splitlines()) == 3


def test_generate_streams_text_and_statistics(tiny_dirs, capsys):
    rc = main(["generate", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "Hello there",
               "--max-new-tokens", "10", "--temperature", "0.7", "--seed", "3"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "tau" in err and "tokens in" in err


def test_generate_with_a_compiled_llm_prints_what_plain_generate_prints(tiny_dirs, capsys):
    args = ["generate", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "Hello there",
            "--max-new-tokens", "10"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--compile"]) == 0
    assert capsys.readouterr().out == plain and plain.strip()


def test_bad_input_fails_fast_naming_the_field(tiny_dirs, tmp_path, capsys):
    rc = main(["bench", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"),
               "--questions", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "--questions" in capsys.readouterr().err
    rc = main(["bench", "--llm", str(tiny_dirs / "llm"), "--questions", str(MT_BENCH), "--out", str(tmp_path / "o")])
    assert rc == 2 and "--ssm" in capsys.readouterr().err
    rc = main(["bench", "--llm", str(tiny_dirs / "llm"), "--questions", str(MT_BENCH), "--out", str(tmp_path / "o"),
               "--methods", "baseline,hf_lookup"])
    assert rc == 2 and "--prompt-lookup" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # out of its range: refused by argparse, before anything loads
        main(["generate", "--llm", str(tiny_dirs / "llm"), "hi", "--prompt-lookup", "-1"])
    assert e.value.code == 2 and "--prompt-lookup" in capsys.readouterr().err
    rc = main(["generate", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "hi", "--top-p", "0"])
    assert rc == 2 and "top_p" in capsys.readouterr().err


def test_ssm_with_another_vocabulary_is_refused(tiny_dirs, tmp_path, capsys):
    rc = main(["bench", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "other"), "--questions", str(MT_BENCH),
               "--limit", "1", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "other" in capsys.readouterr().err


def test_bf16_ssm_under_fp32_llm_stays_identical(tiny_dirs, tmp_path):
    out = tmp_path / "mixed"
    rc = main([
        "bench", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "--questions", str(MT_BENCH),
        "--limit", "2", "--max-new-tokens", "10", "--ssm-dtype", "bf16", "--methods", "baseline,ours", "--out", str(out),
    ])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dtype"] == "fp32" and summary["ssm_dtype"] == "bf16"
    assert summary["greedy_identical"] == summary["total"] == 2


def test_llama_cpp_flags_fail_before_any_model_loads(tiny_dirs, tmp_path, capsys, monkeypatch):
    """Each bad llama.cpp flag is refused by validation (no model loaded, no output written), naming the flag and the fix."""
    out = tmp_path / "o"
    common = ["bench", "--llm", str(tiny_dirs / "llm"), "--questions", str(MT_BENCH), "--out", str(out)]
    exe = sys.executable  # any executable file passes the binary check; these runs stop before starting it

    def refused(*flags: str) -> str:
        rc = main([*common, *flags])
        err = capsys.readouterr().err
        assert rc == 2 and not out.exists(), err
        return err

    monkeypatch.delenv("BOOSTTUNE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("BOOSTTUNE_CACHE", str(tmp_path / "empty-cache"))  # no binary at the default place
    err = refused("--methods", "baseline,llama")
    assert "--llama-server" in err and "BOOSTTUNE_LLAMA_SERVER" in err and "scripts/build_llama_server.sh" in err
    err = refused("--methods", "baseline,llama", "--llama-server", str(tmp_path / "nope"))
    assert "--llama-server" in err and "build_llama_server.sh" in err
    monkeypatch.setenv("BOOSTTUNE_LLAMA_SERVER", str(tmp_path / "nope"))
    assert "BOOSTTUNE_LLAMA_SERVER" in refused("--methods", "baseline,llama")
    monkeypatch.delenv("BOOSTTUNE_LLAMA_SERVER")

    err = refused("--methods", "baseline,llama_draft", "--llama-server", exe)
    assert "--draft-gguf" in err and "export" in err
    assert "llama_draft" in refused("--methods", "baseline,llama", "--draft-gguf", exe, "--llama-server", exe)
    assert "--llm-gguf" in refused("--methods", "baseline,llama", "--llama-server", exe)  # not the default LLM
    err = refused("--methods", "baseline,llama", "--llama-server", exe, "--llm-gguf", str(tmp_path / "missing.gguf"))
    assert "--llm-gguf" in err and "no such file" in err
    err = refused("--methods", "baseline,llama", "--llama-server", exe, "--llm-gguf", str(MT_BENCH))
    assert "--llm-gguf" in err and "not a GGUF" in err
    gguf = tmp_path / "head.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))  # passes the magic-bytes check; never loaded
    err = refused("--methods", "baseline,llama_draft", "--llama-server", exe, "--llm-gguf", str(gguf),
                  "--draft-gguf", str(tmp_path / "ssm.gguf"))
    assert "--draft-gguf" in err and "no such file" in err
    err = refused("--methods", "baseline,llama_ngram", "--llama-server", exe, "--llm-gguf", str(gguf),
                  "--llama-draft-max", "0")
    assert "--llama-draft-max" in err
    assert "unknown" in refused("--methods", "baseline,llama_cpp")


def _bench_trees():
    return load_script("bench_trees")


@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"]])
def test_bench_trees_script_prints_every_shape_identical_to_plain(tiny_dirs, capsys, quantize):
    bench_trees = _bench_trees()
    rc = bench_trees.main([
        "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "--questions", str(MT_BENCH),
        "--limit", "2", "--max-new-tokens", "10", "w1=1", "w21L=2,1:4", "L=lookup:4", "d=dyn:2,2,3", *quantize,
    ])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.split(" ")[:2] in (["|", "w1"], ["|", "w21L"], ["|", "L"], ["|", "d"])]
    assert len(rows) == 4 and all(row.split(" | ")[4] == "2/2" for row in rows), out  # = plain
    assert "2,1 + lookup 4" in out and "dynamic: top 2, depth 2, budget 3" in out


@pytest.mark.parametrize("bad", ["w1", "=1", "w=a,b", "w=lookup", "d=dyn:3,2", "d=dyn:3,0,4", "d=dyn:a"])
def test_bench_trees_refuses_a_malformed_shape(bad):
    with pytest.raises(ValueError, match="shape"):
        _bench_trees().parse_shape(bad)


def test_head_acceptance_predicts_the_tau_the_engine_measures(tmp_path, capsys):
    """The script's τ for one level of 3 children, and for a second level of one child under each, is
    the engine's on the same answers (fp32)."""
    from boosttune.config import FeatureConfig
    from boosttune.core.feature_head import save_head
    from boosttune.core.models import load_model, model_vocab_size, tiny_model_dir
    from boosttune.core.prompts import encode_prompt, read_prompts
    from boosttune.serving.decode import incremental_generate
    from boosttune.serving.stops import StopCriteria
    from boosttune.train.distill import Sample
    from boosttune.train.feature import build_head, llm_features, train_head

    llm = load_model(str(tiny_model_dir()))
    head = build_head(llm.model, [-1])
    # a head that guesses often enough for steps of two tokens: trained on the LLM's answers to the questions
    samples = []
    for q in read_prompts(MT_BENCH)[:3]:
        ids = encode_prompt(llm.tokenizer, q)
        samples.append(Sample(ids + incremental_generate(llm.model, ids, StopCriteria(max_new_tokens=24)).tokens, len(ids)))
    train_head(head, samples, llm_features(llm.model, samples), torch.arange(model_vocab_size(llm.model)),
               FeatureConfig(enabled=True, minutes=0, max_steps=60, lr=1e-2, ce_weight=1.0, noise=0.0))
    save_head(head.eval(), tmp_path / "head")
    llm.tokenizer.save_pretrained(tmp_path / "head")
    common = ["--llm", str(tiny_model_dir()), "--questions", str(MT_BENCH), "--limit", "3", "--max-new-tokens", "24"]
    assert load_script("head_acceptance").main([str(tmp_path / "head"), *common, "--top", "3", "--second", "1"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {tmp_path / 'head'} ")]
    predicted = {"w3": float(row[0].split("|")[5]), "w31": float(row[0].split("|")[7])}
    assert _bench_trees().main(["--ssm", str(tmp_path / "head"), *common, "w3=3", "w31=3,1"]) == 0
    out = capsys.readouterr().out.splitlines()
    measured = {}
    for name in predicted:
        row = [line for line in out if line.startswith(f"| {name} ")]
        assert row[0].split(" | ")[4] == "3/3", row  # = plain
        measured[name] = float(row[0].split("|")[4])
    assert measured["w3"] > 1.2 and measured["w31"] > measured["w3"], measured
    assert predicted == measured


def test_head_acceptance_predicts_a_standalone_ssms_tau_too(tiny_dirs, capsys):
    """For an SSM (no feature head) the script's τ, one level of 3 and 3,1, is the engine's (fp32)."""
    common = ["--llm", str(tiny_dirs / "llm"), "--questions", str(MT_BENCH), "--limit", "3", "--max-new-tokens", "16"]
    assert load_script("head_acceptance").main([str(tiny_dirs / "ssm"), *common, "--top", "3", "--second", "1"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {tiny_dirs / 'ssm'} ")]
    predicted = {"w3": float(row[0].split("|")[5]), "w31": float(row[0].split("|")[7])}
    assert _bench_trees().main(["--ssm", str(tiny_dirs / "ssm"), *common, "w3=3", "w31=3,1"]) == 0
    out = capsys.readouterr().out.splitlines()
    measured = {name: float([line for line in out if line.startswith(f"| {name} ")][0].split("|")[4]) for name in predicted}
    assert 1.2 < measured["w3"] < measured["w31"], measured  # a noisy copy: it guesses often, not always
    assert predicted == measured


def test_head_acceptance_walks_steps_of_one_or_two_tokens():
    walked = load_script("head_acceptance").walked_steps
    assert walked([]) == 0
    assert walked([False, False, False]) == 3
    assert walked([True, True, True, True]) == 2  # each step commits its draft and the LLM's next token
    assert walked([True, False, True]) == 2  # position 1 is committed by the first step's LLM token
    # a second level: a step commits up to three tokens when the child holding token i also held i + 1
    assert walked([True, True, True, True], [True, False, False, False]) == 2  # 3 tokens, then 2 (0..2, 3)
    assert walked([True, True, True, True], [False] * 4) == 2
    assert walked([False, True, True], [True, True, False]) == 2  # no first-level hit: no second level


@pytest.mark.parametrize(("flag", "value"), [
    ("--prompt-lookup", "1000000000"),  # a MemoryError (a chain of 10^9 nodes)
    ("--widths", "1000,1000,1000"),  # an allocation error (10^9 tree nodes)
    ("--seed", "99999999999999999999999"),  # "Overflow when unpacking long long", no flag named
    ("--depth", "100000"),
    ("--draft-vocab", "-1"),
])
def test_generate_refuses_flags_beyond_the_bundle_limits_naming_the_flag(flag, value, capsys):
    """The flags are checked against the limits a bundle is (serving/tree.py), before any model
    loads: one line naming the flag, exit code 2."""
    with pytest.raises(SystemExit) as e:
        main(["generate", "Hello", "--llm", "default", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}" in err and "Traceback" not in err


def test_generate_refuses_a_tree_beyond_the_limits_that_no_single_flag_exceeds(capsys):
    assert main(["generate", "Hello", "--tree", "dynamic", "--topk", "64", "--depth", "8"]) == 2
    err = capsys.readouterr().err
    assert "--topk" in err and "--depth" in err and "1024 nodes" in err


# A stand-in llama-server: answers /health, then never answers /completion (bench waits in its warm-up);
# writes its pid, and a mark once asked to complete, into $FAKE_LLAMA_DIR.
FAKE_LLAMA_SERVER = '''
import os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
out = Path(os.environ["FAKE_LLAMA_DIR"])
(out / "pid").write_text(str(os.getpid()))
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        (out / "asked").write_text("")
        time.sleep(3600)
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
'''


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie (Linux /proc)."""
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_sigterm_stops_bench_and_its_llama_servers(tiny_dirs, tmp_path):
    """SIGTERM (a job scheduler's stop, `kill`) ends `boosttune bench` as Ctrl-C does: its llama-server
    children are stopped, none is left running."""
    import os
    import signal
    import subprocess
    import time

    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n{FAKE_LLAMA_SERVER}")
    fake.chmod(0o755)
    gguf = tmp_path / "llm.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))  # never loaded by the stand-in
    env = {**os.environ, "FAKE_LLAMA_DIR": str(tmp_path), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "boosttune.cli", "bench", "--llm", str(tiny_dirs / "llm"), "--questions", str(MT_BENCH),
           "--limit", "1", "--max-new-tokens", "4", "--methods", "baseline,llama", "--llama-server", str(fake),
           "--llm-gguf", str(gguf), "--out", str(tmp_path / "out")]
    with open(tmp_path / "bench.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    pid = None
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "asked").exists():  # the server is up and bench waits for its answer
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "bench.log").read_text()[-3000:]
            time.sleep(0.1)
        pid = int((tmp_path / "pid").read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _running(pid)
        assert "Traceback" not in (tmp_path / "bench.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_llama_methods_with_a_bundle_of_the_default_llm_take_its_gguf(tmp_path, monkeypatch):
    """`bench --bundle B --methods ...,llama`: the bundle's LLM being the default, llama.cpp runs the default's
    GGUF, or the --llm-gguf given; another LLM needs --llm-gguf."""
    from types import SimpleNamespace

    from boosttune.bench import BenchConfig
    from boosttune.core.models import default_gguf_path
    from boosttune.serving import manifest

    gguf = tmp_path / "llm.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    for ref, given, expected in [("default", None, default_gguf_path()), ("smollm2-135m-instruct", None, default_gguf_path()),
                                 ("default", str(gguf), gguf), ("tiny-random", str(gguf), gguf)]:
        monkeypatch.setattr(manifest, "read_manifest", lambda bundle, ref=ref: SimpleNamespace(llm=SimpleNamespace(ref=ref)))
        cfg = BenchConfig(questions=str(MT_BENCH), out=str(tmp_path / "o"), bundle=str(tmp_path),
                          methods=("baseline", "ours", "llama"), llama_server=sys.executable, llm_gguf=given)
        assert cfg.llama_paths()[1] == expected, (ref, given)
    cfg = BenchConfig(questions=str(MT_BENCH), out=str(tmp_path / "o"), bundle=str(tmp_path),
                      methods=("baseline", "ours", "llama"), llama_server=sys.executable)
    with pytest.raises(ValueError, match="--llm-gguf.*tiny-random"):
        cfg.llama_paths()


def test_bench_reports_each_category_of_a_mixed_question_file(tiny_dirs, tmp_path, capsys):
    """Questions of two categories: summary.json's ``categories`` holds per-category tokens/s and τ that
    the answer files reproduce, and a per-category table follows the main one."""
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines()]
    picked = [rows[0], rows[10], rows[1]]  # writing, roleplay, writing
    questions = tmp_path / "mixed.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n" for r in picked))
    out = tmp_path / "bench"
    assert main(["bench", "--llm", str(tiny_dirs / "llm"), "--ssm", str(tiny_dirs / "ssm"), "--questions", str(questions),
                 "--max-new-tokens", "8", "--widths", "2,1", "--methods", "baseline,ours", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    cats = summary["categories"]
    assert list(cats) == ["writing", "roleplay"] and [c["questions"] for c in cats.values()] == [2, 1]
    for method in ["baseline", "ours"]:
        answers = [json.loads(line)["choices"][0] for line in (out / f"{method}.jsonl").read_text().splitlines()]
        for cat, qs in [("writing", [0, 2]), ("roleplay", [1])]:
            figures = cats[cat]["methods"][method]
            tokens = sum(answers[q]["new_tokens"][0] for q in qs)
            assert figures["tau"] == pytest.approx(tokens / sum(len(answers[q]["accept_lengths"]) for q in qs))
            tps = sum(answers[q]["new_tokens"][0] / answers[q]["wall_time"][0] for q in qs) / len(qs)
            assert figures["tokens_per_s"] == pytest.approx(tps)
    assert summary["greedy_identical"] == 3  # the rest of the summary as before
    printed = capsys.readouterr().out
    table = printed[printed.index("category "):].splitlines()
    assert table[0].split() == ["category", "n", "baseline", "tok/s", "ours", "tok/s", "ours", "tau", "speedup"]
    assert [line.split()[:2] for line in table[2:4]] == [["writing", "2"], ["roleplay", "1"]]


def test_by_category_groups_questions_and_leaves_tau_out_where_no_step_was_recorded():
    from boosttune.bench import by_category
    from boosttune.serving.engine import GenerationResult

    def res(n: int, wall: float, accepts: list[int]) -> GenerationResult:
        return GenerationResult(tokens=list(range(n)), accept_lengths=accepts, wall_time=wall, finish_reason="length")

    results = {
        "ours": [res(6, 1.0, [3, 3]), res(4, 2.0, [1, 1, 2]), res(2, 1.0, [2])],
        "hf_assisted": [res(6, 2.0, []), res(4, 1.0, []), res(2, 0.5, [])],
    }
    cats = by_category(results, ["code", "", "code"])
    assert list(cats) == ["code", "uncategorised"]
    assert cats["code"]["questions"] == 2 and cats["uncategorised"]["questions"] == 1
    assert cats["code"]["methods"]["ours"] == {"tokens_per_s": pytest.approx((6 + 2) / 2), "tau": pytest.approx(8 / 3)}
    assert cats["uncategorised"]["methods"]["ours"] == {"tokens_per_s": pytest.approx(2.0), "tau": pytest.approx(4 / 3)}
    assert cats["code"]["methods"]["hf_assisted"] == {"tokens_per_s": pytest.approx((3 + 4) / 2), "tau": None}


def test_quant_quality_compares_each_quantized_form_with_the_llm(tiny_dirs, capsys):
    """scripts/quant_quality.py: one row per form, the unquantized LLM agreeing with itself fully."""
    assert load_script("quant_quality").main([
        "--llm", str(tiny_dirs / "llm"), "--dtype", "fp32", "--questions", "2", "--max-new-tokens", "6",
        "--tokens", "80", "--window", "32"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]  # after the header
    assert [r.split("|")[1].strip() for r in rows] == ["fp32", "int8", "int4"]
    assert rows[0].split("|")[4].strip() == "1.000" and rows[0].split("|")[5].strip() == "2"
    assert all(float(r.split("|")[3]) > 1 for r in rows)  # perplexities


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no native bf16 on this CPU")
def test_bench_quant_linear_times_every_form_at_every_row_count(tiny_dirs, capsys):
    assert load_script("bench_quant_linear").main(["--llm", str(tiny_dirs / "llm"), "--reps", "1"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r.split("|")[1]) for r in table] == [1, 2, 4, 8, 16, 32]
    assert all(len(r.split("|")) == 8 for r in table) and "relative error" in out


def test_bench_step_times_each_feed_of_the_lean_forward(tiny_dirs, capsys):
    """scripts/bench_step.py: a row per T, eager and quantized (the compiled form runs in test_compiled)."""
    assert load_script("bench_step").main(["--llm", str(tiny_dirs / "llm"), "--dtype", "fp32", "--quantize", "int8",
                                           "--tokens", "1,3", "--reps", "2", "--cache", "5"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [1, 3] and all(float(r.split("|")[2]) > 0 for r in rows)
    assert "fp32 int8, eager" in out
    assert load_script("bench_step").main(["--llm", str(tiny_dirs / "llm"), "--dtype", "fp32", "--batch", "3",
                                           "--tokens", "2", "--reps", "2", "--cache", "5"]) == 0
    assert "3 request(s) of a 5-token cache" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="comma-separated"):
        load_script("bench_step").main(["--llm", str(tiny_dirs / "llm"), "--tokens", "1,x"])


@pytest.mark.parametrize("command", [["bench", "--questions", "q", "--out", "o"], ["generate", "Hi"], ["serve", "B"]])
def test_recost_defaults_to_on_with_quantize(command):
    """Training's costs were timed on the eager forward: --quantize recosts unless --no-recost, --compile
    alone does not, and --recost recosts anything (a prompt after it stays the prompt)."""
    from boosttune.cli import _build
    from boosttune.cli.flags import wants_recost

    parser, _ = _build()
    for extra, want in (([], False), (["--compile"], False), (["--quantize", "w8a8"], True),
                        (["--quantize", "int8", "--no-recost"], False), (["--compile", "--recost"], True)):
        args = parser.parse_args([*command[:1], *extra, *command[1:]])
        assert wants_recost(args) is want, (command[0], extra)
