"""Connection deadlines for `boosttune serve`: no client holds a connection forever.

uvicorn's HTTP/1.1 protocol (h11) times out only a connection that idles after a response. This
subclass of it adds what a hostile or broken client needs (measured on uvicorn 0.55: each held a
connection for as long as the client liked):

- a new connection that sends nothing is closed after the keep-alive timeout, as an idle one is;
- a request's headers must arrive within ``header`` seconds of their first byte (a client that sends
  half its headers and stops), else 408 and the connection is closed;
- its body must arrive within ``body`` seconds of the headers' end (a body shorter than its
  Content-Length), else 408 (or, if the answer has already gone, e.g. an early 413, just the close);
- a client that leaves the server's output unread for ``send`` seconds (its socket buffer and
  asyncio's both full) has its connection dropped, which cancels its request;
- on shutdown an idle keep-alive connection waits up to ``SHUTDOWN_LINGER`` seconds for a request
  before it closes: a request that a client sent on it as the signal came is answered (503 from the
  app) instead of finding its connection closed without an answer.

Headers are also limited in size by h11 (16 KiB: then 400). The hooks used (``handle_events``,
``pause_writing``/``resume_writing``, ``shutdown``, the keep-alive timer) are uvicorn's
``H11Protocol`` internals; tests/test_server_faults.py checks each deadline on a real server.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from boosttune.http.timeouts import ConnectionTimeouts

SHUTDOWN_LINGER = 0.5  # seconds; see the module docstring


def _timeout_response() -> bytes:
    body = json.dumps({"error": {"message": "The request did not arrive in time; the connection is closed.",
                                 "type": "invalid_request_error", "param": None, "code": "request_timeout"}})
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body.encode("ascii")))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines of :class:`ConnectionTimeouts`; see :func:`guarded_protocol`."""

    timeouts: ConnectionTimeouts = ConnectionTimeouts()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None  # "header" or "body" while a request is arriving
        self._phase_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._stopping = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
        super().connection_made(transport)
        # uvicorn arms this timer only after a response, so a connection that never sends would stay open
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        self._cancel_send_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.is_closing():
            self._set_phase(None)
            return
        their = self.conn.their_state
        if their is h11.IDLE and self.conn.trailing_data[0]:
            self._set_phase("header")  # a request's first bytes are here, its headers not yet whole
        elif their is h11.SEND_BODY:
            self._set_phase("body")
        else:
            self._set_phase(None)
        if self._stopping and self.cycle is not None:
            self.cycle.keep_alive = False  # a request that arrived during shutdown: answer it, then close

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # the deadline runs from the phase's start, not from each new byte
        if self._phase_timer is not None:
            self._phase_timer.cancel()
            self._phase_timer = None
        self._phase = phase
        if phase is not None:
            seconds = self.timeouts.header if phase == "header" else self.timeouts.body
            self._phase_timer = self.loop.call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        self._phase_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self._phase == "body" else None
        if cycle is None or not cycle.response_started:
            self.transport.write(_timeout_response())
        if cycle is not None:  # the app, if still reading the body, sees the client gone
            cycle.disconnected = True
            cycle.message_event.set()
        self._phase = None
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.timeouts.send, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_send_timer()

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        self.transport.abort()  # the client reads nothing: drop what is buffered (close() would wait for it)

    def shutdown(self) -> None:
        self._stopping = True
        if self.cycle is not None and not self.cycle.response_complete:
            super().shutdown()  # a request in progress: close once it is answered
        elif self._phase is None:
            # idle: a request may already be on its way; give it a moment to arrive, then close
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(min(SHUTDOWN_LINGER, self.timeout_keep_alive),
                                                                self.timeout_keep_alive_handler)
        # else a request's headers or body are arriving: it is answered (503), or its deadline closes it


def guarded_protocol(timeouts: ConnectionTimeouts) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` class with ``timeouts``, for ``uvicorn.Config(http=...)``
    (uvicorn creates the protocol itself, so its settings travel as a class attribute)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"timeouts": timeouts})
