"""The command line and the benchmark/parity scripts run and report coherent figures."""

import json
import subprocess
import sys

from stage.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stage", *args], capture_output=True, text=True,
                          timeout=300)


def test_bench_verify_json_report():
    proc = _run("bench", "verify", "--json", "--seconds", "0.2")
    report = json.loads(proc.stdout)
    large, small = report["results"]
    assert (large["case"], large["calls"], large["chain_calls"], large["tokens"]) == ("large", 71, 64, 33024)
    assert small["tokens"] < large["tokens"]
    for r in report["results"]:
        assert r["verify_tokens_per_s"] > 0 and r["hash_bound_tokens_per_s"] > 0
        # verification includes hashing the same bytes, so it can never beat the hash bound
        assert 0 < r["ratio_to_hash_bound"] < 1
        assert abs(r["verify_tokens_per_s"] / r["hash_bound_tokens_per_s"] - r["ratio_to_hash_bound"]) < 1e-9
    assert proc.returncode == (0 if report["meets_target"] else 1)


def test_bench_finalize_small_group_json():
    proc = _run("bench", "finalize", "--json", "--repeats", "1", "--rollouts", "2", "--calls", "3",
                "--tokens", "16", "--layers", "4", "--topk", "2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["group"]["tokens"] == 2 * 3 * 16
    assert set(report["results"]) == {"direct", "deferred", "no-routes"}
    assert report["results"]["no-routes"]["routes_ms"] == 0.0
    for r in report["results"].values():
        assert r["total_ms"] >= r["verify_ms"] > 0


def test_cuda_parity_scripts_run_their_cpu_half():
    from stage.finalize import cuda_check as group_check
    from stage.routes import cuda_check as route_check
    assert group_check.check_devices("cpu", "cpu") > 0
    assert route_check.check_devices("cpu", "cpu") > 0
    assert group_check.main([]) == 0


def test_unknown_command_is_a_usage_error(capsys):
    try:
        main(["nonsense"])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        raise AssertionError("argparse accepted an unknown command")
