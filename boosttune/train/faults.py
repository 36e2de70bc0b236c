"""Deterministic crash points for the resume tests: ``BOOSTTUNE_KILL_AT=point:n`` makes the process
SIGKILL itself (kill -9: no cleanup, no finally blocks) the n-th time it passes ``point``.

Points: ``teacher-shard-tmp`` (a shard's temporary file is written, not yet renamed),
``teacher-shard`` (a shard is in place), ``checkpoint`` (a training checkpoint is in place),
``ssm-saved`` (a stage's SSM is saved, its summary not yet written).
"""

from __future__ import annotations

import os
import signal

POINTS = ("teacher-shard-tmp", "teacher-shard", "checkpoint", "ssm-saved")
"""Every crash point the code passes (tests/test_train_resume.py kills a run at each)."""
_counts: dict[str, int] = {}


def crash_point(point: str) -> None:
    assert point in POINTS, point
    spec = os.environ.get("BOOSTTUNE_KILL_AT")
    if not spec:
        return
    name, _, n = spec.partition(":")
    if name != point:
        return
    _counts[point] = _counts.get(point, 0) + 1
    if _counts[point] == int(n or 1):
        os.kill(os.getpid(), signal.SIGKILL)
