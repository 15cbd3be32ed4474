"""tools/k8s without the cached binaries (a clean clone, CI): the control plane script refuses
to start, naming `make k8s`, and the chart tests skip with the same advice, never fail."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.k8s.support import CLUSTER_SH, ROOT


def test_cluster_up_without_binaries_names_make_k8s(tmp_path):
    env = {**os.environ, "K8S_CACHE": str(tmp_path / "empty"), "ETCD_PORT": "1", "ETCD_PEER_PORT": "2", "API_PORT": "3"}
    out = subprocess.run(["bash", CLUSTER_SH, "up", tmp_path / "state"], capture_output=True, text=True, env=env,
                         timeout=30)
    assert out.returncode != 0
    assert "run `make k8s`" in out.stderr
    assert not (tmp_path / "state" / "run").exists()  # nothing was started


def test_chart_tests_skip_without_binaries(tmp_path):
    env = {**os.environ, "K8S_CACHE": str(tmp_path / "empty"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          "tests/k8s/test_chart_install.py"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped in .*", summary), summary
    assert "run `make k8s`" in out.stdout
