"""The compiled per-row loops of verification (``stage._native``, built from ``native/``), or
None where the extension is not built: every caller keeps its pure-Python loop as the fallback
and as the reference the differential tests compare it with.

``ROLLOUT_REASSEMBLER_NATIVE=0`` forces the Python loops (for comparisons and diagnosis).
``ROLLOUT_REASSEMBLER_REQUIRE_NATIVE=1`` is read by the test suite only: CI sets it so that a
build that silently fell back to Python fails (tests/contract/test_native_required.py).
"""

from __future__ import annotations

import os


def _load():
    if os.environ.get("ROLLOUT_REASSEMBLER_NATIVE", "1") == "0":
        return None
    try:
        from .. import _native
    except ImportError:   # no Rust toolchain where the project was installed: Python loops
        return None
    return _native


native = _load()
