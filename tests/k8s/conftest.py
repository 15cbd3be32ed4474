"""One control plane for the tests/k8s session: started on 127.0.0.1 with free ports by
tools/k8s/cluster.sh, with two fake kwok nodes (a CPU node, and a GPU node that is tainted and
labelled the way the chart's gpu values expect) and the KEDA / Prometheus Operator CRDs installed
(the API server then enforces their schemas on the chart's objects); stopped at the end."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.k8s.support import CLUSTER_SH, Api, distinct_free_ports, require_binaries, wait_until
from tests.ops.support import helm

CPU_NODE = "kwok-cpu-0"
GPU_NODE = "kwok-gpu-0"
GPU_LABEL = "nvidia.com/gpu.present"


@dataclass
class Cluster:
    api: Api
    kubeconfig: Path
    helm: Path


def fake_node(name: str, labels: dict, extra: dict, taints: list) -> dict:
    resources = {"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti", **extra}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                         "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                    "kubernetes.io/arch": "amd64", "type": "kwok", **labels}},
            "spec": {"taints": taints},
            "status": {"allocatable": resources, "capacity": resources}}


def node_ready(api: Api, name: str) -> bool:
    node = api.get(f"/api/v1/nodes/{name}")
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))


def install_crds(api: Api, crd_dir: Path) -> None:
    names = []
    for path in sorted(crd_dir.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if crd:
                api.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
                names.append(crd["metadata"]["name"])
    def established(name: str) -> bool:
        crd = api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}") or {}
        conditions = (crd.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    for name in names:
        wait_until(f"CRD {name} established", lambda n=name: established(n), timeout=60)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    cache = require_binaries()
    helm_bin = helm()
    state = tmp_path_factory.mktemp("k8s")
    etcd, peer, api_port = distinct_free_ports(3)
    env_ports = {"ETCD_PORT": str(etcd), "ETCD_PEER_PORT": str(peer), "API_PORT": str(api_port)}
    started = time.monotonic()
    up = subprocess.run(["bash", CLUSTER_SH, "up", state], capture_output=True, text=True, timeout=400,
                        env={**os.environ, **env_ports, "K8S_BIN": str(cache / "bin")})
    try:
        assert up.returncode == 0, up.stderr
        api = Api(state, api_port)
        print(f"\ncontrol plane up in {time.monotonic() - started:.1f} s (API server 127.0.0.1:{api_port})")
        api.create("/api/v1/nodes", fake_node(CPU_NODE, {}, {}, []))
        api.create("/api/v1/nodes", fake_node(GPU_NODE, {GPU_LABEL: "true"}, {"nvidia.com/gpu": "8"},
                                              [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]))
        for node in (CPU_NODE, GPU_NODE):
            wait_until(f"kwok to mark {node} Ready", lambda n=node: node_ready(api, n), timeout=60)
        install_crds(api, cache / "crds")
        yield Cluster(api=api, kubeconfig=state / "kubeconfig", helm=helm_bin)
    finally:
        down = subprocess.run(["bash", CLUSTER_SH, "down", state], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
