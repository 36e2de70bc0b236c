"""``teacher.backend: openai``: the teacher phase against a real `boosttune serve` subprocess.

The server serves a bundle of the tiny random LLM in fp32, and speculative decoding is lossless, so
its greedy continuations must be the local backends' token for token. A server whose tokenizer
differs (the same vocabulary with merges removed) is refused before anything is generated; an
unreachable endpoint, a wrong model name and a server without top-k log-probs are clear errors that
write nothing; a resumed run asks only for the shards that are missing.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from bundle_fixtures import make_run_dir, one_torch_thread  # noqa: F401 (autouse fixture)
from transformers import AutoTokenizer

from boosttune.config import ConfigError, TeacherConfig, load_config
from boosttune.core.models import TINY_LLM, eos_token_ids, load_model
from boosttune.core.prompts import encode_prompt
from boosttune.core.rundir import RunDir
from boosttune.export.bundle import export_bundle
from boosttune.train.sources import TrainPrompt
from boosttune.train.teacher.backends import run_teacher
from boosttune.train.teacher.openai_server import PROBE_TEXTS, OpenAITeacher, TeacherServerError
from boosttune.train.teacher.shards import load_teacher

MODEL = "tiny-teacher"
TEXTS = ["Hello there", "Write a haiku about the sea.", "What is 2+2?", "Name three colours.",
         "Tell me a joke.", "Why is the sky blue?", "Translate 'cat' to French."]
MAX_NEW = 12
SHARD = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, f"the server did not start: {log.read_text()}"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@pytest.fixture(scope="module")
def llm():
    return load_model(TINY_LLM)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, llm):
    """Two `boosttune serve` processes, started at once: the tiny LLM's bundle, and the same LLM with
    a tokenizer that lacks the first 300 BPE merges (same vocabulary, other tokenisation). Yields
    their base URLs (…/v1)."""
    tmp = tmp_path_factory.mktemp("served")
    run = make_run_dir(tmp / "run", n_ssms=1, scheduler=False, ranking=False)
    same = export_bundle(run, tmp / "bundle").bundle
    other = tmp / "llm-other-merges"
    shutil.copytree(llm.path, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    tj["model"]["merges"] = tj["model"]["merges"][300:]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    report = json.loads((run / "report.json").read_text())
    report["llm"]["path"] = str(other)
    (run / "report.json").write_text(json.dumps(report))
    different = export_bundle(run, tmp / "bundle-other-tokenizer").bundle
    procs = []
    try:
        for bundle in (same, different):
            port, log = _free_port(), tmp / f"{bundle.name}.log"
            with open(log, "w") as out:
                procs.append((subprocess.Popen(
                    [sys.executable, "-m", "boosttune.cli", "serve", str(bundle), "--port", str(port), "--model-name",
                     MODEL, "--threads", "1", "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT),
                    f"http://127.0.0.1:{port}", log))
        for proc, url, log in procs:
            _wait_until_up(proc, url, log)
        yield [f"{url}/v1" for _, url, _ in procs]
    finally:
        for proc, _, _ in procs:
            proc.terminate()
        for proc, _, _ in procs:
            proc.wait(30)


@pytest.fixture(scope="module")
def server(servers) -> str:
    return servers[0]


@pytest.fixture(scope="module")
def other_tokenizer_server(servers) -> str:
    return servers[1]


@pytest.fixture(scope="module")
def prompts(llm) -> list[TrainPrompt]:
    return [TrainPrompt(id=f"p{i}", source="test", category="", chat=True, input_ids=encode_prompt(llm.tokenizer, t),
                        text=t) for i, t in enumerate(TEXTS)]


def _cfg(*overrides: str) -> TeacherConfig:
    return load_config(None, [f"teacher.max_new_tokens={MAX_NEW}", f"teacher.shard_size={SHARD}",
                              *overrides]).teacher


def _openai(url: str, *overrides: str) -> TeacherConfig:
    return _cfg("teacher.backend=openai", f"teacher.endpoint={url}", "teacher.concurrency=4", *overrides)


def _completions_served(url: str) -> float:
    """The server's count of answered /v1/completions requests (its Prometheus metrics)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    return sum(float(m.group(1)) for m in
               re.finditer(r'^boosttune_requests_total\{endpoint="/v1/completions",status="200"\} (\S+)$', text, re.M))


