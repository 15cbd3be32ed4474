"""The chart against a real API server (tools/k8s: etcd, kube-apiserver, controller-manager and
scheduler, kwok for the nodes): `helm install --wait` of every value set tests/ops/test_helm.py
renders (the set values.yaml documents), the pods scheduled by the real scheduler onto the node
their values ask for, every secret they reference present; a `helm upgrade` whose changes reach
the StatefulSet and its pods; `helm uninstall` leaving nothing of the release behind. No kubelet:
the stage's process never runs (kwok reports the pods Running and Ready)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.k8s.conftest import CPU_NODE, GPU_NODE
from tests.k8s.support import CHART, helm_run, manifest_objects, wait_until
from tests.ops.test_helm import VALUE_SETS

RELEASE = "rr"
SELECTOR = f"app.kubernetes.io/instance={RELEASE}"
STS = f"{RELEASE}-rollout-reassembler"
# The Secrets the value sets name (existingSecret), with the keys they read: created by the
# user, only referenced by the chart, so they must survive `helm uninstall`.
USER_SECRETS = {"kafka-user": {"username": "stage", "password": "pw"},
                "kafka-ca": {"ca.crt": "ca", "tls.crt": "cert", "tls.key": "key"},
                "sr-user": {"username": "sr", "password": "pw"},
                "sr-tls": {"ca.crt": "ca", "tls.crt": "cert", "tls.key": "key"}}


def make_namespace(cluster, name: str) -> None:
    cluster.api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    for secret, data in USER_SECRETS.items():
        cluster.api.create(f"/api/v1/namespaces/{name}/secrets",
                           {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}, "stringData": data})


def install(cluster, namespace: str, values: dict, tmp_path, *extra: str):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return helm_run(cluster.helm, cluster.kubeconfig, "install", RELEASE, CHART, "-n", namespace,
                    "-f", path, "--wait", "--timeout", "180s", *extra)


def statefulset(cluster, namespace: str) -> dict:
    return cluster.api.get(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{STS}")


def pods(cluster, namespace: str) -> list[dict]:
    return cluster.api.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={SELECTOR}")["items"]


def ready(pod: dict) -> bool:
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def referenced_secrets(pod_spec: dict) -> set[tuple[str, str]]:
    refs = set()
    for c in pod_spec["containers"]:
        for env in c.get("env", []):
            if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                refs.add((ref["name"], ref["key"]))
    for vol in pod_spec.get("volumes", []):
        if secret := vol.get("secret"):
            refs |= {(secret["secretName"], item["key"]) for item in secret.get("items", [])} or {(secret["secretName"], "")}
    return refs


def uninstall_leaves_nothing(cluster, namespace: str) -> None:
    api = cluster.api
    objects = manifest_objects(cluster.helm, cluster.kubeconfig, RELEASE, namespace)
    labelled = api.namespaced_objects(namespace, SELECTOR)
    assert ("Pod", f"{STS}-0") in labelled and ("StatefulSet", STS) in labelled
    out = helm_run(cluster.helm, cluster.kubeconfig, "uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "120s")
    assert out.returncode == 0, out.stderr
    for obj in objects:
        path = api.path_of(obj["apiVersion"], obj["kind"], namespace, obj["metadata"]["name"])
        assert api.get(path) is None, f"{obj['kind']}/{obj['metadata']['name']} survived helm uninstall"
    # Pods and controller revisions go with the StatefulSet (the garbage collector); helm's own
    # release records (Secrets owner=helm,name=<release>) go with the release.
    wait_until("nothing labelled with the release", lambda: not api.namespaced_objects(namespace, SELECTOR), timeout=120)
    assert api.namespaced_objects(namespace, f"owner=helm,name={RELEASE}") == []
    for secret in USER_SECRETS:
        assert api.get(f"/api/v1/namespaces/{namespace}/secrets/{secret}") is not None, "a user's Secret was deleted"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_install_each_value_set_then_uninstall(cluster, name, tmp_path):
    values = VALUE_SETS[name]
    namespace = f"rr-{name}"
    make_namespace(cluster, namespace)
    out = install(cluster, namespace, values, tmp_path)
    assert out.returncode == 0, out.stderr
    api = cluster.api

    # Every object the release rendered was accepted as it is (the CRDs' schemas included).
    for obj in manifest_objects(cluster.helm, cluster.kubeconfig, RELEASE, namespace):
        path = api.path_of(obj["apiVersion"], obj["kind"], namespace, obj["metadata"]["name"])
        assert api.get(path) is not None, f"{obj['kind']} {obj['metadata']['name']} is not in the cluster"

    sts = statefulset(cluster, namespace)
    keda = values.get("keda", {}).get("enabled", False)
    gpu = values.get("gpu", {}).get("enabled", False)
    # KEDA's HPA owns replicas (the chart leaves the field out: the API server's default is 1).
    expected = 1 if keda else values.get("replicaCount", 3)
    assert sts["spec"]["replicas"] == expected
    assert sts["status"].get("readyReplicas") == expected
    running = pods(cluster, namespace)
    assert sorted(p["metadata"]["name"] for p in running) == [f"{STS}-{i}" for i in range(expected)]
    assert all(ready(p) for p in running)
    # The real scheduler placed them: GPU pods only fit (and tolerate) the tainted GPU node.
    assert {p["spec"]["nodeName"] for p in running} == {GPU_NODE if gpu else CPU_NODE}
    stage = next(c for c in running[0]["spec"]["containers"] if c["name"] == "stage")
    assert stage["image"].endswith(":0.1.0-cuda" if gpu else ":0.1.0")
    for secret, key in referenced_secrets(running[0]["spec"]):
        if secret.startswith(STS):
            continue  # a Secret the release renders itself
        found = api.get(f"/api/v1/namespaces/{namespace}/secrets/{secret}")
        assert found is not None and (not key or key in found["data"]), (secret, key)
    if keda:
        (scaled,) = api.get(f"/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects")["items"]
        assert scaled["spec"]["scaleTargetRef"]["name"] == STS
        assert scaled["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"

    uninstall_leaves_nothing(cluster, namespace)


def test_upgrade_reaches_the_statefulset_and_its_pods(cluster, tmp_path):
    namespace = "rr-upgrade"
    make_namespace(cluster, namespace)
    out = install(cluster, namespace, {}, tmp_path)
    assert out.returncode == 0, out.stderr
    before = statefulset(cluster, namespace)
    assert before["spec"]["replicas"] == 3

    out = helm_run(cluster.helm, cluster.kubeconfig, "upgrade", RELEASE, CHART, "-n", namespace, "--reuse-values",
                   "--set", "replicaCount=2", "--set", "config.group_timeout_ms=30000", "--set", "image.tag=0.1.1",
                   "--wait", "--timeout", "180s")
    assert out.returncode == 0, out.stderr
    history = json.loads(helm_run(cluster.helm, cluster.kubeconfig, "history", RELEASE, "-n", namespace,
                                  "-o", "json").stdout)
    assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "deployed")]

    after = statefulset(cluster, namespace)
    assert after["spec"]["replicas"] == 2
    (stage,) = [c for c in after["spec"]["template"]["spec"]["containers"] if c["name"] == "stage"]
    assert stage["image"] == "rollout-reassembler:0.1.1"
    config = cluster.api.get(f"/api/v1/namespaces/{namespace}/configmaps/{STS}")
    assert yaml.safe_load(next(iter(config["data"].values())))["group_timeout_ms"] == 30000
    # The config checksum rolled the pod template: a new revision, and the pods were replaced by it.
    key = "checksum/config"
    assert after["spec"]["template"]["metadata"]["annotations"][key] != \
        before["spec"]["template"]["metadata"]["annotations"][key]
    assert after["status"]["updateRevision"] != before["status"]["updateRevision"]
    wait_until("the pods on the new revision", lambda: (
        (sts := statefulset(cluster, namespace))["status"].get("currentRevision") == sts["status"]["updateRevision"]
        and sorted((p["metadata"]["name"], p["metadata"]["labels"]["controller-revision-hash"], ready(p))
                   for p in pods(cluster, namespace))
        == [(f"{STS}-{i}", sts["status"]["updateRevision"], True) for i in range(2)]), timeout=180)
    for p in pods(cluster, namespace):
        assert next(c for c in p["spec"]["containers"] if c["name"] == "stage")["image"] == "rollout-reassembler:0.1.1"

    uninstall_leaves_nothing(cluster, namespace)
