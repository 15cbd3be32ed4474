"""The control plane tests/k8s installs the chart into: binaries from `make k8s`
(tools/k8s/build.sh, cached by version), started and stopped by tools/k8s/cluster.sh, and a small
client for its API (urllib with the admin client certificate: no Kubernetes client library)."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from stage.brokers.kraft import free_port

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "tools" / "k8s" / "cluster.sh"
CHART = ROOT / "helm" / "rollout-reassembler"


def k8s_version() -> str:
    """The version `make k8s` builds (the Makefile's K8S_VERSION), or $K8S_VERSION."""
    if os.environ.get("K8S_VERSION"):
        return os.environ["K8S_VERSION"]
    (version,) = re.findall(r"^K8S_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    return version


def cache_dir() -> Path:
    return Path(os.environ.get("K8S_CACHE", ROOT / ".cache" / "k8s")) / k8s_version()


def require_binaries() -> Path:
    """The cache directory, or a skip naming `make k8s`: CI does not build the control plane (its
    cold build, ~25 min, would push CI past its time limit), so tests/k8s is a tier of its own."""
    cache = cache_dir()
    if not (cache / ".complete").is_file():
        pytest.skip(f"the Kubernetes {k8s_version()} control plane is not built in {cache}: run `make k8s` "
                    "(~25 min cold, then cached by version), then `make test-k8s`")
    return cache


def distinct_free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


class Api:
    """GET/POST/DELETE against the API server as the admin user (O=system:masters)."""

    def __init__(self, state: Path, port: int):
        self.base = f"https://127.0.0.1:{port}"
        self.ctx = ssl.create_default_context(cafile=str(state / "pki" / "ca.crt"))
        self.ctx.load_cert_chain(str(state / "pki" / "admin.crt"), str(state / "pki" / "admin.key"))
        self._resources: dict[str, list[dict]] = {}

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def get(self, path: str) -> dict | None:
        status, obj = self.request("GET", path)
        if status == 404:
            return None
        assert status == 200, (path, status, obj)
        return obj

    def create(self, path: str, obj: dict) -> dict:
        status, out = self.request("POST", path, obj)
        assert status in (200, 201), (path, status, out.get("message"))
        return out

    def group_versions(self) -> list[str]:
        out = ["v1"]
        for group in self.get("/apis")["groups"]:
            out.append(group["preferredVersion"]["groupVersion"])
        return out

    def resources(self, group_version: str) -> list[dict]:
        if group_version not in self._resources:
            prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
            self._resources[group_version] = self.get(prefix)["resources"]
        return self._resources[group_version]

    def path_of(self, api_version: str, kind: str, namespace: str | None, name: str = "") -> str:
        """The REST path of an object (or of its collection, without a name), found by discovery."""
        (res,) = [r for r in self.resources(api_version) if r["kind"] == kind and "/" not in r["name"]]
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        ns = f"/namespaces/{namespace}" if res["namespaced"] and namespace else ""
        return f"{prefix}{ns}/{res['name']}" + (f"/{name}" if name else "")

    def namespaced_objects(self, namespace: str, selector: str) -> list[tuple[str, str]]:
        """(kind, name) of every object in `namespace` that matches the label selector, across every
        listable namespaced resource the server serves (built-in and CRDs), events aside."""
        found = []
        for gv in self.group_versions():
            self._resources.pop(gv, None)  # CRDs come and go
            for res in self.resources(gv):
                if (not res["namespaced"] or "/" in res["name"] or "list" not in res["verbs"]
                        or res["kind"] == "Event"):
                    continue
                prefix = "/api/v1" if gv == "v1" else f"/apis/{gv}"
                items = self.get(f"{prefix}/namespaces/{namespace}/{res['name']}?labelSelector={selector}")
                found += [(res["kind"], item["metadata"]["name"]) for item in (items or {}).get("items", [])]
        return found


def wait_until(what: str, predicate, timeout: float = 120, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def helm_run(helm: Path, kubeconfig: Path, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HELM_CACHE_HOME": str(kubeconfig.parent / "helm-cache"),
           "HELM_CONFIG_HOME": str(kubeconfig.parent / "helm-config"),
           "HELM_DATA_HOME": str(kubeconfig.parent / "helm-data")}
    return subprocess.run([str(helm), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)


def manifest_objects(helm: Path, kubeconfig: Path, release: str, namespace: str) -> list[dict]:
    out = helm_run(helm, kubeconfig, "get", "manifest", release, "-n", namespace)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]
