"""pytest hooks (imported by tests/conftest.py): the terminal summary says which broker each
suite's tests ran against, and a failed test that used a broker gets the broker's log tail as a
report section (the container's output, or the JVM broker's log file)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# fixture name -> the started broker (set by the session fixtures in tests/conftest.py)
STARTED: dict[str, object] = {}
# (suite, fixture) -> [passed, failed, skipped] of the tests that used it
_USED: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
LOG_LINES = 200


def _suite(item) -> str:
    try:
        parts = Path(item.path).resolve().relative_to(ROOT).parts
    except ValueError:
        return str(item.path)
    return "/".join(parts[:2]) if len(parts) > 2 else "/".join(parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    for name in ("kafka", "tansu", "apicurio", "apicurio_persistent"):
        if name not in getattr(item, "fixturenames", ()):
            continue
        if report.when == "call" or (report.when == "setup" and not report.passed):
            counts = _USED[(_suite(item), name)]
            counts[0 if report.passed else 2 if report.skipped else 1] += 1
        broker = STARTED.get(name)
        if report.failed and broker is not None and hasattr(broker, "log_tail"):
            report.sections.append((f"{name} broker log ({broker.description}), last {LOG_LINES} lines",
                                    broker.log_tail(LOG_LINES)))


def describe(name: str) -> str:
    broker = STARTED.get(name)
    if broker is None:
        return "none started (tests skipped)"
    description = getattr(broker, "description", None)
    return description or f"{broker.kind} at {broker.bootstrap}"


def pytest_terminal_summary(terminalreporter):
    if not _USED:
        return
    terminalreporter.write_sep("-", "brokers used")
    for (suite, name), (passed, failed, skipped) in sorted(_USED.items()):
        terminalreporter.write_line(f"{suite:<28} {name:<6} {describe(name)}: "
                                    f"{passed} passed, {failed} failed, {skipped} skipped")