def _shards(run: RunDir) -> list[str]:
    return sorted(p.name for p in run.teacher_dir.glob("*")) if run.teacher_dir.exists() else []


def test_openai_backend_writes_what_the_local_backends_write(server, llm, prompts, tmp_path):
    eos = eos_token_ids(llm)
    remote = RunDir(tmp_path / "openai")
    stats = run_teacher(None, llm.tokenizer, prompts, _openai(server), remote, eos)
    assert stats["backend"] == "openai" and stats["shards_written"] == 3
    assert stats["token_ids"] == {"source": "server", "exact": len(prompts), "retokenized": 0,
                                  "roundtrip_differs": stats["token_ids"]["roundtrip_differs"], "eos_appended": 0}
    assert stats["server"]["owned_by"] == "boosttune" and stats["server"]["model"] == MODEL
    assert stats["server"]["tokenizer_check"] == {"probes": len(PROBE_TEXTS), "by": ["prompt_token_ids"],
                                                  "split_differently": 0, "special_prefix": 0}
    got = load_teacher(remote, len(prompts), SHARD)
    assert got["prompt_id"] == [p.id for p in prompts] and got["input_ids"] == [p.input_ids for p in prompts]
    for backend in ("batched", "hf"):
        local = RunDir(tmp_path / backend)
        run_teacher(llm.model, llm.tokenizer, prompts, _cfg(f"teacher.backend={backend}"), local, eos)
        want = load_teacher(local, len(prompts), SHARD)
        assert got["output_ids"] == want["output_ids"], backend
        assert got["finish"] == want["finish"], backend
    assert all(len(x) == MAX_NEW for x in got["output_ids"])  # a random tiny model rarely writes its EOS


def test_a_server_with_another_tokenizer_is_refused_before_generating(other_tokenizer_server, llm, prompts, tmp_path):
    run = RunDir(tmp_path / "run")
    before = _completions_served(other_tokenizer_server)
    with pytest.raises(TeacherServerError, match=r"teacher\.endpoint: .*tokenises differently.*splits [2-5] of 5 probes"):
        run_teacher(None, llm.tokenizer, prompts, _openai(other_tokenizer_server), run, eos_token_ids(llm))
    assert not list(run.teacher_dir.glob("shard-*"))
    # only probes were sent (text prompts, max_tokens 1), no prompt of the run
    assert _completions_served(other_tokenizer_server) - before <= len(PROBE_TEXTS)


def test_a_server_whose_ids_mean_other_tokens_is_refused(server, llm, prompts, tmp_path):
    """The same comparison from the other side: the LLM's tokenizer here has two frequent tokens'
    ids swapped (its vocabulary differs from the server's; the splits are the same)."""
    swapped = tmp_path / "tokenizer"
    llm.tokenizer.save_pretrained(swapped)
    tj = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġa"] = vocab["Ġa"], vocab["Ġthe"]
    (swapped / "tokenizer.json").write_text(json.dumps(tj))
    tokenizer = AutoTokenizer.from_pretrained(swapped)
    assert tokenizer("the cat sat on a mat")["input_ids"] != llm.tokenizer("the cat sat on a mat")["input_ids"]
    run = RunDir(tmp_path / "run")
    with pytest.raises(TeacherServerError, match=r"teacher\.endpoint: .*tokenises differently.*spell other text"):
        run_teacher(None, tokenizer, prompts, _openai(server), run, eos_token_ids(llm))
    assert _shards(run) == []


