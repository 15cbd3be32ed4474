"""Test-only launcher: ``python -m tests.faults.launch --config x.yaml`` == ``python -m stage run``
with the crash point taken from ``STAGE_TEST_FAULT`` and, optionally, armed only once the file
named by ``STAGE_TEST_FAULT_ARM_FILE`` exists, so a test can pick the moment ("die inside the
next transaction") instead of counting transactions. Everything else is the real CLI path;
setting ``ROLLOUT_REASSEMBLER_FAULT`` directly works too (test_fault_env_...).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import stage.config.model as config

_SPEC = os.environ.pop("STAGE_TEST_FAULT", None)
# Optional: arm the fault only once this file exists, so a test can pick the moment
# ("die inside the next transaction") instead of counting transactions.
_ARM_FILE = os.environ.pop("STAGE_TEST_FAULT_ARM_FILE", None)
_load_config = config.load_config


def _arm() -> None:
    os.environ["ROLLOUT_REASSEMBLER_FAULT"] = _SPEC   # read by stage.publish.faults at each point


def _arm_when_file_appears() -> None:
    while not os.path.exists(_ARM_FILE):
        time.sleep(0.02)
    _arm()


def _load_then_arm(*args, **kwargs):
    cfg = _load_config(*args, **kwargs)
    if _SPEC and _ARM_FILE:
        threading.Thread(target=_arm_when_file_appears, daemon=True).start()
    elif _SPEC:
        _arm()
    return cfg


config.load_config = _load_then_arm

if __name__ == "__main__":
    from stage.cli import main
    sys.exit(main(["run", *sys.argv[1:]]))
