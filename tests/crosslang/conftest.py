"""The Go producer binary, built once per source state into the ignored .cache/bin (Go module
proxy on the first build; skipped only where there is no `go`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).resolve().parent / "goproducer"
BIN = ROOT / ".cache" / "bin"


def source_digest() -> str:
    """Changes whenever a file the build reads changes (go.mod, go.sum, *.go)."""
    h = hashlib.sha256()
    for path in sorted(SOURCE.iterdir()):
        if path.name in ("go.mod", "go.sum") or path.suffix == ".go":
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def build_go_producer() -> Path:
    target = BIN / f"goproducer-{source_digest()}"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    BIN.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-buildvcs=false")
    started = time.monotonic()
    done = subprocess.run(["go", "build", "-trimpath", "-o", str(partial), "."], cwd=SOURCE, env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        pytest.fail(f"building tests/crosslang/goproducer failed:\n{done.stderr[-4000:]}")
    os.replace(partial, target)
    for old in BIN.glob("goproducer-*"):  # superseded builds of older sources
        if old != target and not old.name.endswith(".tmp"):
            old.unlink(missing_ok=True)
    print(f"built {target.name} in {time.monotonic() - started:.1f} s")
    return target


@pytest.fixture(scope="session")
def go_producer() -> Path:
    if shutil.which("go") is None:
        pytest.skip("the Go producer needs the Go toolchain (go >= 1.26; modules come from the Go "
                    "module proxy): no `go` on this machine")
    return build_go_producer()
