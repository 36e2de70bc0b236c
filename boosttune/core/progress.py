"""Progress of long phases: a tqdm bar on a terminal, plain lines where output goes to a file.

tqdm hides its bar when stderr is not a terminal (``disable=None``), so a cluster job's log (SLURM,
torchrun, ``boosttune train > log``) showed nothing for the many minutes of prompt growth and
teacher generation. :func:`progress` gives those a line per phase every ``interval`` seconds (and at
the end) with the figures the bar shows: done/total, rate, ETA and the phase's own postfix.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from tqdm import tqdm

DEFAULT_INTERVAL_S = 30.0


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class LineProgress:
    """The part of tqdm's interface the phases use, writing one plain line per ``interval`` seconds."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", interval: float = DEFAULT_INTERVAL_S, file: TextIO | None = None):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.file = file or sys.stderr
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self.start = self.last = time.monotonic()
        self.closed = False
        self._written: int | None = None  # the count of the last line written

    def __iter__(self) -> Iterator:
        assert self.iterable is not None
        for x in self.iterable:
            yield x
            self.update(1)
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.total is not None and self.n >= self.total:
            return  # the closing line gives the final count
        if now - self.last >= self.interval:
            self.last = now
            self._write(now)

    def set_postfix(self, **kw: Any) -> None:
        self.postfix.update(kw)

    def close(self) -> None:
        """Write the closing line, once; it repeats no count a line already gave (an unknown total's last
        update may have been written just before)."""
        if self.closed:
            return
        self.closed = True
        now = time.monotonic()
        if self._written == self.n:
            print(f"[boosttune] {self.desc}: done, elapsed {_duration(now - self.start)}", file=self.file, flush=True)
        else:
            self._write(now, done=True)

    def line(self, now: float, done: bool = False) -> str:
        elapsed = now - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.n}/{self.total}" if self.total is not None else f"{self.n}", self.unit]
        text = f"[boosttune] {self.desc}: {' '.join(parts)}"
        if self.total:
            text += f" ({100 * self.n / self.total:.0f}%)"
        text += f", {rate * 60:.1f} {self.unit}/min, elapsed {_duration(elapsed)}"
        if not done and self.total and rate > 0:
            text += f", ETA {_duration((self.total - self.n) / rate)}"
        if self.postfix:
            text += ", " + ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        return text + (" (done)" if done else "")

    def _write(self, now: float, done: bool = False) -> None:
        self._written = self.n
        print(self.line(now, done), file=self.file, flush=True)


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             file: TextIO | None = None):
    """A tqdm bar when stderr is a terminal, else a :class:`LineProgress` (interval from the
    ``BOOSTTUNE_PROGRESS_INTERVAL`` environment variable, seconds, default 30)."""
    stream = file or sys.stderr
    if stream.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, dynamic_ncols=True, file=stream)
    interval = float(os.environ.get("BOOSTTUNE_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S))
    return LineProgress(iterable, total=total, desc=desc, unit=unit, interval=interval, file=stream)
