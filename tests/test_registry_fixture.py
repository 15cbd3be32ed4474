"""The real-registry fixture's own rules (tests/support/apicurio.py): where the distribution or a
Java >= 21 is missing, the Schema Registry tests skip with the reason, except under CI (.ci/run
sets CI), where they fail; the version is the Makefile's."""

import re
from pathlib import Path

import pytest

import tests.support.apicurio as apicurio

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_and_the_cache_directory_are_the_makefiles():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^APICURIO_VERSION\s*:=\s*" + re.escape(apicurio.VERSION) + r"$", makefile, re.M)
    assert "apicurio-registry" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^test: .*\bapicurio-registry\b", makefile, re.M)


def test_a_missing_distribution_skips_locally_and_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setattr(apicurio, "DIST", tmp_path / "absent")
    reason = apicurio.apicurio_unavailable()
    assert "make apicurio-registry" in reason
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make apicurio-registry"):
        apicurio.require_apicurio()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="under CI the Schema Registry tests must run"):
        apicurio.require_apicurio()


def test_a_java_older_than_21_is_not_enough(monkeypatch, tmp_path):
    home = tmp_path / "jdk-17"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text("#!/bin/sh\nexit 1\n")
    (home / "release").write_text('JAVA_VERSION="17.0.15"\n')
    assert apicurio._java_major(java) == 17
    (home / "release").write_text('JAVA_VERSION="25.0.1"\n')
    assert apicurio._java_major(java) == 25
    monkeypatch.setattr(apicurio, "find_java", lambda minimum=21: None)
    monkeypatch.setattr(apicurio, "DIST", tmp_path)
    (tmp_path / "quarkus-run.jar").write_text("")
    assert "needs Java >= 21" in apicurio.apicurio_unavailable()
