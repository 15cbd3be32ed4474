"""Builds the optional compiled module ``stage._native`` from ``native/`` (PyO3, issue 31).

Everything else is declared in pyproject.toml. The extension is optional: where no Rust
toolchain is found (cargo on PATH, or $CARGO), setuptools-rust warns and the install goes on
without it, and the contract runs its pure-Python loops (stage/contract/native.py). CI sets
ROLLOUT_REASSEMBLER_REQUIRE_NATIVE=1 so a build that fell back fails the test suite.
"""

import os
from pathlib import Path

from setuptools import setup
from setuptools_rust import Binding, RustExtension

# cargo's output (~80 MB) under build/ (ignored by git and docker), not in native/: anything that
# copies the crate's sources (the image's COPY, tests/ops) then copies sources only
os.environ.setdefault("CARGO_TARGET_DIR", str(Path(__file__).resolve().parent / "build" / "cargo"))

setup(
    rust_extensions=[
        RustExtension(
            "stage._native",
            path="native/Cargo.toml",
            binding=Binding.PyO3,
            optional=True,
            # editable installs (`make install`) would otherwise build unoptimised: the module
            # exists to be fast, and the tests should run what production runs
            debug=False,
            # the crate's own Cargo.lock pins pyo3 and sha2
            args=["--locked"],
        ),
    ],
)