def test_unreachable_endpoint_and_wrong_model_fail_clearly_writing_nothing(server, llm, prompts, tmp_path):
    eos = eos_token_ids(llm)
    url = f"http://127.0.0.1:{_free_port()}/v1"
    run = RunDir(tmp_path / "run")
    t0 = time.monotonic()
    with pytest.raises(TeacherServerError, match=rf"teacher\.endpoint: GET {re.escape(url)}/models failed .*ConnectError"):
        run_teacher(None, llm.tokenizer, prompts, _openai(url), run, eos)
    assert time.monotonic() - t0 < 10
    assert _shards(run) == []
    with pytest.raises(TeacherServerError, match=rf"teacher\.model: .*serves \['{MODEL}'\], not 'llama-70b'"):
        run_teacher(None, llm.tokenizer, prompts, _openai(server, "teacher.model=llama-70b"), run, eos)
    with pytest.raises(TeacherServerError, match=r"teacher\.endpoint: .*answered GET /models with 404.*ends in /v1"):
        run_teacher(None, llm.tokenizer, prompts, _openai(server.removesuffix("/v1")), run, eos)
    assert _shards(run) == []


def test_train_fails_on_a_dead_endpoint_before_it_loads_the_llm(tmp_path, capsys):
    from boosttune.cli import main

    url = f"http://127.0.0.1:{_free_port()}/v1"
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    code = main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "teacher.backend=openai",
                 f"teacher.endpoint={url}"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(rf"error: teacher\.endpoint: GET {re.escape(url)}/models failed", err), err
    assert not (tmp_path / "run" / "prompts").exists()  # stopped before the prompts (and the LLM's weights)


def test_a_server_without_topk_logprobs_is_refused_before_generating(server, llm, prompts, tmp_path):
    run = RunDir(tmp_path / "run")
    with pytest.raises(TeacherServerError, match=r"teacher\.topk_logprobs: .*logprobs is not supported"):
        run_teacher(None, llm.tokenizer, prompts, _openai(server, "teacher.topk_logprobs=4"), run, eos_token_ids(llm))
    assert _shards(run) == []


def test_resume_asks_only_for_the_missing_shards(server, llm, prompts, tmp_path):
    eos = eos_token_ids(llm)
    run = RunDir(tmp_path / "run")
    run_teacher(None, llm.tokenizer, prompts, _openai(server), run, eos)
    kept = {k: run.teacher_shard(k).stat() for k in (0, 2)}
    run.teacher_shard(1).unlink()
    before = _completions_served(server)
    stats = run_teacher(None, llm.tokenizer, prompts, _openai(server), run, eos)
    assert stats["shards_written"] == 1 and stats["token_ids"]["exact"] == SHARD
    # the tokenizer probes, one preflight request, and shard 1's prompts: nothing of shards 0 and 2
    assert _completions_served(server) - before == len(PROBE_TEXTS) + 1 + SHARD
    for k, st in kept.items():
        assert run.teacher_shard(k).stat().st_mtime_ns == st.st_mtime_ns and run.teacher_shard(k).stat().st_ino == st.st_ino
    assert len(load_teacher(run, len(prompts), SHARD)) == len(prompts)
    # a finished phase needs no server at all
    gone = f"http://127.0.0.1:{_free_port()}/v1"
    assert run_teacher(None, llm.tokenizer, prompts, _openai(gone), run, eos)["shards_written"] == 0


