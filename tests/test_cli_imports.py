"""Commands that need no torch do not import it: ``--help``, ``topics``, ``inspect`` and
``dead-letters`` start in a fraction of a second instead of the seconds importing torch takes
(and without its ~300 MB). Each command runs in a fresh interpreter that reports, at exit,
which heavy modules were imported; the start-up times are printed (``-s``), never asserted.
The commands themselves run against the real broker in tests/debug/test_cli_commands_light.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch",)

# Runs ``rollout-reassembler ARGS`` as ``python -m stage`` does, then prints on stderr which of
# HEAVY it imported (atexit: also after SystemExit from argparse or main()).
_PROBE = """
import atexit, json, runpy, sys
atexit.register(lambda: sys.stderr.write("\\nHEAVY=" + json.dumps(
    sorted(m for m in {heavy!r} if m in sys.modules)) + "\\n"))
sys.argv = ["rollout-reassembler", *{args!r}]
runpy.run_module("stage", run_name="__main__")
"""


def run_probed(*args: str, timeout: float = 120.0) -> tuple[subprocess.CompletedProcess, list[str], float]:
    """(the finished process, the heavy modules it imported, its wall time in seconds)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY, args=list(args))],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    elapsed = time.perf_counter() - started
    marker = [line for line in proc.stderr.splitlines() if line.startswith("HEAVY=")]
    assert marker, f"the probe did not report (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc, json.loads(marker[-1].split("=", 1)[1]), elapsed


def test_help_of_every_command_imports_no_torch():
    for args in (["--help"], ["topics", "create", "--help"], ["topics", "check", "--help"],
                 ["inspect", "--help"], ["dead-letters", "list", "--help"],
                 ["dead-letters", "replay", "--help"], ["broker", "--help"], ["run", "--help"]):
        proc, heavy, elapsed = run_probed(*args)
        print(f"rollout-reassembler {' '.join(args)}: {elapsed:.2f} s, imported {heavy or 'no torch'}")
        assert proc.returncode == 0, proc.stderr
        assert "usage: rollout-reassembler" in proc.stdout
        assert heavy == [], f"`rollout-reassembler {' '.join(args)}` imported {heavy}"


def test_modules_of_the_light_commands_import_no_torch():
    """Everything `topics`, `inspect` and `dead-letters` import and build, short of a broker."""
    code = """
import json, sys
from stage.config.model import StageConfig, load_config
from stage.debug import cli, deadletters, inspect_group, kafka, text
from stage.runtime.kafka import clients, registry, topics
from stage.wire.partitioner import partition_for
cfg = load_config(None, {})
codecs = registry.build_codecs(cfg)
value = codecs["LedgerEntry"].encode({"group_id": "g", "partition": 0, "max_receipt_offset": 1,
    "max_staged_offset": 2, "outcome": "complete", "published_at_ms": 3, "output_digest": ""})
assert codecs["LedgerEntry"].decode(value)["group_id"] == "g"
topics.topic_specs(cfg, 2, 1, 1 << 20, 1)
print(json.dumps(sorted(m for m in %r if m in sys.modules)))
""" % (HEAVY,)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_the_stage_still_imports_what_it_needs_on_first_use():
    """The lazy package exports resolve to the real objects (and unknown names still fail)."""
    import pytest

    import stage.client
    import stage.finalize
    import stage.publish
    import stage.routes
    import stage.wire
    from stage.client.reader import CanonicalReader
    from stage.finalize.group import GroupFinalizer
    from stage.wire.tensors import pack_tensor

    assert stage.client.CanonicalReader is CanonicalReader
    assert stage.finalize.Reassembler is stage.finalize.GroupFinalizer is GroupFinalizer
    assert stage.wire.pack_tensor is pack_tensor
    for package in (stage.client, stage.finalize, stage.publish, stage.routes, stage.wire):
        missing = [name for name in package.__all__ if not hasattr(package, name)]
        assert not missing, f"{package.__name__} lists names it cannot import: {missing}"
        with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
            package.no_such_name  # noqa: B018
