"""`boosttune serve`: an OpenAI-compatible HTTP server over a bundle's speculative engine.

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (streaming as server-sent events ending with ``data: [DONE]``),
``GET``/``HEAD /health``, ``GET /metrics`` (Prometheus); no generated API docs. Responses carry
OpenAI's ``usage`` counts and a ``boosttune`` object with the speculative statistics (τ, steps,
accept lengths, SSMs and their hits, queue and engine seconds); streams carry it in the chunk that
holds the finish reason.

One engine worker thread (``worker.py``) serves the requests in arrival order; the HTTP layer
accepts any number concurrently, decodes, validates and tokenises them off the event loop (large
bodies on a thread of their own, so that small ones never wait behind them) and queues them
(``max_queue`` waiting, then 503). A client that disconnects cancels its request: a stream's
generator is cancelled by Starlette, and a non-streamed request waits for its events and for the
ASGI disconnect message at once (a client that leaves before its body is read is counted as
cancelled too, and nothing is queued). The wire format and the validation of requests are in
``protocol.py``, the metrics in ``metrics.py``.

Shutdown (SIGTERM, Ctrl-C): new requests get 503 (``shutting_down``), open streams end at once with
an error event and ``data: [DONE]``, waiting non-streamed requests get the 503, and then uvicorn
closes the connections (an idle keep-alive one after a short wait, so that a request already sent on
it gets its 503) and the lifespan stops the worker; ``boosttune serve`` exits 0 on SIGTERM. Clients
that stall (headers or a body that never end, output never read) are cut off by the deadlines of
``connection.py``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from boosttune import assemble
from boosttune.http.banner import startup_banner
from boosttune.http.connection import guarded_protocol
from boosttune.http.metrics import RequestMetricsMiddleware, ServerMetrics
from boosttune.http.protocol import (
    APIError,
    GenerationRequest,
    ModelLimits,
    chunk_body,
    decode_json,
    is_unicode,
    new_id,
    parse_chat,
    parse_completion,
    response_body,
    usage,
    usage_chunk,
)
from boosttune.http.text import TextStream
from boosttune.http.timeouts import ConnectionTimeouts
from boosttune.http.worker import (
    CancelledEvent,
    DoneEvent,
    EngineWorker,
    Event,
    FailedEvent,
    Job,
    QueueFullError,
    TokensEvent,
)
from boosttune.serving.batch import DRAFT_MAX_BATCH
from boosttune.serving.bundle import LoadedBundle
from boosttune.serving.engine import GenerationResult
from boosttune.serving.stops import StopCriteria

log = logging.getLogger(__name__)

# Bodies above this many bytes are parsed on the large bodies' thread (a prompt of this size tokenises in
# milliseconds; a 1 MB one takes seconds).
LARGE_BODY_BYTES = 64 * 1024
ENDPOINTS = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"})


@dataclass(frozen=True)
class ServerConfig:
    """How `boosttune serve` behaves (the bundle decides the models and the tree).

    Attributes:
        model_name: the model id clients send; None uses the bundle directory's name.
        max_queue: requests that may wait for the engine; more are answered 503.
        max_request_bytes: larger request bodies are answered 413 (before they are read, when their
            Content-Length says so).
        default_max_tokens: chat answers' length when the request gives no max_tokens (completions
            default to OpenAI's 16); always capped by the room left in the context.
        warmup: generate a few tokens when the server starts, before the first request.
        torch_threads: intra-op threads of the engine (None: torch's default). On a CPU shared
            with other jobs, 1 avoids OpenMP threads waiting for each other (measured here under
            load: 0.25 s vs 1.1-16 s for 16 tokens of a tiny model).
        use_scheduler: plan every request with the bundle's learned scheduler, if it has one (False:
            every request drafts with all SSMs and the bundle's prompt-lookup default).
        phrases: prompt lookup drafts with the bundle's phrase table too, if it has one (``serving/phrases.py``).
        timeouts: how long a client may take to send a request or to read the answer (connection.py).
        max_batch: requests decoded at once, their trees verified in one LLM forward per step
            (``serving/batch.py``); 1 serves one request at a time.
        max_batch_tokens: tokens one batched step may verify in all (every request's pending token
            included); trees beyond it are cut, or left undrafted for that step.
        draft_max_batch: requests draft their trees only while at most this many decode at once
            (0: never); larger batches take plain steps (``serving/batch.py``, ``DRAFT_MAX_BATCH``).
        compile: compile the CPU forward of the LLM and the drafters (``serving/compiled.py``) at start;
            single requests' steps run it, batched steps of several requests the eager forward.
        quantize: "int8", "int4" or "w8a8": serve the LLM and the drafters quantized
            (``serving/quantize.py``); None keeps their dtype's weights.
        recost: time the learned scheduler's costs again on the forward being served and take its fixed
            choice again (``assemble.recost_served``, 15-40 s at the first start on a forward and machine, then
            read from ``recost_cache``); the commands set it
            with --quantize unless told otherwise (``flags.wants_recost``).
        stack_ssms: "auto", "on" or "off": whether the bundle's SSMs draft in one stacked forward
            (``assemble.stacks``; "auto" where they carry low-rank factors over SSM 1).
    """

    model_name: str | None = None
    max_queue: int = 64
    max_request_bytes: int = 1 << 20
    default_max_tokens: int = 256
    warmup: bool = True
    torch_threads: int | None = None
    use_scheduler: bool = True
    phrases: bool = True
    timeouts: ConnectionTimeouts = field(default_factory=ConnectionTimeouts)
    max_batch: int = 1
    max_batch_tokens: int = 64
    draft_max_batch: int = DRAFT_MAX_BATCH
    compile: bool = False
    quantize: str | None = None
    recost: bool = False
    stack_ssms: str = "auto"

    def __post_init__(self) -> None:
        if self.stack_ssms not in assemble.STACK_MODES:
            raise ValueError(f"server stack_ssms must be one of {', '.join(assemble.STACK_MODES)}, got "
                             f"{self.stack_ssms!r}")
        if self.max_batch_tokens < self.max_batch:
            raise ValueError(f"server max_batch_tokens ({self.max_batch_tokens}) must be at least max_batch "
                             f"({self.max_batch}): every request feeds its pending token each step")
        for name in ("max_queue", "max_request_bytes", "default_max_tokens", "max_batch", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"server {name} must be >= 1, got {getattr(self, name)}")
        if self.draft_max_batch < 0:
            raise ValueError(f"server draft_max_batch must be >= 0, got {self.draft_max_batch}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"server torch_threads must be >= 1 (or None), got {self.torch_threads}")
        if self.model_name is not None and not self.model_name.strip():
            raise ValueError("server model_name must not be empty (omit it to use the bundle's directory name)")
        if self.model_name is not None and not is_unicode(self.model_name):
            # it is echoed in every response, whose UTF-8 JSON cannot hold it (/v1/models answered 500)
            raise ValueError(f"server model_name {self.model_name!r} holds a lone UTF-16 surrogate (or bytes that "
                             "are not UTF-8): name the model in Unicode text")


class _State:
    """Everything the handlers share: models, limits, the worker and the metrics."""

    def __init__(self, bundle: LoadedBundle, config: ServerConfig):
        from transformers import AutoTokenizer

        from boosttune.core.models import eos_token_ids, model_vocab_size

        self.bundle = bundle
        self.config = config
        self.model_name = config.model_name or bundle.root.resolve().name
        self.created = int(time.time())
        self.tokenizer = bundle.llm.tokenizer  # event-loop thread only
        # Request bodies are decoded, validated and tokenised off the event loop (a 1 MB prompt takes
        # seconds, which the loop must not wait for), each pool thread with its own copy of the tokenizer
        # for the same reason as the worker's below. Large bodies have a thread of their own, so that a
        # small request never waits behind a large one's tokenising (the tokenizer releases the GIL).
        self.parse_pools = {large: ThreadPoolExecutor(1, thread_name_prefix=f"boosttune-parse-{name}")
                            for large, name in ((False, "small"), (True, "large"))}
        self.parse_tokenizers = {large: copy.deepcopy(self.tokenizer) for large in (False, True)}
        # The worker decodes for stop strings on its own thread: give it its own tokenizer object
        # (a Rust tokenizer shared across threads can fail with "Already borrowed").
        self.worker_tokenizer = AutoTokenizer.from_pretrained(bundle.root / bundle.manifest.tokenizer)
        self.eos = eos_token_ids(bundle.llm)
        self.limits = ModelLimits(
            name=self.model_name, context_length=bundle.context_length,
            vocab_size=model_vocab_size(bundle.llm.model), default_max_tokens=config.default_max_tokens,
        )
        # what `boosttune generate` and `bench` assemble from the same bundle (boosttune/assemble.py)
        self.served = assemble.from_bundle(bundle, use_scheduler=config.use_scheduler, stack_ssms=config.stack_ssms,
                                             phrases=config.phrases)
        if config.quantize:
            llm_b, drafters_b = assemble.quantize_served(self.served.engine, config.quantize)
            log.info("the products of the LLM (%.0f MB) and the drafters (%.0f MB) quantized to %s", llm_b / 1e6,
                     drafters_b / 1e6, config.quantize)
        if config.compile:
            log.info("compiling the forward of the LLM and the drafters")
            compile_s = _with_threads(config.torch_threads,
                                      lambda: assemble.compile_served(self.served, batched=config.max_batch > 1))
            log.info("compiled in %.1f s", compile_s)
        if config.recost and self.served.scheduler is not None:
            recost_s = _with_threads(config.torch_threads, lambda: assemble.recost_served(self.served, keep=True))
            log.info("%s", assemble.recost_note(self.served, recost_s))
        self.scheduler = self.served.scheduler
        if self.scheduler is not None:
            log.info("learned scheduler loaded from %s", bundle.scheduler_dir)
        self.lookup = self.served.lookup
        self.drafter_names = list(self.served.engine.drafters)
        self.worker = EngineWorker(self.served, config.max_queue, on_finished=self._on_finished,
                                   threads=config.torch_threads, max_batch=config.max_batch,
                                   max_batch_tokens=config.max_batch_tokens, draft_max_batch=config.draft_max_batch)
        self.metrics = ServerMetrics(queue_depth=lambda: self.worker.queue_depth)
        self.shutting_down = False  # event-loop thread only, as is ``open``
        self.open: set[_Submission] = set()
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once the lifespan starts

    def begin_shutdown(self) -> None:
        """Refuse new requests (503) and end the open ones now; event-loop thread only."""
        self.shutting_down = True
        for sub in list(self.open):
            sub.shut_down()

    def request_shutdown(self) -> None:
        """:meth:`begin_shutdown` from any thread (or a signal handler)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.begin_shutdown)

    def _on_finished(self, job: Job, event: Event) -> None:
        m = self.metrics
        m.active.dec()
        if isinstance(event, DoneEvent):
            r = event.result
            m.observe_result(len(r.tokens), len(job.prompt_ids), r.wall_time, r.tau)
        elif isinstance(event, CancelledEvent):
            m.cancelled.inc()
        elif isinstance(event, FailedEvent):
            m.failed.inc()

    async def parse(self, parse: Callable[[Any, Any, ModelLimits], GenerationRequest],
                    body: bytes) -> GenerationRequest:
        """``parse_completion`` or ``parse_chat`` of the JSON ``body`` on a parsing thread (the large
        bodies' one above ``LARGE_BODY_BYTES``)."""
        large = len(body) > LARGE_BODY_BYTES
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.parse_pools[large], _decode_and_parse, parse, body,
                                          self.parse_tokenizers[large], self.limits)

    def model_card(self) -> dict:
        b = self.bundle
        return {
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "boosttune",
            "boosttune": {"llm": b.manifest.llm.ref, "llm_sha256": b.manifest.llm.sha256,
                          "drafters": [{"name": d.name, "kind": d.kind, "tree": asdict(d.tree)}
                                       for d in b.manifest.models],
                          "prompt_lookup": self.lookup,
                          "context_length": self.limits.context_length,
                          "scheduler": b.manifest.scheduler_dir},
        }

    def stats(self, req: GenerationRequest, result: GenerationResult, queue_time: float) -> dict:
        used = list(result.active or [])
        out = {
            "tau": result.tau, "steps": result.steps, "accept_lengths": result.accept_lengths,
            "drafters": used, "drafter_hits": {name: result.proposer_hits.get(name, 0) for name in used},
            "engine_seconds": result.wall_time, "queue_seconds": queue_time,
            "tokens_per_s": len(result.tokens) / result.wall_time if result.wall_time > 0 else None,
        }
        if req.return_token_ids:
            out["token_ids"] = list(result.tokens)
        return out


