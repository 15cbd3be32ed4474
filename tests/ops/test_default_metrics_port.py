"""`run` serves /metrics, /healthz and /readyz without being told to, on the port every
deployment file uses; a port already taken is a configuration error said before the stage
joins its group."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from stage.config.model import StageConfig
from tests.ops.support import ROOT, compose, compose_environment
from tests.ops.test_dockerfile import args_of, env_defaults
from tests.ops.test_helm import values_yaml


def test_the_stage_serves_metrics_by_default_on_the_port_of_the_chart_the_image_and_compose():
    port = StageConfig().metrics_port        # no setting at all: served
    assert port > 0
    assert values_yaml()["metrics"]["port"] == port
    assert env_defaults()["ROLLOUT_REASSEMBLER_METRICS_PORT"] == str(port)
    assert args_of("EXPOSE") == [str(port)]
    stage = compose()["services"]["stage"]
    assert compose_environment(stage)["ROLLOUT_REASSEMBLER_METRICS_PORT"] == str(port)
    assert f"{port}:{port}" in stage["ports"]


def test_run_refuses_a_metrics_port_in_use_with_a_configuration_error(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_REASSEMBLER_")}
        env.update(PYTHONPATH=str(ROOT), ROLLOUT_REASSEMBLER_METRICS_PORT=str(port),
                   KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")     # never reached: refused first
        proc = subprocess.run([sys.executable, "-m", "stage", "run"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert f"metrics_port {port} is in use" in proc.stderr and "ROLLOUT_REASSEMBLER_METRICS_PORT" in proc.stderr
