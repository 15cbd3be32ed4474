"""``bench e2e --profile-stage FILE``: sample the stage process's CPU by function (issue 31).

py-spy (not a dependency of the project: ``pip install --target DIR py-spy`` and put DIR/bin on
PATH, or set ``PY_SPY``) attaches to the ``rollout-reassembler run`` process of the latency phase
once it is ready (imports and start-up are left out) and writes collapsed stacks (``-f raw``: one
line per distinct stack, ``frame;frame;... count``, root first), sampling only the thread that
holds the GIL (``--gil``): the stage's Python CPU, not the C work that releases the GIL (large
SHA-256 updates, librdkafka's own threads). ``summarize`` turns them into CPU per input record by
function: self time (the leaf frame) and inclusive time (any frame of the stack; the threads'
and the command line's entry points left out).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections import Counter

RATE_HZ = 100
# frames on (nearly) every stack: the threads' and the command line's entry points
_WRAPPERS = ("threading.py:", "concurrent/futures/", "<frozen runpy>:", "stage/cli/", "stage/__main__.py:",
             "stage/runtime/loop.py:StageRuntime.run", "stage/runtime/loop.py:StageRuntime.step")
# "function (path:line)": the line number varies within one function; the key drops it
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<path>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str:
    found = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not found:
        raise RuntimeError("--profile-stage needs py-spy: pip install --target DIR py-spy, then put "
                           "DIR/bin on PATH or set PY_SPY to the executable")
    return found


class Sampler:
    """py-spy attached to one process until ``stop`` (SIGINT: py-spy writes its file and exits)."""

    def __init__(self, pid: int, path: str) -> None:
        self.path = path
        self.proc = subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--rate", str(RATE_HZ),
                                      "--format", "raw", "--output", path,
                                      # the threads holding the GIL (its Python CPU: idle threads are
                                      # not told apart from running ones in every container), without
                                      # pausing the process (a paused stage falls behind its feed)
                                      "--gil", "--nonblocking"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def frame_key(frame: str) -> str:
    """``func (path:line)`` -> ``path:func`` with the path shortened to the package's own."""
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match["path"]
    for marker in ("/stage/", "site-packages/", "python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1] if marker != "/stage/" else "stage/" + path.split(marker, 1)[1]
            break
    return f"{path}:{match['func']}"


def summarize(path: str, records: int, top: int = 15) -> dict:
    """Samples by function: {"samples", "cpu_s", "per_record_us", "self": [...], "inclusive": [...]},
    each entry (function, share of the samples, microseconds of CPU per input record)."""
    self_counts: Counter = Counter()
    incl_counts: Counter = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = [frame_key(x) for x in stack.split(";") if x]
            if not frames:
                continue
            total += n
            self_counts[frames[-1]] += n
            for key in set(frames):
                if not key.startswith(_WRAPPERS):
                    incl_counts[key] += n
    cpu_s = total / RATE_HZ
    per = 1e6 / RATE_HZ / max(records, 1)

    def rows(counter: Counter) -> list:
        return [(name, n / max(total, 1), n * per) for name, n in counter.most_common(top)]

    return {"samples": total, "rate_hz": RATE_HZ, "cpu_s": cpu_s, "records": records,
            "per_record_us": total * per, "self": rows(self_counts), "inclusive": rows(incl_counts)}


def print_summary(summary: dict) -> None:
    print(f"stage process, GIL held (py-spy --gil, {summary['rate_hz']} Hz): {summary['samples']} samples "
          f"= {summary['cpu_s']:.2f} s for {summary['records']:,} input records, "
          f"{summary['per_record_us']:.0f} us a record")
    for kind in ("self", "inclusive"):
        print(f"  by function, {kind} (share, us a record):")
        for name, share, us in summary[kind]:
            print(f"    {share:6.1%} {us:8.1f}  {name}")
