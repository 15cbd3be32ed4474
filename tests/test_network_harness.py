"""The network fault suite's own rules (tests/faults/net/), without a broker: Toxiproxy missing
skips the suite locally and fails it under CI (.ci/run sets CI), the build is a prerequisite of
what CI runs, and the transaction coordinator is found as Kafka finds it."""

import re
from pathlib import Path

import pytest

import tests.faults.net.toxiproxy as toxiproxy
from tests.faults.net.cluster import java_string_hash, transaction_log_partition

ROOT = Path(__file__).resolve().parents[1]


def test_toxiproxy_is_built_for_what_ci_runs():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\btoxiproxy\b", makefile, re.M)
    assert re.search(r"^test-jvm: .*\btoxiproxy\b", makefile, re.M)
    assert re.search(r"^make -j3 .*\btoxiproxy\b", (ROOT / ".ci" / "run").read_text(), re.M)
    assert "toxiproxy-server" in makefile and toxiproxy.BINARY.name == "toxiproxy-server"


def test_a_missing_toxiproxy_skips_locally_and_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setattr(toxiproxy, "BINARY", tmp_path / "absent")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make toxiproxy"):
        toxiproxy.require_toxiproxy()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="missing under CI"):
        toxiproxy.require_toxiproxy()


def test_the_coordinator_partition_is_kafkas():
    # Java's String.hashCode: "hello" 99162322, "" 0, a non-BMP character as two UTF-16 units;
    # "polygenelubricants" hashes to Integer.MIN_VALUE, which Kafka's Utils.abs maps to 0
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("") == 0
    assert java_string_hash("\U0001F600") == 31 * 0xD83D + 0xDE00
    assert java_string_hash("polygenelubricants") == -(1 << 31)
    assert transaction_log_partition("polygenelubricants", 50) == 0
    assert transaction_log_partition("hello", 4) == 99162322 % 4
    assert transaction_log_partition("Aa", 7) == transaction_log_partition("BB", 7)   # equal hashes
