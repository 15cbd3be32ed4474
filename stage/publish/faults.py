"""Fault injection for fault tests: ``ROLLOUT_REASSEMBLER_FAULT=<point>:<n>[:<action>]`` acts the
n-th time execution reaches ``<point>``. Actions: ``kill`` (the default: SIGKILL, no cleanup,
like kill -9) and ``stop`` (SIGSTOP: the process freezes there, as a replica does when its VM
is paused or its CPU throttled, until someone sends SIGCONT).

Points: ``before_begin``, ``after_produce`` (inside an open transaction), ``before_commit``
(offsets sent, transaction not committed), ``after_commit``. Unset in
production: the check is one dict lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_ENV = "ROLLOUT_REASSEMBLER_FAULT"
_ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_hits: Counter = Counter()


def _target() -> tuple[str, int, str] | None:
    spec = os.environ.get(_ENV)
    if not spec:
        return None
    point, _, rest = spec.partition(":")
    count, _, action = rest.partition(":")
    if (action or "kill") not in _ACTIONS:
        raise ValueError(f"{_ENV}: unknown action {action!r} (kill, stop)")
    return point, int(count or 1), action or "kill"


def crash_point(name: str) -> None:
    target = _target()
    if target is None or target[0] != name:
        return
    _hits[name] += 1
    if _hits[name] == target[1] or (target[2] == "kill" and _hits[name] > target[1]):
        os.kill(os.getpid(), _ACTIONS[target[2]])
