"""`boosttune serve`: a real uvicorn server on a free local port, talked to with the official openai
client and with raw httpx requests. Greedy answers must equal `boosttune generate` and plain
incremental decoding token for token (fp32); bad requests get OpenAI-style errors and never take the
server down; a client that disconnects frees the engine at once; SIGTERM ends open streams with an
error event and [DONE], and `boosttune serve` exits 0."""

from __future__ import annotations

import json
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from bundle_fixtures import make_run_dir, one_torch_thread  # noqa: F401 (autouse fixture)
from openai import OpenAI

from boosttune.cli import main
from boosttune.core.models import eos_token_ids
from boosttune.core.prompts import encode_prompt
from boosttune.export.bundle import export_bundle
from boosttune.http.server import ServerConfig, ServerThread, create_app
from boosttune.http.text import TextStream
from boosttune.http.worker import (
    CancelledEvent,
    DoneEvent,
    EngineWorker,
    FailedEvent,
    Job,
    QueueFullError,
    TokensEvent,
)
from boosttune.serving.bundle import load_bundle
from boosttune.serving.decode import incremental_generate
from boosttune.serving.engine import GenerationResult
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria

MODEL = "tiny-bundle"
PROMPTS = ["Hello there", "Write a haiku about the sea.", "What is 2+2?", "Name three colours.",
           "Tell me a joke.", "Why is the sky blue?", "Translate 'cat' to French.", "List two primes."]


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    run = make_run_dir(tmp_path_factory.mktemp("run"))
    return export_bundle(run, tmp_path_factory.mktemp("exported") / "bundle").bundle


@pytest.fixture(scope="module")
def loaded(bundle_dir):
    return load_bundle(bundle_dir)


@pytest.fixture(scope="module")
def server(loaded):
    # One engine thread: on a CPU shared with other jobs, two OpenMP threads wait for each other.
    config = ServerConfig(model_name=MODEL, max_request_bytes=64 * 1024, torch_threads=1)
    app = create_app(loaded, config)
    with ServerThread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def _plain(loaded, ids: list[int], max_tokens: int) -> list[int]:
    stop = StopCriteria(max_new_tokens=max_tokens, eos_token_ids=eos_token_ids(loaded.llm))
    return incremental_generate(loaded.llm.model, ids, stop).tokens


def _greedy(client, prompt: str, max_tokens: int = 12, chat: bool = False):
    extra = {"return_token_ids": True}
    if chat:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0, extra_body=extra)
        return r.choices[0].message.content, r
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
    return r.choices[0].text, r