def test_boosttune_serve_returns_token_ids_as_vllm_does(server, llm):
    ids = encode_prompt(llm.tokenizer, "Hello there")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{server}/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["token_ids"] == r["boosttune"]["token_ids"]
    assert len(choice["token_ids"]) == 5
    chat = httpx.post(f"{server}/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 3, "temperature": 0, "return_token_ids": True}, timeout=60).json()
    assert chat["prompt_token_ids"] == encode_prompt(llm.tokenizer, "Hi") and len(chat["choices"][0]["token_ids"]) == 3
    plain = httpx.post(f"{server}/completions", json={**body, "return_token_ids": False}, timeout=60).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


class _Flaky(BaseHTTPRequestHandler):
    """A real HTTP hop in front of the server that fails the next completions requests as told
    ("503", "429", or "drop": close the connection without an answer), then forwards."""

    upstream = ""
    faults: list[str] = []
    seen: list[str] = []
    lock = threading.Lock()

    def _forward(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        with self.lock:
            fault = self.faults.pop(0) if self.faults and self.path.endswith("/completions") else None
            if fault:
                self.seen.append(fault)
        if fault == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault:
            payload = json.dumps({"error": {"message": f"injected {fault}"}}).encode()
            self.send_response(int(fault))
            self.send_header("Retry-After", "0")
        else:
            r = httpx.request(method, self.upstream + self.path, content=body, timeout=60,
                              headers={"content-type": "application/json"})
            payload = r.content
            self.send_response(r.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._forward("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._forward("POST")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def flaky(server):
    _Flaky.upstream, _Flaky.faults, _Flaky.seen = server.removesuffix("/v1"), [], []
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}/v1"
    proxy.shutdown()
    proxy.server_close()


def test_transient_errors_are_retried_and_lasting_ones_stop_the_run(flaky, server, llm, prompts):
    eos = eos_token_ids(llm)
    ids = [p.input_ids for p in prompts[:4]]
    direct = OpenAITeacher(_openai(server), llm.tokenizer, eos)
    direct.preflight(ids[0])
    teacher = OpenAITeacher(_openai(flaky), llm.tokenizer, eos, backoff=0.01)
    teacher.preflight(ids[0])
    _Flaky.faults[:] = ["503", "429", "drop", "502"]
    with ThreadPoolExecutor(2) as pool:
        want, _ = direct.generate(ids, [0] * 4, pool)
        got, stats = teacher.generate(ids, [0] * 4, pool)
        assert _Flaky.seen == ["503", "429", "drop", "502"]
        assert [c.output_ids for c in got] == [c.output_ids for c in want] and stats.exact == 4
        once = OpenAITeacher(_openai(flaky), llm.tokenizer, eos, backoff=0.01, retries=1)
        once.info = teacher.info
        _Flaky.faults[:] = ["503"] * 4
        with pytest.raises(TeacherServerError, match=r"teacher\.endpoint: POST .*/completions failed 2 times "
                                                     r"\(HTTP 503: injected 503\)"):
            once.generate(ids[:1], [0], pool)


# ---------------------------------------------------------------------------------- response layouts
def _teacher(llm, topk: int = 0) -> OpenAITeacher:
    cfg = _openai("http://127.0.0.1:9/v1", f"teacher.topk_logprobs={topk}")
    t = OpenAITeacher(cfg, llm.tokenizer, frozenset({2}))
    t.info.owned_by, t.info.model = "test", "m"
    return t


def test_stop_continuations_end_with_their_eos_in_every_layout(llm):
    t = _teacher(llm)
    ids = llm.tokenizer("Paris is nice", add_special_tokens=False)["input_ids"]
    # vLLM: ids in the choice, the EOS among them
    c, s = t._continuation({"choices": [{"text": "Paris is nice", "token_ids": ids + [2], "finish_reason": "stop"}]}, 8)
    assert (c.output_ids, c.finish, s.exact, s.eos_appended) == (ids + [2], "stop", 1, 0)
    # llama-server: __verbose.tokens without the EOS: it is put back
    c, s = t._continuation({"choices": [{"text": "", "finish_reason": "stop"}], "__verbose": {"tokens": ids}}, 8)
    assert (c.output_ids, c.finish, s.exact, s.eos_appended) == (ids + [2], "stop", 1, 1)
    # no ids at all: the text is re-tokenised
    c, s = t._continuation({"choices": [{"text": "Paris is nice", "finish_reason": "length"}]}, 8)
    assert (c.output_ids, c.finish, s.retokenized, s.exact) == (ids, "length", 1, 0)
    # ids that run on past an EOS are cut after it, as the local backends cut them
    c, _ = t._continuation({"choices": [{"text": "", "token_ids": [5, 2, 7], "finish_reason": "length"}]}, 8)
    assert (c.output_ids, c.finish) == ([5, 2], "stop")
    with pytest.raises(TeacherServerError, match="finish_reason 'content_filter'"):
        t._continuation({"choices": [{"text": "", "token_ids": [5], "finish_reason": "content_filter"}]}, 8)


def test_topk_logprobs_are_read_by_id_or_refused(llm):
    t = _teacher(llm, topk=2)
    llama = {"content": [{"id": 5, "logprob": -0.1, "top_logprobs": [{"id": 9, "logprob": -3.0}, {"id": 5, "logprob": -0.1},
                                                                     {"id": 4, "logprob": -2.0}]}]}
    c, _ = t._continuation({"choices": [{"text": "", "token_ids": [5], "finish_reason": "length", "logprobs": llama}]}, 1)
    assert c.topk_ids == [[5, 4]] and c.topk_logprobs == [[-0.1, -2.0]]
    vllm = {"top_logprobs": [{"token_id:5": -0.1, "token_id:4": -2.0}]}
    c, _ = t._continuation({"choices": [{"text": "", "token_ids": [5], "finish_reason": "length", "logprobs": vllm}]}, 1)
    assert c.topk_ids == [[5, 4]]
    by_text = {"top_logprobs": [{"Paris": -0.1, " Rome": -2.0}]}
    with pytest.raises(TeacherServerError, match=r"teacher\.topk_logprobs: .*by text"):
        t._continuation({"choices": [{"text": "", "token_ids": [5], "finish_reason": "length", "logprobs": by_text}]}, 1)
    with pytest.raises(TeacherServerError, match=r"teacher\.topk_logprobs: .*incomplete"):
        t._continuation({"choices": [{"text": "", "token_ids": [5, 6], "finish_reason": "length", "logprobs": vllm}]}, 2)
    with pytest.raises(TeacherServerError, match=r"teacher\.topk_logprobs: .*no 'logprobs'"):
        t._continuation({"choices": [{"text": "", "token_ids": [5], "finish_reason": "length", "logprobs": None}]}, 1)


def test_openai_config_is_checked_at_start():
    with pytest.raises(ConfigError, match=r"teacher\.endpoint: the openai backend needs"):
        load_config(None, ["teacher.backend=openai"])
    with pytest.raises(ConfigError, match=r"teacher\.endpoint: .*not an http\(s\) URL"):
        load_config(None, ["teacher.backend=openai", "teacher.endpoint=localhost:8000"])
    with pytest.raises(ConfigError, match=r"teacher\.concurrency: must be >= 1"):
        load_config(None, ["teacher.backend=openai", "teacher.endpoint=http://h:1/v1", "teacher.concurrency=0"])
    with pytest.raises(ConfigError, match=r"teacher\.api_key_env: .*not an environment variable name"):
        load_config(None, ["teacher.backend=openai", "teacher.endpoint=http://h:1/v1", "teacher.api_key_env=sk-123abc"])
    cfg = load_config(None, ["teacher.backend=openai", "teacher.endpoint=http://h:1/v1", "teacher.temperature=0.7"])
    assert cfg.teacher.backend == "openai" and cfg.teacher.model == "" and cfg.teacher.concurrency == 8


def test_the_report_adds_up_how_token_ids_were_obtained_over_resumes():
    from boosttune.train.pipeline import _merge_token_ids

    first = {"source": "server", "exact": 3, "retokenized": 0, "roundtrip_differs": 1, "eos_appended": 0}
    then = {"source": "retokenized", "exact": 0, "retokenized": 2, "roundtrip_differs": 0, "eos_appended": 1}
    assert _merge_token_ids(first, then) == {"source": "retokenized+server", "exact": 3, "retokenized": 2,
                                             "roundtrip_differs": 1, "eos_appended": 1}
    assert _merge_token_ids(None, {"source": "model"}) == {"source": "model"}
