"""The machine every benchmark names next to its figures (issue 31).

The same commands gave 0.52 of the SHA-256 bound on one 2-core AMD EPYC and 0.28 on another:
one had AVX-512, the other not, and per-row Python magnified the slower core. Figures are only
comparable with the CPU model, the features that decide the anchors here (SHA-NI for hashlib's
SHA-256, AVX2/AVX-512 for numpy) and the SIMD level numpy actually dispatches to, which
``NPY_DISABLE_CPU_FEATURES`` can lower (how a run emulates a core without AVX-512).
"""

from __future__ import annotations

import os
import platform

import numpy as np

_FEATURES = (("sha_ni", "SHA-NI"), ("avx2", "AVX2"), ("avx512f", "AVX-512"))


def _cpuinfo(text: str | None = None) -> tuple[str, set[str]]:
    """(model name, feature flags) of the first CPU in /proc/cpuinfo (Linux), else unknowns."""
    if text is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                text = f.read(1 << 20)
        except OSError:
            text = ""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.processor() or platform.machine() or "unknown CPU", flags


def numpy_simd() -> dict:
    """numpy's SIMD dispatch: the compiled-in baseline, the dispatch targets this CPU runs
    (``found``, after ``NPY_DISABLE_CPU_FEATURES``) and those it does not, as
    ``numpy.show_runtime()`` reports them; ``level`` is the highest one in use."""
    try:
        from numpy._core._multiarray_umath import __cpu_baseline__, __cpu_dispatch__, __cpu_features__
    except ImportError:   # numpy < 2
        try:
            from numpy.core._multiarray_umath import (  # type: ignore[no-redef]
                __cpu_baseline__, __cpu_dispatch__, __cpu_features__)
        except ImportError:
            return {"level": "unknown", "baseline": [], "found": [], "not_found": []}
    found = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
    baseline = list(__cpu_baseline__)
    return {"level": (found or baseline or ["none"])[-1], "baseline": baseline, "found": found,
            "not_found": [f for f in __cpu_dispatch__ if not __cpu_features__.get(f)]}


def machine_info(cpuinfo: str | None = None) -> dict:
    model, flags = _cpuinfo(cpuinfo)
    return {"cpu": model, "cpus": os.cpu_count(), "arch": platform.machine(),
            "features": {name: flag in flags for flag, name in _FEATURES} if flags else {},
            "numpy": np.__version__, "numpy_simd": numpy_simd(),
            "numpy_disabled": os.environ.get("NPY_DISABLE_CPU_FEATURES", ""),
            "python": platform.python_version()}


def machine_line(info: dict | None = None) -> str:
    """One line: ``machine: AMD EPYC, 2 CPUs, x86_64 (SHA-NI yes, AVX2 yes, AVX-512 no);
    numpy 2.4.6 SIMD X86_V3 (baseline X86_V2; not used: X86_V4 ...); Python 3.11.7``."""
    info = info or machine_info()
    simd = info["numpy_simd"]
    features = ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in info["features"].items())
    unused = f"; not used: {' '.join(simd['not_found'])}" if simd["not_found"] else ""
    disabled = f"; NPY_DISABLE_CPU_FEATURES={info['numpy_disabled']}" if info["numpy_disabled"] else ""
    return (f"machine: {info['cpu']}, {info['cpus']} CPUs, {info['arch']}"
            f"{f' ({features})' if features else ''}; numpy {info['numpy']} SIMD {simd['level']} "
            f"(baseline {' '.join(simd['baseline']) or 'none'}{unused}{disabled}); "
            f"Python {info['python']}")