def test_models_and_health(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    info = models[0].model_extra["boosttune"]
    assert [d["name"] for d in info["drafters"]] == ["ssm-1", "ssm-2"]
    assert {d["kind"] for d in info["drafters"]} == {"ssm"} and info["drafters"][0]["tree"]["widths"] == [1, 2, 1]
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL


def test_health_says_warming_up_until_the_warm_up_ends_and_a_request_waits_for_it(bundle_dir, monkeypatch):
    """A readiness probe must not send traffic to a server that is still warming up (compiling, with
    --compile): /health answers 503 "warming up" while the engine's warm-up runs (held at a gate here), a
    request sent meanwhile waits in the queue, and both are served once the warm-up ends."""
    app = create_app(load_bundle(bundle_dir), ServerConfig(model_name=MODEL, torch_threads=1))
    served = app.state.boosttune.served  # the engine the worker warms up with; it starts with the server
    gate, generate = threading.Event(), served.generate

    def gated(*args, **kwargs):
        assert gate.wait(60)
        return generate(*args, **kwargs)

    monkeypatch.setattr(served, "generate", gated)
    with ServerThread(app, wait_ready=False) as url:
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        with ThreadPoolExecutor(1) as pool:
            body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
            answer = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/health", timeout=10).json()["queue_depth"] < 1:
                assert time.monotonic() < deadline and not answer.done()
                time.sleep(0.05)
            gate.set()
            assert answer.result().status_code == 200 and answer.result().json()["usage"]["completion_tokens"] == 4
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"


def test_greedy_answers_equal_plain_decoding_and_generate(client, loaded, bundle_dir, capsys):
    tok = loaded.llm.tokenizer
    prompt = PROMPTS[1]
    # completions: the raw prompt; chat: the chat template, as `boosttune generate` applies it.
    text, r = _greedy(client, prompt, max_tokens=16)
    ids = tok(prompt)["input_ids"]
    assert r.model_extra["boosttune"]["token_ids"] == _plain(loaded, ids, 16)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 16 and r.usage.total_tokens == len(ids) + 16
    assert r.choices[0].finish_reason == "length"
    chat_text, rc = _greedy(client, prompt, max_tokens=16, chat=True)
    chat_ids = encode_prompt(tok, prompt)
    assert rc.model_extra["boosttune"]["token_ids"] == _plain(loaded, chat_ids, 16)
    assert rc.usage.prompt_tokens == len(chat_ids)
    stats = rc.model_extra["boosttune"]
    assert stats["tau"] == pytest.approx(16 / stats["steps"]) and sum(stats["accept_lengths"]) == 16
    assert stats["drafters"] == ["ssm-1", "ssm-2"] and set(stats["drafter_hits"]) == {"ssm-1", "ssm-2"}

    assert main(["generate", str(bundle_dir), prompt, "--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out == chat_text + "\n"
    assert main(["generate", str(bundle_dir), prompt, "--max-new-tokens", "16", "--no-chat"]) == 0
    assert capsys.readouterr().out == text + "\n"

    # Streaming gives the same text, in deltas, then statistics with the finish reason, then usage.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].finish_reason == "length" and final.model_extra["boosttune"]["steps"] == stats["steps"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert sum(1 for c in streamed if c.choices[0].text) > 1  # really streamed, not one block


def test_sixteen_concurrent_clients_get_their_serial_answers(client):
    jobs = [(PROMPTS[i % len(PROMPTS)], 6 + i % 5, i % 2 == 1) for i in range(16)]
    serial = [_greedy(client, p, n, chat)[0] for p, n, chat in jobs]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda job: _greedy(client, *job)[0], jobs))
    assert concurrent == serial


@pytest.fixture(params=["one", "batched"])
def either(request, client, batched_server):
    """The one-at-a-time server's client, then the batched server's."""
    if request.param == "one":
        return client
    return OpenAI(base_url=f"{batched_server}/v1", api_key="unused", max_retries=0, timeout=60)


def test_sampling_is_reproducible_with_a_seed_and_stop_strings_cut(either):
    client = either

    def sampled(seed):
        return client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0.9, top_p=0.95,
                                         seed=seed, extra_body={"top_k": 50}).choices[0].text
    assert sampled(7) == sampled(7)
    full, _ = _greedy(client, PROMPTS[2], max_tokens=12)
    stop = full.strip().split(" ")[2]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def _metric(server: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key = line.split(" ")[0].split("{")[0]
            if key == name:
                total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_for_metric(server: str, name: str, value: float, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while _metric(server, name) < value and time.monotonic() < deadline:
        time.sleep(0.05)


def _raw_post(server: str, body: bytes, declared_length: int | None = None) -> socket.socket:
    """A POST to /v1/completions on a plain socket, so the test decides when the client leaves."""
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    length = len(body) if declared_length is None else declared_length
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (length, body))
    return sock


def _engine_idle(server: str) -> bool:
    health = httpx.get(f"{server}/health").json()
    return health["queue_depth"] == 0 and not health["busy"] and _metric(server, "boosttune_active_requests") == 0


def test_disconnecting_clients_free_the_engine_at_once(client, server):
    cancelled, generated = (_metric(server, f"boosttune_{m}_total") for m in ("cancelled_requests", "generated_tokens"))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    _wait_for_metric(server, "boosttune_cancelled_requests_total", cancelled + 1)
    assert _metric(server, "boosttune_cancelled_requests_total") == cancelled + 1
    # A non-streamed request abandoned while the engine is busy on it: tokens keep arriving, and
    # the server must still notice the client has gone (checking only in quiet moments missed it).
    before = _metric(server, "boosttune_generated_tokens_total")
    sock = _raw_post(server, json.dumps({**body, "stream": False}).encode())
    _wait_for_metric(server, "boosttune_generated_tokens_total", before + 20)
    assert httpx.get(f"{server}/health").json()["busy"]
    sock.close()
    _wait_for_metric(server, "boosttune_cancelled_requests_total", cancelled + 2)
    assert _metric(server, "boosttune_cancelled_requests_total") == cancelled + 2
    assert _engine_idle(server)
    # Both stopped far short of their 2 x 2000 tokens, and the next request waits for nothing.
    assert _metric(server, "boosttune_generated_tokens_total") - generated < 1000
    _, r = _greedy(client, PROMPTS[3], max_tokens=4)
    assert r.model_extra["boosttune"]["queue_seconds"] < 2.0


@pytest.fixture(scope="module")
def batched_server(loaded):
    # 8 tokens per step for 4 requests: trees are cut, and some steps go undrafted
    config = ServerConfig(model_name=MODEL, torch_threads=1, max_batch=4, max_batch_tokens=8, draft_max_batch=4)
    with ServerThread(create_app(loaded, config)) as url:
        yield url


def test_batched_server_gives_concurrent_clients_their_one_at_a_time_answers(client, batched_server):
    batched = OpenAI(base_url=f"{batched_server}/v1", api_key="unused", max_retries=0, timeout=60)
    jobs = [(PROMPTS[i % len(PROMPTS)], 6 + i % 5, i % 2 == 1) for i in range(16)]
    serial = [_greedy(client, p, n, chat)[0] for p, n, chat in jobs]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda job: _greedy(batched, *job)[0], jobs))
    assert concurrent == serial
    stream = batched.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=9, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == _greedy(client, PROMPTS[1], 9)[0]
    _wait_idle(batched_server)
    assert httpx.get(f"{batched_server}/health").json()["running"] == 0


