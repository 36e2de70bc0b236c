"""The engine worker: one thread owns the (not thread-safe) engine and serves a queue of jobs.

HTTP handlers run on the server's event loop; they enqueue a :class:`Job` and receive its events
(tokens, then done / failed / cancelled) through ``Job.deliver``, which the worker calls from its
thread (the server wraps it with ``loop.call_soon_threadsafe``). A client that goes away sets
``Job.cancel``: a queued job is then skipped, and a running one stops after the current step, so its
slot frees at once.

With ``max_batch`` > 1 (and an engine that can batch, ``serving/batch.py``) the worker decodes up to
that many jobs at once: between steps, waiting jobs join the batch (each prefilled as it joins) and
finished or cancelled ones leave it; every step verifies all of their trees in one LLM forward.
Otherwise it runs one job at a time, in arrival order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from boosttune.assemble import Served
from boosttune.serving.batch import DRAFT_MAX_BATCH, BatchedDecoder, Member, Request, batch_reason
from boosttune.serving.engine import GenerationResult
from boosttune.serving.sampling import SamplingParams
from boosttune.serving.stops import StopCriteria

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokensEvent:
    """Tokens committed by one engine step."""

    tokens: list[int]


@dataclass(frozen=True)
class DoneEvent:
    """The job finished; ``queue_time`` is the seconds it waited before the engine took it."""

    result: GenerationResult
    queue_time: float


@dataclass(frozen=True)
class FailedEvent:
    """The engine raised; the server stays up and answers this request with a 500."""

    message: str


@dataclass(frozen=True)
class CancelledEvent:
    """The job was cancelled (its client disconnected) before or while it ran."""


Event = TokensEvent | DoneEvent | FailedEvent | CancelledEvent


@dataclass
class Job:
    """One generation request as the worker sees it.

    Attributes:
        prompt_ids: the prompt's token ids.
        stop: when to stop (its tokenizer, if any, is used on the worker thread only).
        sampling: greedy or sampling parameters.
        deliver: receives the job's events, called from the worker thread.
        cancel: set by the server when the client has gone; checked after every engine step.
        enqueued: ``time.perf_counter()`` when the job was submitted.
        chat: the prompt went through the chat template (a scheduler feature).
    """

    prompt_ids: list[int]
    stop: StopCriteria
    sampling: SamplingParams
    deliver: Callable[[Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    chat: bool = True


class QueueFullError(RuntimeError):
    """More jobs are waiting than the worker's ``max_queue`` allows."""


class _Cancelled(Exception):
    """Raised from the token callback to abandon a job whose client has gone."""


