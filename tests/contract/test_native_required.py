"""CI proves the compiled path ran: with ROLLOUT_REASSEMBLER_REQUIRE_NATIVE=1 (set by the
Makefile's test targets) a missing or unusable stage._native fails the suite instead of
passing on the Python fallback, e.g. when `make install` found no cargo on PATH."""

from __future__ import annotations

import os

import pytest

import stage.contract.linearized as linearized_module
import stage.contract.packed as packed_module
import stage.contract.verify as verify_module
from stage.contract.native import native

REQUIRED = os.environ.get("ROLLOUT_REASSEMBLER_REQUIRE_NATIVE") == "1"


@pytest.mark.skipif(not REQUIRED, reason="ROLLOUT_REASSEMBLER_REQUIRE_NATIVE is not 1")
def test_the_compiled_module_is_built_and_used():
    assert native is not None, (
        "stage._native is not importable (or ROLLOUT_REASSEMBLER_NATIVE=0): install with cargo on "
        "PATH (`make install` adds ~/.cargo/bin) or rebuild it with `make native`")
    assert packed_module._native is verify_module._native is linearized_module._native is native
    for name in ("check_columns", "call_digests", "chain_walk", "build_all"):
        assert callable(getattr(native, name)), name