def test_batched_server_drops_a_disconnected_client_and_keeps_decoding_the_others(client, batched_server):
    batched = OpenAI(base_url=f"{batched_server}/v1", api_key="unused", max_retries=0, timeout=60)
    want = _greedy(client, PROMPTS[5], max_tokens=40)[0]
    cancelled = _metric(batched_server, "boosttune_cancelled_requests_total")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", f"{batched_server}/v1/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line)
            assert next(lines).startswith("data: ")
            other = pool.submit(_greedy, batched, PROMPTS[5], 40)  # joins the long one's batch
            for _ in range(5):
                assert next(lines).startswith("data: ")
        _wait_for_metric(batched_server, "boosttune_cancelled_requests_total", cancelled + 1)
        assert other.result()[0] == want
    assert _metric(batched_server, "boosttune_cancelled_requests_total") == cancelled + 1
    _wait_idle(batched_server)


def test_compiled_batched_server_gives_clients_their_one_at_a_time_answers(client, loaded):
    """--compile: a request decoding alone steps through the compiled forward, in a batch through the
    eager one, on the same caches; fp32 answers stay the uncompiled server's."""
    config = ServerConfig(model_name=MODEL, torch_threads=1, max_batch=4, max_batch_tokens=8, draft_max_batch=4,
                          compile=True)
    app = create_app(loaded, config)
    assert app.state.boosttune.served.engine.llm.compiled is not None
    jobs = [(PROMPTS[i % len(PROMPTS)], 5 + i % 4, i % 2 == 1) for i in range(6)]
    serial = [_greedy(client, p, n, chat)[0] for p, n, chat in jobs]
    with ServerThread(app) as url:
        compiled = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert _greedy(compiled, *jobs[0])[0] == serial[0]  # alone
        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(lambda job: _greedy(compiled, *job)[0], jobs)) == serial


def test_a_quantized_server_answers_as_the_quantized_llm_decodes_plainly(client, loaded):
    """--quantize int4: drafted and batched answers equal those of the same quantized server taking plain
    steps only (fp32), and they come from another model than the unquantized server's."""
    def server(draft_max_batch: int):
        return create_app(loaded, ServerConfig(model_name=MODEL, torch_threads=1, max_batch=4, max_batch_tokens=16,
                                               draft_max_batch=draft_max_batch, quantize="int4"))

    drafting, plain = server(4), server(0)
    assert drafting.state.boosttune.served.engine.llm.quantized == "int4"
    jobs = [(PROMPTS[i], 12, i % 2 == 1) for i in range(4)]
    answers = []
    for app in (plain, drafting):
        with ServerThread(app) as url:
            c = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            with ThreadPoolExecutor(4) as pool:
                answers.append([r.model_extra["boosttune"] for r in pool.map(lambda job, c=c: _greedy(c, *job)[1], jobs)])
    assert [a["token_ids"] for a in answers[0]] == [a["token_ids"] for a in answers[1]]
    assert max(a["tau"] for a in answers[1]) > 1 and max(a["tau"] for a in answers[0]) == 1  # drafts were accepted
    unquantized = [_greedy(client, *job)[1].model_extra["boosttune"]["token_ids"] for job in jobs]
    assert unquantized != [a["token_ids"] for a in answers[0]]


