"""`boosttune serve` against clients that stall or leave, on real server processes and raw sockets:
a connection that sends nothing, headers that never end (or trickle), a body shorter than its
Content-Length and a client that never reads its stream each end within the configured time (408 or
a closed connection); an oversized body is refused before it is sent; requests sent just after SIGTERM
get an answer (503), never a connection closed without one."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from bundle_fixtures import make_run_dir, one_torch_thread  # noqa: F401 (autouse fixture)

from boosttune.cli import main
from boosttune.export.bundle import export_bundle
from boosttune.http.connection import GuardedH11Protocol
from boosttune.http.timeouts import ConnectionTimeouts

MODEL = "tiny-bundle"
TIMEOUT = 1.0  # every deadline of the server under test, seconds
OK = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Served:
    """`boosttune serve` in its own process (it inherits PYTHONPATH, so it runs this checkout's code)."""

    def __init__(self, bundle: Path, log: Path, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "boosttune.cli", "serve", str(bundle), "--port", str(self.port), "--model-name",
             MODEL, "--threads", "1", "--log-level", "warning", *flags], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connecting, so that the TCP window is small from the start
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(15)  # every read below is bounded
        sock.connect(("127.0.0.1", self.port))
        return sock

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._log.close()
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    run = make_run_dir(tmp_path_factory.mktemp("run"), n_ssms=1, scheduler=False, ranking=False)
    return export_bundle(run, tmp_path_factory.mktemp("exported") / "bundle").bundle


@pytest.fixture(scope="module")
def served(bundle_dir, tmp_path_factory):
    seconds = str(TIMEOUT)
    s = _Served(bundle_dir, tmp_path_factory.mktemp("log") / "serve.log", "--timeout-keep-alive", seconds,
                "--header-timeout", seconds, "--body-timeout", seconds, "--send-timeout", seconds,
                "--max-request-bytes", "100000")
    yield s
    output = s.close()
    assert "Traceback" not in output, output


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as a close)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _closed_within(sock: socket.socket) -> tuple[bytes, float]:
    start = time.monotonic()
    data = _read_all(sock)
    return data, time.monotonic() - start


def test_a_connection_that_sends_nothing_is_closed(served):
    with served.connect() as sock:
        data, seconds = _closed_within(sock)
    assert data == b"" and seconds < TIMEOUT + 3, (data, seconds)


def test_headers_that_never_end_get_a_408(served):
    with served.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        data, seconds = _closed_within(sock)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert TIMEOUT * 0.8 < seconds < TIMEOUT + 3, seconds


def test_trickled_headers_get_a_408_however_steady_the_trickle(served):
    # one byte every 0.1 s: each byte would reset a per-read timeout, but not the headers' deadline
    with served.connect() as sock:
        start = time.monotonic()
        sock.sendall(b"P")
        try:
            for byte in b"OST /v1/completions HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 200:
                time.sleep(0.1)
                sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the server, as it should be
        data = _read_all(sock)
        seconds = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408"), data
    assert seconds < TIMEOUT + 3, seconds


def test_a_body_shorter_than_its_content_length_gets_a_408(served):
    with served.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(OK) + 10, OK))
        data, seconds = _closed_within(sock)
    assert data.startswith(b"HTTP/1.1 408"), data
    assert TIMEOUT * 0.8 < seconds < TIMEOUT + 3, seconds
    assert httpx.get(f"{served.url}/health", timeout=10).json()["queue_depth"] == 0  # nothing was queued


def test_an_oversized_body_is_refused_before_it_is_sent(served):
    with served.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\n\r\n")
        data, seconds = _closed_within(sock)  # the answer, then the close: the server will not read 1 GB
    assert data.startswith(b"HTTP/1.1 413"), data
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    assert seconds < TIMEOUT + 3, seconds


class _SmallSendBuffer(GuardedH11Protocol):
    """The server's protocol with a 4 KiB socket send buffer: on loopback the kernel buffers ~3 MB, more
    than any answer of the tiny model, so a real network's small buffers are set by hand."""

    timeouts = ConnectionTimeouts(send=TIMEOUT)

    def connection_made(self, transport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        super().connection_made(transport)


def test_a_client_that_never_reads_is_disconnected():
    ended: dict = {}

    async def endless(scope, receive, send) -> None:
        """Streams until the client has gone (as a token stream does), then notes when it saw that."""
        if scope["type"] != "http":
            return
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        gone = asyncio.ensure_future(disconnected())
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        while not gone.done():
            await send({"type": "http.response.body", "body": b"x" * 4096, "more_body": True})
            await asyncio.sleep(0)
        ended["at"] = time.monotonic()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(endless, http=_SmallSendBuffer, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.settimeout(15)
        client.connect(sock.getsockname())
        client.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        stopped_reading = time.monotonic()  # the client reads nothing from here on
        while "at" not in ended and time.monotonic() < stopped_reading + 30:
            time.sleep(0.05)
        assert "at" in ended, "the server still streams to a client that reads nothing"
        assert ended["at"] - stopped_reading < TIMEOUT + 3, ended["at"] - stopped_reading
        client.close()
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_requests_sent_just_after_sigterm_get_an_answer(bundle_dir, tmp_path):
    s = _Served(bundle_dir, tmp_path / "serve.log")
    try:
        # keep-alive connections, each with a request answered, as a client's pool holds them
        pooled = []
        for _ in range(8):
            sock = s.connect()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            head = b""
            while b'"busy"' not in head:
                head += sock.recv(65536)
            pooled.append(sock)
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(OK), OK))
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        # 0-20 ms after the signal (the race), and later, while uvicorn closes the connections
        for sock, delay in zip(pooled, [0.0, 0.005, 0.01, 0.015, 0.02, 0.08, 0.15, 0.25], strict=True):
            time.sleep(max(0.0, signalled + delay - time.monotonic()))
            try:
                sock.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed already: _read_all below sees no answer, which fails the test
        answers = [_read_all(sock).split(b"\r\n", 1)[0] for sock in pooled]
        for sock in pooled:
            sock.close()
        assert all(a in (b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.1 200 OK") for a in answers), answers
        assert s.proc.wait(30) == 0
    finally:
        output = s.close()
    assert "Traceback" not in output, output


@pytest.mark.parametrize("flag,value,says", [
    ("--model-name", "tiny\ud800", "surrogate"),
    ("--model-name", " ", "empty"),
    ("--timeout-keep-alive", "0", "positive"),
    ("--header-timeout", "nan", "positive"),
    ("--body-timeout", "soon", "number of seconds"),
    ("--send-timeout", "-1", "positive"),
    ("--max-request-bytes", "0", ">= 1"),
])
def test_serve_flags_are_checked_naming_the_flag(bundle_dir, capsys, flag, value, says):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(bundle_dir), flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and says in err, err
