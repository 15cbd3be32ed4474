"""What a test run says about its brokers: the summary names the broker each suite used, a
failed test carries the broker's log, and the JVM broker's log has its INFO lines (the jar set
once paired slf4j-api 1.7 with log4j's slf4j2 binding, and the broker logged nothing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.kraft import KraftBroker, jars_available
from tests.support.report import ROOT

CONFTEST = textwrap.dedent('''
    import pytest
    from tests.support.report import STARTED, pytest_runtest_makereport, pytest_terminal_summary  # noqa: F401

    class FakeBroker:
        kind = "fake"
        bootstrap = "127.0.0.1:1"
        description = "fake broker at 127.0.0.1:1"
        def log_tail(self, lines):
            return "line one of the broker log\\nKafka Server started"

    @pytest.fixture(scope="session")
    def kafka():
        STARTED["kafka"] = FakeBroker()
        yield STARTED["kafka"]
''')


def test_summary_names_the_broker_and_failures_carry_its_log(tmp_path):
    suite = tmp_path / "tests" / "integration"
    suite.mkdir(parents=True)
    (tmp_path / "tests" / "conftest.py").write_text(CONFTEST)
    (suite / "test_x.py").write_text("def test_ok(kafka):\n    pass\n\n"
                                     "def test_bad(kafka):\n    assert False\n\n"
                                     "def test_no_broker():\n    assert False\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir",
                             str(tmp_path), str(tmp_path / "tests")], capture_output=True, text=True,
                            cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    out = result.stdout
    assert result.returncode == 1, out
    assert "brokers used" in out
    assert "fake broker at 127.0.0.1:1: 1 passed, 1 failed, 0 skipped" in out
    assert out.count("kafka broker log (fake broker at 127.0.0.1:1)") == 1  # test_bad only
    assert "Kafka Server started" in out


@pytest.mark.skipif(not jars_available(), reason="no Kafka jars (make kafka-jars) or no java")
def test_jvm_broker_logs_at_info():
    broker = KraftBroker().start()
    try:
        log = broker.log_tail(5000)
    finally:
        broker.discard()
    assert " INFO " in log and "(kafka.server." in log, log[-2000:]
    assert not broker.dir.exists()     # its data and logs went with it (GBs after a benchmark)