def test_serve_flags_name_the_batching_defaults():
    from boosttune.cli import _build
    from boosttune.serving.batch import DRAFT_MAX_BATCH

    parser = _build()[0]
    args = parser.parse_args(["serve", "b"])
    assert (args.max_batch, args.max_batch_tokens, args.draft_max_batch) == (16, 64, None)
    assert args.stack_ssms == "auto" and parser.parse_args(["serve", "b", "--stack-ssms", "off"]).stack_ssms == "off"
    sub = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    help_text = next(a.help for a in sub._actions if a.dest == "draft_max_batch")
    assert f"default {DRAFT_MAX_BATCH};" in help_text
    with pytest.raises(ValueError, match="max_batch_tokens"):
        ServerConfig(max_batch=8, max_batch_tokens=4)


def _wait_idle(server: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not _engine_idle(server):
        assert time.monotonic() < deadline, "the engine is still busy"
        time.sleep(0.05)


def test_client_leaving_before_its_body_is_read_queues_nothing(client, server):
    cancelled, generated = (_metric(server, f"boosttune_{m}_total") for m in ("cancelled_requests", "generated_tokens"))
    sock = _raw_post(server, b'{"model": "tiny-bundle", "prompt": "Hel', declared_length=4000)
    time.sleep(0.2)
    sock.close()
    _wait_for_metric(server, "boosttune_cancelled_requests_total", cancelled + 1)
    assert _metric(server, "boosttune_cancelled_requests_total") == cancelled + 1
    assert _metric(server, "boosttune_generated_tokens_total") == generated
    assert _engine_idle(server)
    text, _ = _greedy(client, PROMPTS[3], max_tokens=4)
    assert text


def test_metrics_report_tokens_tau_queue_and_latency(client, server):
    _greedy(client, PROMPTS[4], max_tokens=5)
    text = httpx.get(f"{server}/metrics").text
    for name in ["boosttune_generated_tokens_total", "boosttune_tau_bucket", "boosttune_queue_depth",
                 "boosttune_request_latency_seconds_bucket", "boosttune_tokens_per_second_bucket",
                 "boosttune_time_to_first_token_seconds_bucket", "boosttune_active_requests"]:
        assert name in text, name
    assert _metric(server, "boosttune_generated_tokens_total") >= 5
    assert 'boosttune_requests_total{endpoint="/v1/completions",status="200"}' in text


LONG = "hello " * 2100  # > 2048 tokens, the tiny LLM's context
OK = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (name, path, body: dict | bytes, status, param or None)
BAD = [
    ("malformed json", "/v1/completions", b'{"model": ', 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("not utf-8", "/v1/completions", b'{"model": "\xff"}', 400, None),
    ("json array", "/v1/completions", b"[1, 2]", 400, None),
    ("missing model", "/v1/completions", {"prompt": "Hi"}, 422, "model"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 422, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 422, "messages"),
    ("prompt is a number", "/v1/completions", {**OK, "prompt": 5}, 422, "prompt"),
    ("max_tokens is a string", "/v1/completions", {**OK, "max_tokens": "10"}, 422, "max_tokens"),
    ("max_tokens is a bool", "/v1/completions", {**OK, "max_tokens": True}, 422, "max_tokens"),
    ("temperature is a string", "/v1/completions", {**OK, "temperature": "hot"}, 422, "temperature"),
    ("stream is a string", "/v1/completions", {**OK, "stream": "yes"}, 422, "stream"),
    ("messages not a list", "/v1/chat/completions", {**OK_CHAT, "messages": "Hi"}, 422, "messages"),
    ("message without role", "/v1/chat/completions", {**OK_CHAT, "messages": [{"content": "Hi"}]}, 422, "messages"),
    ("max_tokens 0", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions", {**OK_CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature"),
    ("temperature too high", "/v1/completions", {**OK, "temperature": 2.5}, 400, "temperature"),
    ("temperature NaN", "/v1/completions", b'{"model": "%s", "prompt": "Hi", "temperature": NaN}' % MODEL.encode(),
     400, "temperature"),
    ("top_p 0", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p above 1", "/v1/chat/completions", {**OK_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("top_k negative", "/v1/completions", {**OK, "top_k": -1}, 400, "top_k"),
    ("n 2", "/v1/completions", {**OK, "n": 2}, 400, "n"),
    ("n 0", "/v1/chat/completions", {**OK_CHAT, "n": 0}, 400, "n"),
    ("seed too large", "/v1/completions", {**OK, "seed": 2**70}, 400, "seed"),
    ("five stop strings", "/v1/completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {**OK, "prompt": [1, 10**9]}, 400, "prompt"),
    ("batched prompts", "/v1/completions", {**OK, "prompt": ["a", "b"]}, 400, "prompt"),
    ("prompt longer than the context", "/v1/completions", {**OK, "prompt": LONG}, 400, "prompt"),
    ("chat longer than the context", "/v1/chat/completions",
     {**OK_CHAT, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("max_tokens beyond the context", "/v1/completions", {**OK, "max_tokens": 5000}, 400, "max_tokens"),
    ("unknown role", "/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, 400,
     "messages"),
    ("no messages", "/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    ("logprobs", "/v1/completions", {**OK, "logprobs": 3}, 400, "logprobs"),
    ("penalty", "/v1/chat/completions", {**OK_CHAT, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("tools", "/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-4"}, 404, "model"),
    ("unknown model (chat)", "/v1/chat/completions", {**OK_CHAT, "model": "gpt-4"}, 404, "model"),
    ("unknown route", "/v1/embeddings", OK, 404, None),
    ("oversized body", "/v1/completions", {**OK, "prompt": "x" * (70 * 1024)}, 413, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, name, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


# (path, body, status, param, the message names what the client sent, a misleading phrase it must not hold)
MESSAGES = [
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 422,
     "messages", "'messages[0].content[0].text'", "only text parts"),
    ("/v1/chat/completions", {**OK_CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens",
     "max_completion_tokens must be >= 1", "max_tokens must"),
    ("/v1/chat/completions", {**OK_CHAT, "max_completion_tokens": 5000}, 400, "max_completion_tokens",
     "max_completion_tokens asks for 5000", "max_tokens asks"),
    ("/v1/completions", {**OK, "prompt": 5}, 422, "prompt",
     "'prompt': expected string or array of strings or array of integers or array of arrays of integers; "
     "got integer", "prompt.str"),
    ("/v1/completions", {**OK, "stop": ["ok", 3]}, 422, "stop", "'stop[1]'", "list[str]"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": [{"text": "Hi"}]}]}, 422,
     "messages", "Missing required parameter: 'messages[0].content[0].type'", "ContentPart"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": [["Hi"]]}]}, 422,
     "messages", "'messages[0].content[0]': Input should be a JSON object", "ContentPart"),
]


@pytest.mark.parametrize("path,body,status,param,says,not_says", MESSAGES, ids=[m[4] for m in MESSAGES])
def test_error_messages_name_the_field_as_the_client_sent_it(server, path, body, status, param, says, not_says):
    r = httpx.post(f"{server}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"] and not_says not in err["message"], err


def test_no_api_docs_and_head_health(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        r = httpx.get(f"{server}{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
    r = httpx.head(f"{server}/health")
    assert r.status_code == 200 and r.content == b""


def test_server_still_serves_after_bad_requests(server, client):
    assert httpx.get(f"{server}/v1/completions").status_code == 405  # wrong method, OpenAI-style error too
    assert httpx.get(f"{server}/health").status_code == 200
    text, r = _greedy(client, PROMPTS[5], max_tokens=4)
    assert r.usage.completion_tokens == 4 and text
    assert _metric(server, "boosttune_failed_requests_total") == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_startup_block(output: str, port: int) -> None:
    """Once it listens, `boosttune serve` says where, under which model name, with what, and how to ask; the
    curl line it gives gets an answer."""
    url = f"http://127.0.0.1:{port}/v1"
    lines = output.splitlines()
    start = lines.index(f"boosttune serve: listening on {url}")
    block = dict(line.strip().split(":", 1) for line in lines[start + 1:start + 6])
    assert block["model"].split() == [MODEL, "(the", '"model"', "clients", "send)"]
    assert block["drafters"].strip() == "ssm-1 (ssm), ssm-2 (ssm)"
    assert block["scheduler"].strip().startswith("none")
    assert block["batching"].strip().startswith("up to 16 requests at once")  # serve's default
    curl = shlex.split(block["try"])
    assert curl[:2] == ["curl", f"{url}/chat/completions"] and curl[-2] == "-d"
    answer = httpx.post(curl[1], content=curl[-1], headers={"Content-Type": "application/json"}, timeout=60)
    assert answer.status_code == 200 and answer.json()["model"] == MODEL


def test_sigterm_ends_open_streams_refuses_new_requests_and_exits_0(bundle_dir, tmp_path):
    # `boosttune serve` in its own process (it inherits PYTHONPATH, so it runs this checkout's code).
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "boosttune.cli", "serve", str(bundle_dir), "--port", str(port),
                             "--model-name", MODEL, "--threads", "1", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        check_startup_block((tmp_path / "serve.log").read_text(), port)
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line)
            assert next(lines).startswith("data: {")
            # a request whose body is still arriving when the signal comes: answered 503, not queued
            late_body = json.dumps(OK).encode()
            late = _raw_post(url, late_body[:10], declared_length=len(late_body))
            time.sleep(0.2)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
            ended = time.monotonic() - signalled
        assert rest[-1] == "data: [DONE]", rest[-3:]
        err = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert err["code"] == "shutting_down" and err["type"] == "server_error" and set(err) == {
            "message", "type", "param", "code"}
        assert ended < 2.5, f"the stream ended {ended:.1f} s after SIGTERM (the grace period is 5 s)"
        late.sendall(late_body[10:])
        answer = late.makefile("rb").read().decode()
        late.close()
        assert answer.startswith("HTTP/1.1 503"), answer
        assert json.loads(answer.split("\r\n\r\n", 1)[1])["error"]["code"] == "shutting_down"
        assert proc.wait(30) == 0
        assert time.monotonic() - signalled < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert "Traceback" not in output, output


def test_text_stream_holds_back_partial_stop_strings(loaded):
    tok = loaded.llm.tokenizer
    ids = tok("The cat sat on the mat. Then it slept.")["input_ids"]
    stream = TextStream(tok, stop=["mat. Then"])
    shown = "".join(stream.push([t]) for t in ids) + stream.finish()
    assert shown == stream.text == "The cat sat on the "
    plain = TextStream(tok)
    assert "".join(plain.push([t]) for t in ids) + plain.finish() == tok.decode(ids)


class _FakeEngine:
    """Emits ``n`` single-token steps, sleeping ``delay`` each; prompt [-1] makes it fail."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.started = threading.Event()

    def generate(self, prompt_ids, stop, sampling, on_tokens, chat=True):
        if prompt_ids[0] == -1:
            raise RuntimeError("boom")
        self.started.set()
        out = []
        for i in range(stop.max_new_tokens):
            time.sleep(self.delay)
            out.append(i)
            on_tokens([i])
        return GenerationResult(out, [1] * len(out), 0.01, "length")


def _job(prompt, n, events):
    return Job(prompt, StopCriteria(max_new_tokens=n), SamplingParams(), events.append)


def test_worker_runs_in_order_survives_failures_and_skips_cancelled_jobs():
    engine = _FakeEngine(delay=0.01)
    worker = EngineWorker(engine, max_queue=2)
    worker.start()
    try:
        first, failing, cancelled, full = [], [], [], []
        long_job = _job([1], 1000, first)
        worker.submit(long_job)
        assert engine.started.wait(5)
        worker.submit(_job([-1], 3, failing))
        skipped = _job([1], 3, cancelled)
        worker.submit(skipped)
        with pytest.raises(QueueFullError):
            worker.submit(_job([1], 3, full))
        skipped.cancel.set()
        long_job.cancel.set()  # the running job stops after its current step
        deadline = time.monotonic() + 5
        while not (failing and cancelled) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(first[-1], CancelledEvent) and 0 < len(first) < 1000
        assert all(isinstance(e, TokensEvent) for e in first[:-1])
        assert isinstance(failing[-1], FailedEvent) and "boom" in failing[-1].message
        assert cancelled == [CancelledEvent()]
        done = []
        worker.submit(_job([1], 3, done))
        deadline = time.monotonic() + 5
        while not done or not isinstance(done[-1], DoneEvent):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [e.tokens for e in done[:-1]] == [[0], [1], [2]]
    finally:
        worker.close()
    assert not worker.alive


def test_the_compile_runs_on_a_thread_with_the_engines_thread_count():
    """dynamo guards graphs on the thread count: compiled on the main thread (one thread), the worker's
    graphs compiled again mid-serving. The helper runs on its own thread and hands back what it raised."""
    from boosttune.http.server import _with_threads

    main = torch.get_num_threads()
    assert _with_threads(3, torch.get_num_threads) == 3
    assert torch.get_num_threads() == main

    def fails() -> float:
        raise ValueError("--compile: no compiler")

    with pytest.raises(ValueError, match="no compiler"):
        _with_threads(None, fails)
