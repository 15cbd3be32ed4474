"""Every benchmark names the machine next to its figures: CPU model, SHA-NI / AVX2 / AVX-512,
and the SIMD level numpy dispatches to (figures from two machines must be told apart)."""

import json
import os
import subprocess
import sys

from stage.bench.machine import machine_info, machine_line

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 sha_ni avx512f avx512bw

processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 sha_ni avx512f avx512bw
"""


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stage", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_the_machine_line_names_the_cpu_its_features_and_numpys_simd_level():
    info = machine_info(CPUINFO)
    assert info["cpu"] == "AMD EPYC 9R14 96-Core Processor"
    assert info["features"] == {"SHA-NI": True, "AVX2": True, "AVX-512": True}
    simd = info["numpy_simd"]
    assert simd["level"] in simd["found"] + simd["baseline"]
    line = machine_line(info)
    assert line.startswith("machine: AMD EPYC 9R14 96-Core Processor, ")
    assert "(SHA-NI yes, AVX2 yes, AVX-512 yes)" in line and f"SIMD {simd['level']} " in line
    assert "AVX-512 no" in machine_line(machine_info(CPUINFO.replace(" avx512f avx512bw", "")))


def test_disabled_numpy_features_lower_the_reported_level():
    code = "import json; from stage.bench.machine import numpy_simd; print(json.dumps(numpy_simd()))"
    full = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                     check=True).stdout)
    if not full["found"]:
        return   # nothing above the baseline to disable on this CPU
    top = full["found"][-1]
    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": top}
    lowered = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                        check=True, env=env).stdout)
    assert top in lowered["not_found"] and lowered["level"] != top


def test_bench_verify_prints_the_machine_with_its_figures():
    text = _run("bench", "verify", "--seconds", "0.2").stdout
    assert text.splitlines()[1].startswith("machine: ") and " SIMD " in text.splitlines()[1]
    report = json.loads(_run("bench", "verify", "--json", "--seconds", "0.2").stdout)
    assert report["machine"]["numpy_simd"]["level"] and report["machine"]["cpu"]


def test_bench_wire_and_finalize_print_the_machine():
    text = _run("bench", "wire").stdout
    assert any(line.startswith("# machine: ") for line in text.splitlines())
    assert "machine" in json.loads(_run("bench", "wire", "--json").stdout)
    proc = _run("bench", "finalize", "--repeats", "1", "--rollouts", "2", "--calls", "2", "--tokens", "8",
                "--layers", "2", "--topk", "2", "--modes", "deferred", "--no-rss")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].startswith("machine: ")