def _decode_and_parse(parse: Callable[[Any, Any, ModelLimits], GenerationRequest], body: bytes, tokenizer: Any,
                      limits: ModelLimits) -> GenerationRequest:
    """JSON-decode ``body`` and validate and tokenise it with ``parse``; on a parsing thread."""
    return parse(decode_json(body), tokenizer, limits)


class _ErrorResponse(JSONResponse):
    """An error body in ASCII JSON: messages quote what the client sent, and Starlette's UTF-8 rendering
    would fail (a 500 instead of the error) on a lone surrogate that slipped through."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error_response(err: APIError) -> JSONResponse:
    return _ErrorResponse(err.body(), status_code=err.status)


def _shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; retry on another instance or later.", None,
                    "shutting_down", type="server_error")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing bodies over ``limit`` bytes (413) as soon as that is known: from the
    Content-Length before any of the body is read, else while it arrives."""
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"The request body is larger than this server accepts ({limit} bytes).", None,
                       "request_too_large")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, "Content-Length is not a number.", None, "invalid_request")
        if int(declared) > limit:
            raise too_big
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class _Submission:
    """A job handed to the worker and the asyncio queue its events arrive in."""

    def __init__(self, state: _State, req: GenerationRequest):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        tokenizer = state.worker_tokenizer if req.stop else None
        stop = StopCriteria(max_new_tokens=req.max_tokens, eos_token_ids=state.eos, stop_strings=req.stop,
                            tokenizer=tokenizer)
        self.job = Job(req.prompt_ids, stop, req.sampling, self._deliver, chat=req.kind == "chat")
        self._getter: asyncio.Future | None = None
        self.first_token_seen = False
        # A non-streamed answer reads only its first tokens (time to first token) and the result: its
        # later steps' tokens are not handed to the event loop, which would wake for every request at every
        # step (16 clients on 2 cores: 92 against 114 tok/s with them, measured before the main thread
        # left the cores to the worker).
        self._stream = req.stream
        self._tokens_sent = False
        self.generated_tokens = state.metrics.generated_tokens
        if state.shutting_down:
            raise _shutting_down()
        try:
            state.worker.submit(self.job)
        except QueueFullError as e:
            raise APIError(503, f"The server is busy ({e}); retry later.", None, "server_overloaded",
                           type="server_error") from None
        state.metrics.active.inc()
        self._open = state.open
        self._open.add(self)

    def _deliver(self, event: Event) -> None:  # worker thread
        if isinstance(event, TokensEvent):
            self.generated_tokens.inc(len(event.tokens))
            if self._tokens_sent and not self._stream:
                return
            self._tokens_sent = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed: the server is shutting down
            self.job.cancel.set()

    async def next(self, gone: asyncio.Future | None = None) -> Event | None:
        """The next event; None if ``gone`` (the client's disconnect) completes first."""
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.events.get())
        if gone is not None:
            await asyncio.wait({self._getter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not self._getter.done():
                return None
        event = await self._getter
        self._getter = None
        return event

    def cancel(self) -> None:
        """Stop the job (if still queued or running) and the pending wait; event-loop thread only."""
        self.job.cancel.set()
        self._open.discard(self)
        if self._getter is not None:
            self._getter.cancel()

    def shut_down(self) -> None:
        """The server is stopping: stop the job, and end the request now (the worker's own
        :class:`CancelledEvent` comes only after the engine's current step); event-loop thread only."""
        self.job.cancel.set()
        self.events.put_nowait(CancelledEvent())

    async def cancel_async(self) -> None:
        """:meth:`cancel` as a coroutine, so Starlette runs it on the event loop (not a thread pool)."""
        self.cancel()


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone. The body has been read, so the next ASGI message is
    ``http.disconnect``; checking only while no tokens arrive would miss it on a busy engine."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _answer(state: _State, req: GenerationRequest, sub: _Submission, request: Request) -> JSONResponse:
    """Wait for the whole generation and answer it in one body."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            event = await sub.next(gone)
            if event is None:  # the client has gone: nobody reads this answer
                return _error_response(APIError(499, "The client closed the request.", None, "cancelled"))
            if isinstance(event, CancelledEvent):
                raise _shutting_down()
            if isinstance(event, FailedEvent):
                raise APIError(500, f"The engine failed on this request: {event.message}", None, "engine_error")
            if isinstance(event, TokensEvent):
                _first_token(state, sub)
                continue
            result = event.result
            text = TextStream(state.tokenizer, req.stop)
            text.push(result.tokens)
            ids = (req.prompt_ids, list(result.tokens)) if req.return_token_ids else None
            body = response_body(req.kind, new_id(req.kind), state.model_name, text.text, result.finish_reason,
                                 usage(len(req.prompt_ids), len(result.tokens)), state.stats(req, result, event.queue_time),
                                 token_ids=ids)
            return JSONResponse(body)
    finally:
        gone.cancel()
        sub.cancel()


def _first_token(state: _State, sub: _Submission) -> None:
    if not sub.first_token_seen:
        sub.first_token_seen = True
        state.metrics.time_to_first_token.observe(time.perf_counter() - sub.job.enqueued)


async def _stream(state: _State, req: GenerationRequest, sub: _Submission) -> AsyncIterator[str]:
    """Server-sent events: text deltas, a final chunk with the finish reason and statistics, [DONE]."""
    rid, model, kind = new_id(req.kind), state.model_name, req.kind
    text = TextStream(state.tokenizer, req.stop)
    try:
        if kind == "chat":
            yield _sse(chunk_body(kind, rid, model, None, first=True))
        while True:
            event = await sub.next()
            if isinstance(event, TokensEvent):
                _first_token(state, sub)
                delta = text.push(event.tokens)
                if delta:
                    yield _sse(chunk_body(kind, rid, model, delta))
            elif isinstance(event, DoneEvent):
                result = event.result
                rest = text.finish()
                if rest:
                    yield _sse(chunk_body(kind, rid, model, rest))
                yield _sse(chunk_body(kind, rid, model, None, result.finish_reason,
                                      stats=state.stats(req, result, event.queue_time)))
                if req.include_usage:
                    yield _sse(usage_chunk(kind, rid, model, usage(len(req.prompt_ids), len(result.tokens))))
                yield _sse("[DONE]")
                return
            elif isinstance(event, FailedEvent):
                yield _sse(APIError(500, f"The engine failed on this request: {event.message}", None,
                                    "engine_error").body())
                yield _sse("[DONE]")
                return
            else:  # cancelled: the server is shutting down (a client that leaves cancels this generator)
                yield _sse(_shutting_down().body())
                yield _sse("[DONE]")
                return
    finally:
        sub.cancel()  # the client went away (Starlette cancels this generator) or we are done


async def _generate(state: _State, request: Request, req: GenerationRequest) -> Response:
    sub = _Submission(state, req)
    if req.stream:
        # The background task also cancels a stream whose client left before its first chunk.
        return StreamingResponse(_stream(state, req, sub), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(sub.cancel_async))
    return await _answer(state, req, sub, request)


def create_app(bundle: LoadedBundle, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``bundle``; its engine worker starts and stops with the app's lifespan."""
    state = _State(bundle, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        _forward_stop_signals(state)
        warmup = list(state.tokenizer("Hello")["input_ids"]) if state.config.warmup else None
        state.worker.start(warmup_ids=warmup or None)
        try:
            yield
        finally:
            state.worker.close()
            for pool in state.parse_pools.values():
                pool.shutdown(wait=False, cancel_futures=True)

    # No /docs, /redoc or /openapi.json: the handlers read raw JSON, so FastAPI's generated schema would
    # describe none of the API (README and protocol.py do).
    app = FastAPI(title="boosttune", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.boosttune = state
    app.add_middleware(RequestMetricsMiddleware, metrics=state.metrics, endpoints=ENDPOINTS)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error_response(APIError(exc.status_code, message, None, code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(APIError(422, f"Invalid request: {exc.errors()}", None, "invalid_type"))

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client left before its body was read: nothing was queued, and nobody reads this answer.
        state.metrics.cancelled.inc()
        return _error_response(APIError(499, "The client closed the request.", None, "cancelled"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(APIError(500, f"Internal server error: {type(exc).__name__}", None, "internal_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that only look at the status
    async def health() -> JSONResponse:
        warming = state.worker.warming  # a readiness probe waits for it; a request sent now waits in the queue
        ok = state.worker.alive and not state.shutting_down and not warming
        status = ("shutting down" if state.shutting_down else "warming up" if warming else "ok" if ok
                  else "engine worker stopped")
        body = {"status": status, "model": state.model_name,
                "queue_depth": state.worker.queue_depth, "busy": state.worker.busy,
                "running": state.worker.running}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != state.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{state.model_name}'.",
                           "model", "model_not_found")
        return state.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _read_body(request, state.config.max_request_bytes)
        return await _generate(state, request, await state.parse(parse_completion, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _read_body(request, state.config.max_request_bytes)
        return await _generate(state, request, await state.parse(parse_chat, body))

    return app


def _forward_stop_signals(state: _State) -> None:
    """Begin the app's shutdown the moment uvicorn is told to stop by a signal.

    uvicorn (>= 0.29) handles SIGINT and SIGTERM with ``Server.handle_exit`` (installed before the
    lifespan starts), then waits for open connections, up to its grace period, before the lifespan's
    shutdown tells the app: streams would generate on through the grace period and then be cut without
    an error or ``[DONE]``. So its handlers are wrapped to end the open requests first. Signal handlers
    belong to the main thread; a server on another thread is stopped by ``ServerThread.stop``, which
    does the same.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if not isinstance(getattr(handler, "__self__", None), uvicorn.Server):
            continue  # not uvicorn's handler: leave it alone

        def forward(signum: int, frame: Any, handler: Callable = handler) -> None:
            state.request_shutdown()
            handler(signum, frame)

        # uvicorn puts back the handlers it found when it stops, so this goes with it
        signal.signal(sig, forward)


class ServerThread:
    """uvicorn serving an app on a background thread, on a port bound before it starts.

    ``with ServerThread(app) as url:`` gives ``http://127.0.0.1:PORT`` (port 0 picks a free one)
    once the server accepts connections and its engine has warmed up (``wait_ready=False``: as soon as
    it accepts them, /health answering "warming up" meanwhile), and stops it on exit. For tests and
    benchmarks.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 wait_ready: bool = True):
        self.host = host
        self.wait_ready = wait_ready
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.state: _State = app.state.boosttune
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                                    **_uvicorn_settings(self.state.config)))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        if self.wait_ready and not self.state.worker.wait_ready():
            raise RuntimeError(f"the server on {self.url} stopped during its warm-up")
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.state.request_shutdown()
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _AnnouncingServer(uvicorn.Server):
    """uvicorn's server that prints the start-up block (``banner.py``) once its sockets listen and the engine
    worker's warm-up has ended (the app's lifespan loads the models and starts the worker first); a request
    that comes sooner waits for the warm-up in the queue, and /health answers 503 "warming up" until then."""

    def __init__(self, config: uvicorn.Config, state: _State):
        super().__init__(config)
        self.state = state

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)  # exits the process when the port cannot be bound
        await asyncio.get_running_loop().run_in_executor(None, self.state.worker.wait_ready)  # the loop serves meanwhile
        listening = [s for server in getattr(self, "servers", []) for s in server.sockets or []]
        port = listening[0].getsockname()[1] if listening else self.config.port  # the real one for --port 0
        print("\n".join(startup_banner(self.config.host, port, self.state.model_name, *_drafting(self.state),
                                        _batching(self.state))), flush=True)


def _drafting(state: _State) -> tuple[list[tuple[str, str]], int, str | None]:
    """What drafts the requests: the bundle's drafters (name, kind), prompt lookup's chain length, the scheduler."""
    manifest = state.bundle.manifest
    drafters = [(d.name, d.kind) for d in manifest.models]
    if state.scheduler is not None:
        scheduler = f"learned ({manifest.scheduler_dir}/), chooses per request among {', '.join(state.scheduler.drafters) or 'its SSMs'}"
    elif manifest.scheduler_dir is not None:
        scheduler = "the bundle's is off (--no-scheduler): every request drafts with all drafters"
    else:
        scheduler = None
    return drafters, state.lookup, scheduler


def _batching(state: _State) -> str:
    """How many requests the worker decodes at once, and while how many of them draft."""
    batch = state.worker.batch
    if batch is None:
        return "one request at a time"
    return (f"up to {batch.max_batch} requests at once, {batch.max_tokens} tokens per step; trees drafted while "
            f"at most {batch.draft_max_batch} decode")


def run_server(bundle: LoadedBundle, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info") -> None:
    """Serve ``bundle`` in the foreground until interrupted (Ctrl-C) or terminated (SIGTERM: returns
    normally once the open requests have ended, so the process exits 0)."""
    app = create_app(bundle, config)
    server = _AnnouncingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                              **_uvicorn_settings(config)), app.state.boosttune)
    # uvicorn handles SIGTERM itself, then raises it again once shut down, for the handler it found
    # (the default one kills the process: exit status 143). A server that has ended its requests has
    # stopped as asked: that handler ends run_server instead (and stops a server not yet serving).
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run()  # what uvicorn.run does for an app object (no reload, one worker)
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _uvicorn_settings(config: ServerConfig) -> dict:
    """uvicorn's settings for ``config``: its h11 protocol with our deadlines (connection.py), and a grace
    period for open requests at shutdown (a backstop: the app ends them first, so connections close at once)."""
    t = config.timeouts
    return {"http": guarded_protocol(t), "timeout_keep_alive": t.keep_alive, "timeout_graceful_shutdown": 5}


class _Terminated(Exception):
    """SIGTERM outside uvicorn's own handling of it: raised again after its shutdown, or before it serves."""


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def _with_threads(threads: int | None, fn: Callable[[], float]) -> float:
    """``fn()`` on a thread of its own with ``threads`` torch threads (None: torch's default), as the
    engine's worker thread will run. For the compile: dynamo's graphs are guarded on the thread count,
    and graphs compiled on this single-threaded main thread were compiled again on the worker's first
    requests, in the middle of serving (the pooled graphs with the sizes of that moment, so that later
    sizes compiled again). A thread, not this one: the main thread must not keep an OpenMP team of its
    own (``boosttune/cli/serve.py``)."""

    def run() -> float:
        if threads:
            torch.set_num_threads(threads)
        return fn()

    with ThreadPoolExecutor(1, thread_name_prefix="boosttune-compile") as pool:
        return pool.submit(run).result()  # fn's exception, if any, raised here