class EngineWorker:
    """Runs jobs on a dedicated thread: up to ``max_batch`` at once, joining in arrival order."""

    def __init__(self, served: Served, max_queue: int = 64,
                 on_finished: Callable[[Job, Event], None] | None = None, threads: int | None = None,
                 max_batch: int = 1, max_batch_tokens: int = 64, draft_max_batch: int = DRAFT_MAX_BATCH):
        """``served``: the assembled engine (``boosttune/assemble.py``; its scheduler, if any, plans
        every request); ``on_finished(job, final_event)`` runs on the worker thread after each job
        (metrics); ``threads``: torch intra-op threads of the worker (None: torch's default);
        ``max_batch``: jobs decoded at once (1: one at a time); ``max_batch_tokens``: tokens one
        batched step may verify in all; ``draft_max_batch``: requests draft only while at most this
        many decode at once (``BatchedDecoder``)."""
        self.served = served
        self.threads = threads
        self.batch: BatchedDecoder | None = None
        if max_batch > 1:
            why = batch_reason(served.engine)
            if why is None:
                self.batch = BatchedDecoder(served.engine, max_batch, max(max_batch_tokens, max_batch), draft_max_batch)
            else:
                log.warning("serving one request at a time: this engine cannot batch requests (%s)", why)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._on_finished = on_finished
        self._thread = threading.Thread(target=self._run, name="boosttune-engine", daemon=True)
        self._current: Job | None = None
        self._warmup_ids: list[int] | None = None
        self._ready = threading.Event()  # set once the warm-up has ended (or there was none)

    def start(self, warmup_ids: list[int] | None = None) -> None:
        """Start the thread; with ``warmup_ids`` it first generates a few tokens after them, so
        that lazy initialisation is not paid by the first request (which waits in the queue)."""
        self._warmup_ids = warmup_ids
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the running and the waiting jobs, and stop the thread."""
        current = self._current
        if current is not None:
            current.cancel.set()
        for member in list(self.batch.members if self.batch is not None else []):
            member.tag[0].cancel.set()  # a batched job's tag: (job, queue time)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.deliver(CancelledEvent())
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`QueueFullError` when the queue is full."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine worker is not running")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFullError(f"{self._queue.maxsize} requests are already waiting") from None

    @property
    def queue_depth(self) -> int:
        """Jobs waiting (the running one excluded)."""
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None or self.running > 0

    @property
    def running(self) -> int:
        """Jobs being decoded now."""
        return len(self.batch) if self.batch is not None else int(self._current is not None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def warming(self) -> bool:
        """Started and still generating its warm-up; requests wait in the queue meanwhile."""
        return self._thread.is_alive() and not self._ready.is_set()

    def wait_ready(self, poll: float = 0.1) -> bool:
        """Block until the warm-up has ended (True) or the thread has stopped without ending it (False)."""
        while not self._ready.wait(poll):
            if not self._thread.is_alive():
                return self._ready.is_set()
        return True

    def _run(self) -> None:
        # Subnormal floats made badly scaled models ~60x slower on CPU (see boosttune/cli/__init__.py, which
        # sets this for the main thread); the setting is per thread, so the engine's thread sets its own.
        torch.set_flush_denormal(True)
        if self.threads:
            torch.set_num_threads(self.threads)
        if self._warmup_ids:
            try:
                self.served.generate(self._warmup_ids, StopCriteria(max_new_tokens=4))
            except Exception:
                log.exception("engine warm-up failed")
        self._ready.set()
        if self.batch is not None:
            self._run_batched(self.batch)
            return
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancel.is_set():
                self._finish(job, CancelledEvent())
                continue
            self._current = job
            try:
                self._finish(job, self._generate(job))
            finally:
                self._current = None

    def _run_batched(self, batch: BatchedDecoder) -> None:
        """Admit waiting jobs while the batch has room, drop cancelled ones, step, hand out the finished."""
        while True:
            jobs: list[Job] = []
            while len(batch) + len(jobs) < batch.max_batch:
                try:
                    job = self._queue.get(block=not len(batch) and not jobs)  # wait only when nothing is decoding
                except queue.Empty:
                    break
                if job is None:
                    for job in jobs:
                        self._finish(job, CancelledEvent())
                    for member in list(batch.members):
                        self._leave(batch, member, CancelledEvent())
                    return
                jobs.append(job)
            self._admit(batch, jobs)
            for member in list(batch.members):
                job, _ = member.tag
                if job.cancel.is_set():
                    self._leave(batch, member, CancelledEvent())
            if not len(batch):
                continue
            try:
                left = batch.step()
            except Exception as e:  # the shared forward failed: every job in it fails, the worker stays up
                log.exception("engine failed on a batched step")
                for member in list(batch.members):
                    self._leave(batch, member, FailedEvent(f"{type(e).__name__}: {e}"))
                continue
            for member in left:
                job, queue_time = member.tag
                if member.error is not None:
                    log.error("engine failed on a request", exc_info=member.error)
                    self._finish(job, FailedEvent(f"{type(member.error).__name__}: {member.error}"))
                else:
                    self._finish(job, DoneEvent(member.stream.result(), queue_time))

    def _admit(self, batch: BatchedDecoder, jobs: list[Job]) -> None:
        """Prefill ``jobs`` into the batch, their prompts together (or finish them: cancelled, or failed)."""
        requests, admitted = [], []
        for job in jobs:
            if job.cancel.is_set():
                self._finish(job, CancelledEvent())
                continue
            queue_time = time.perf_counter() - job.enqueued
            try:
                planner = self.served.planner(job.prompt_ids, job.chat)
            except Exception as e:  # one bad request must not stop the worker
                log.exception("engine failed on a request")
                self._finish(job, FailedEvent(f"{type(e).__name__}: {e}"))
                continue
            requests.append(Request(job.prompt_ids, job.stop, job.sampling, _deliver(job), planner,
                                    tag=(job, queue_time)))
            admitted.append(job)
        if not requests:
            return
        try:
            outs = batch.add_many(requests)
        except Exception as e:
            outs = [e] * len(requests)
        for job, out in zip(admitted, outs, strict=True):
            if isinstance(out, Exception):
                log.error("engine failed on a request", exc_info=out)
                self._finish(job, FailedEvent(f"{type(out).__name__}: {out}"))

    def _leave(self, batch: BatchedDecoder, member: Member, event: Event) -> None:
        batch.remove(member)
        job, _ = member.tag
        self._finish(job, event)

    def _generate(self, job: Job) -> Event:
        queue_time = time.perf_counter() - job.enqueued

        def on_tokens(tokens: list[int]) -> None:
            if job.cancel.is_set():
                raise _Cancelled
            job.deliver(TokensEvent(list(tokens)))

        try:
            result = self.served.generate(job.prompt_ids, job.stop, job.sampling, on_tokens, chat=job.chat)
        except _Cancelled:
            return CancelledEvent()
        except Exception as e:  # one bad request must not stop the worker
            log.exception("engine failed on a request")
            return FailedEvent(f"{type(e).__name__}: {e}")
        return DoneEvent(result, queue_time)

    def _finish(self, job: Job, event: Event) -> None:
        try:
            job.deliver(event)
        finally:
            if self._on_finished is not None:
                try:
                    self._on_finished(job, event)
                except Exception:
                    log.exception("on_finished hook failed")


def _deliver(job: Job) -> Callable[[list[int]], None]:
    """The callback that hands a request's newly committed tokens to its job."""

    def on_tokens(tokens: list[int]) -> None:
        job.deliver(TokensEvent(list(tokens)))

    return on_tokens
