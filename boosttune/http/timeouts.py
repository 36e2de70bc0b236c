"""How long a client of `boosttune serve` may take (kept apart from connection.py, which imports uvicorn,
so that the command line reads the defaults without loading the server)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ConnectionTimeouts:
    """How long (seconds) a client may take at each point of a connection.

    Attributes:
        keep_alive: an idle connection (new, or after a response) is closed after this long.
        header: a request's headers must arrive within this long of their first byte (then 408).
        body: a request's body must arrive within this long of the end of its headers (then 408).
        send: a client that reads none of the server's output for this long is disconnected.
    """

    keep_alive: float = 5.0
    header: float = 10.0
    body: float = 60.0
    send: float = 60.0

    def __post_init__(self) -> None:
        for name in ("keep_alive", "header", "body", "send"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"server timeout {name} must be a positive number of seconds, got {value!r}")
