"""Crash injection for fault tests: ``ROLLOUT_REASSEMBLER_FAULT=<point>:<n>`` kills the process
with SIGKILL (no cleanup, like kill -9) the n-th time execution reaches ``<point>``.

Points: ``before_begin``, ``after_produce`` (inside an open transaction), ``before_commit``,
``after_commit``, ``after_intake``. Unset in production: the check is one dict lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_ENV = "ROLLOUT_REASSEMBLER_FAULT"
_hits: Counter = Counter()


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(_ENV)
    if not spec:
        return None
    point, _, count = spec.partition(":")
    return point, int(count or 1)


def crash_point(name: str) -> None:
    target = _target()
    if target is None or target[0] != name:
        return
    _hits[name] += 1
    if _hits[name] >= target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
