"""The Helm chart: `helm lint --strict` and `helm template` (real helm, built by `make helm`)
with several value sets, the rendered manifests checked field by field, the stage's own config
loader run on what a pod would get, and the values schema rejecting bad values."""

from __future__ import annotations

import json
import math
import re
import tomllib

import jsonschema
import pytest
import yaml

from tests.ops.support import (
    CHART, DOCKERFILE, ROOT, by_kind, health_server, helm_cmd, http_status, load_stage_config, one, render,
)

SECURE = {"kafka": {"sasl": {"enabled": True, "existingSecret": "kafka-user", "mechanism": "SCRAM-SHA-512"},
                    "tls": {"enabled": True, "existingSecret": "kafka-ca", "certKey": "tls.crt", "keyKey": "tls.key"}}}
AUTOSCALE = {"keda": {"enabled": True}, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
             "partitions": 24}
GPU = {"gpu": {"enabled": True, "count": 2, "nodeSelector": {"nvidia.com/gpu.present": "true"}}}
STATIC = {"staticMembership": {"enabled": True, "sessionTimeoutMs": 90000}}
REGISTRY = {"config": {"bootstrap_servers": "kafka:9092", "framing": "confluent",
                       "schema_registry_url": "https://registry:8081"},
            "schemaRegistry": {"basicAuth": {"enabled": True, "existingSecret": "sr-user"},
                               "tls": {"enabled": True, "existingSecret": "sr-tls", "certKey": "tls.crt",
                                       "keyKey": "tls.key"}}}
ALERTING = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True, "labels": {"release": "prom"}}}
VALUE_SETS = {"default": {}, "sasl-tls": SECURE, "keda-servicemonitor": AUTOSCALE, "gpu": GPU,
              "static-membership": STATIC, "alerting": ALERTING, "registry-auth-tls": REGISTRY,
              "everything": {**SECURE, **AUTOSCALE, **GPU, **STATIC, **ALERTING, **REGISTRY,
                             "transactionalIdPrefix": "prod-"}}
# Variables outside the stage's namespace that the chart sets: the parts of the registry's user
# info, which ROLLOUT_REASSEMBLER_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO joins.
HELPER_ENV = {"POD_NAME", "SCHEMA_REGISTRY_BASIC_AUTH_USERNAME", "SCHEMA_REGISTRY_BASIC_AUTH_PASSWORD"}

POD_NAME = "rr-rollout-reassembler-0"


def values_yaml() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def container(docs: list[dict]) -> dict:
    sts = one(docs, "StatefulSet")
    (stage,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "stage"]
    return stage


def pod_env(docs: list[dict], services: tuple[str, ...] = ()) -> dict[str, str]:
    """The container's environment as the kubelet would give it: downward API -> the pod name,
    Secret references -> a placeholder, $(VAR) references expanded; plus, unless the pod spec
    sets enableServiceLinks: false, the service-link variables of `services` (ClusterIP
    Services of the namespace, port 9400 named metrics)."""
    env: dict[str, str] = {}
    for item in container(docs)["env"]:
        if "value" in item:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), str(item["value"]))
        elif "fieldRef" in item.get("valueFrom", {}):
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            value = POD_NAME
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            value = f"<secret {ref['name']}/{ref['key']}>"
        else:
            raise AssertionError(f"unexpected env entry {item}")
        env[item["name"]] = value
    if one(docs, "StatefulSet")["spec"]["template"]["spec"].get("enableServiceLinks", True):
        for service in services:
            links = service_links(service, "10.96.0.10", 9400, "metrics")
            env.update({k: v for k, v in links.items() if k not in env})  # the container's own win
    return env


def service_links(service: str, ip: str, port: int, port_name: str) -> dict[str, str]:
    """The variables the kubelet injects for one ClusterIP Service (Docker-links style)."""
    name = service.upper().replace("-", "_")
    url = f"tcp://{ip}:{port}"
    return {f"{name}_SERVICE_HOST": ip, f"{name}_SERVICE_PORT": str(port),
            f"{name}_SERVICE_PORT_{port_name.upper()}": str(port), f"{name}_PORT": url,
            f"{name}_PORT_{port}_TCP": url, f"{name}_PORT_{port}_TCP_PROTO": "tcp",
            f"{name}_PORT_{port}_TCP_PORT": str(port), f"{name}_PORT_{port}_TCP_ADDR": ip}


def stage_yaml(docs: list[dict]) -> str:
    return one(docs, "ConfigMap")["data"]["stage.yaml"]


# -- lint and render ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict_passes(name):
    result = helm_cmd("lint", VALUE_SETS[name])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_config_and_env_load_with_the_stage_loader(name):
    docs = render(VALUE_SETS[name])
    env = pod_env(docs)
    assert all(k.startswith("ROLLOUT_REASSEMBLER_") or k in HELPER_ENV for k in env), env
    cfg = load_stage_config(stage_yaml(docs), {k: v for k, v in env.items() if k != "POD_NAME"})
    port = container(docs)["ports"][0]
    assert port["name"] == "metrics" and cfg.metrics_port == port["containerPort"] == values_yaml()["metrics"]["port"]
    prefix = VALUE_SETS[name].get("transactionalIdPrefix", "")
    assert cfg.effective_transactional_id == prefix + POD_NAME
    assert cfg.bootstrap_servers == values_yaml()["config"]["bootstrap_servers"]


def test_service_links_are_off_so_services_named_like_the_stage_inject_nothing():
    """A Service named rollout-reassembler (another release with the default name, a user's
    ClusterIP Service) makes the kubelet inject ROLLOUT_REASSEMBLER_SERVICE_HOST, ..._PORT=tcp://...
    into every pod of the namespace unless the pod spec turns service links off."""
    services = ("rollout-reassembler", "rollout-reassembler-dashboards")
    for name, values in VALUE_SETS.items():
        docs = render(values)
        assert one(docs, "StatefulSet")["spec"]["template"]["spec"]["enableServiceLinks"] is False, name
        env = pod_env(docs, services)
        assert not [k for k in env if "_SERVICE_" in k or k.endswith("_TCP")], name
        load_stage_config(stage_yaml(docs), {k: v for k, v in env.items() if k != "POD_NAME"})
    # what the simulation injects with service links on: variables in the stage's namespace
    links = service_links("rollout-reassembler", "10.96.0.10", 9400, "metrics")
    assert links["ROLLOUT_REASSEMBLER_PORT"] == "tcp://10.96.0.10:9400"


def test_static_membership_uses_the_pod_name_and_its_session_timeout():
    docs = render(STATIC)
    env = {e["name"]: e for e in container(docs)["env"]}
    assert env["ROLLOUT_REASSEMBLER_CONSUMER__GROUP_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    from stage.runtime.kafka.clients import consumer_config
    cfg = load_stage_config(stage_yaml(docs), {k: v for k, v in pod_env(docs).items() if k != "POD_NAME"})
    consumer = consumer_config(cfg)
    assert consumer["group.instance.id"] == POD_NAME == cfg.effective_transactional_id
    assert int(consumer["session.timeout.ms"]) == STATIC["staticMembership"]["sessionTimeoutMs"]
    assert int(consumer["session.timeout.ms"]) <= consumer["max.poll.interval.ms"]
    default_cfg = load_stage_config(stage_yaml(render()), {
        k: v for k, v in pod_env(render()).items() if k != "POD_NAME"})
    default = consumer_config(default_cfg)
    # without the chart's value the stage is a static member too (static_membership, on by
    # default: group.instance.id from its transactional id), with librdkafka's session timeout
    from stage.runtime.kafka.clients import static_member_id
    assert default["group.instance.id"] == static_member_id(default_cfg)
    assert "session.timeout.ms" not in default
    assert values_yaml()["staticMembership"] == {"enabled": False, "sessionTimeoutMs": 120000}
    # librdkafka refuses session.timeout.ms above max.poll.interval.ms: so does the chart
    result = helm_cmd("template", {**STATIC, "config": {"bootstrap_servers": "b:9092", "max_poll_interval_ms": 60000}})
    assert result.returncode != 0
    assert "staticMembership.sessionTimeoutMs (90000) must not exceed config.max_poll_interval_ms (60000)" in result.stderr


def test_static_membership_under_kip848_leaves_the_session_timeout_to_the_brokers():
    """librdkafka refuses session.timeout.ms with group.protocol=consumer: the chart must not
    set it when config.group_protocol is consumer, and the pod's configuration must load."""
    values = {**STATIC, "config": {"bootstrap_servers": "b:9092", "group_protocol": "consumer"}}
    docs = render(values)
    env = {e["name"] for e in container(docs)["env"]}
    assert "ROLLOUT_REASSEMBLER_CONSUMER__GROUP_INSTANCE_ID" in env
    assert "ROLLOUT_REASSEMBLER_CONSUMER__SESSION_TIMEOUT_MS" not in env
    from stage.runtime.kafka.clients import consumer_config
    cfg = load_stage_config(stage_yaml(docs), {k: v for k, v in pod_env(docs).items() if k != "POD_NAME"})
    consumer = consumer_config(cfg)
    assert consumer["group.protocol"] == "consumer" and consumer["group.instance.id"] == POD_NAME
    assert "session.timeout.ms" not in consumer and "partition.assignment.strategy" not in consumer


def test_statefulset_transactional_id_comes_from_the_pod_name():
    (entry,) = [e for e in container(render())["env"] if e["name"] == "ROLLOUT_REASSEMBLER_TRANSACTIONAL_ID"]
    assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    env = container(render({"transactionalIdPrefix": "prod-"}))["env"]
    names = [e["name"] for e in env]
    pod = env[names.index("POD_NAME")]
    assert pod["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert names.index("POD_NAME") < names.index("ROLLOUT_REASSEMBLER_TRANSACTIONAL_ID")  # $(VAR) needs it first
    assert env[names.index("ROLLOUT_REASSEMBLER_TRANSACTIONAL_ID")]["value"] == "prod-$(POD_NAME)"
    sts = one(render(), "StatefulSet")
    assert sts["spec"]["serviceName"] == one(render(), "Service")["metadata"]["name"]


def test_probes_and_ports_match_metrics_port_and_the_health_server():
    for values in ({}, {"metrics": {"port": 9555}}):
        docs = render(values)
        stage = container(docs)
        port = stage["ports"][0]["containerPort"]
        assert port == (values.get("metrics") or values_yaml()["metrics"])["port"]
        assert load_stage_config(stage_yaml(docs), {k: v for k, v in pod_env(docs).items()
                                                    if k != "POD_NAME"}).metrics_port == port
        probes = {kind: stage[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert probes["livenessProbe"]["path"] == "/healthz"
        assert probes["startupProbe"]["path"] == "/healthz"
        assert probes["readinessProbe"]["path"] == "/readyz"
        assert {p["port"] for p in probes.values()} == {"metrics"}
        service = one(docs, "Service")
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["ports"] == [{"name": "metrics", "port": port, "targetPort": "metrics", "protocol": "TCP"}]
    # the paths are the ones the stage's HealthServer answers (a 404 would fail every probe)
    with health_server(ready=True) as port:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert http_status(port, path) == 200, path
    with health_server(ready=False) as port:
        assert http_status(port, "/readyz") == 503


def test_pod_disruption_budget_and_security_context():
    docs = render()
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    sts = one(docs, "StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert sts["spec"]["selector"]["matchLabels"] == pdb["spec"]["selector"]["matchLabels"]
    pod = sts["spec"]["template"]["spec"]
    stage = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert stage["securityContext"]["readOnlyRootFilesystem"] is True
    assert stage["securityContext"]["allowPrivilegeEscalation"] is False
    assert stage["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # the image's user (Dockerfile) is the one the pod runs as
    uid = re.search(r"^ARG UID=(\d+)$", DOCKERFILE.read_text(), re.M).group(1)
    assert pod["securityContext"]["runAsUser"] == int(uid)
    mounts = {m["mountPath"]: m["name"] for m in stage["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]  # writable scratch on a read-only root
    assert volumes[mounts["/etc/rollout-reassembler/stage.yaml"]]["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    assert stage["args"] == ["run", "--config", "/etc/rollout-reassembler/stage.yaml"]
    assert not by_kind(docs, "ScaledObject") and not by_kind(docs, "ServiceMonitor")
    assert render({"podDisruptionBudget": {"enabled": False}}) and not by_kind(
        render({"podDisruptionBudget": {"enabled": False}}), "PodDisruptionBudget")


def test_spilled_records_get_their_own_volume_and_the_stage_uses_at_most_90_percent_of_it():
    docs = render({"spill": {"sizeLimitGi": 20}})
    cfg = load_stage_config(stage_yaml(docs), {k: v for k, v in pod_env(docs).items() if k != "POD_NAME"})
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[cfg.spill_dir]]
    assert volume["emptyDir"]["sizeLimit"] == "20Gi"
    assert cfg.max_spill_bytes == int(20 * (1 << 30) * 0.9)


def test_termination_grace_is_revoke_budget_plus_transaction_timeout():
    extra = values_yaml()["terminationGraceExtraSeconds"]
    cfg = values_yaml()["config"]
    grace = one(render(), "StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == math.ceil((cfg["revoke_budget_ms"] + cfg["transaction_timeout_ms"]) / 1000) + extra
    custom = {"config": {"bootstrap_servers": "b:9092", "revoke_budget_ms": 30_500, "transaction_timeout_ms": 300_000}}
    grace = one(render(custom), "StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == 331 + extra
    # keys absent from config: the stage's defaults (StageConfig)
    from stage.config.model import StageConfig
    default = StageConfig()
    grace = one(render({"config": {"bootstrap_servers": "b:9092"}}), "StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == math.ceil((default.revoke_budget_ms + default.transaction_timeout_ms) / 1000) + extra
    grace = one(render({"terminationGracePeriodSeconds": 600}), "StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == 600


def test_sasl_and_tls_come_from_existing_secrets():
    docs = render(SECURE)
    env = {e["name"]: e for e in container(docs)["env"]}
    for var, key in (("ROLLOUT_REASSEMBLER_KAFKA__SASL_USERNAME", "username"),
                     ("ROLLOUT_REASSEMBLER_KAFKA__SASL_PASSWORD", "password")):
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "kafka-user", "key": key}
    assert not by_kind(docs, "Secret")  # references only: the chart never renders credentials
    cfg = load_stage_config(stage_yaml(docs), {k: v for k, v in pod_env(docs).items() if k != "POD_NAME"})
    assert cfg.kafka["security.protocol"] == "SASL_SSL"
    assert cfg.kafka["sasl.mechanism"] == "SCRAM-SHA-512"
    assert cfg.kafka["sasl.password"] == "<secret kafka-user/password>"
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    (tls_volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert tls_volume["secret"]["secretName"] == "kafka-ca"
    (mount,) = [m for m in container(docs)["volumeMounts"] if m["name"] == tls_volume["name"]]
    assert mount["readOnly"] is True
    for prop, key in (("ssl.ca.location", "ca.crt"), ("ssl.certificate.location", "tls.crt"), ("ssl.key.location", "tls.key")):
        assert cfg.kafka[prop] == f"{mount['mountPath']}/{key}"
    only_tls = render({"kafka": {"tls": {"enabled": True, "existingSecret": "kafka-ca"}}})
    cfg = load_stage_config(stage_yaml(only_tls), {k: v for k, v in pod_env(only_tls).items() if k != "POD_NAME"})
    assert cfg.kafka["security.protocol"] == "SSL" and "sasl.mechanism" not in cfg.kafka


def test_schema_registry_credentials_come_from_existing_secrets():
    docs = render(REGISTRY)
    env = {e["name"]: e for e in container(docs)["env"]}
    for var, key in (("SCHEMA_REGISTRY_BASIC_AUTH_USERNAME", "username"),
                     ("SCHEMA_REGISTRY_BASIC_AUTH_PASSWORD", "password")):
        assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "sr-user", "key": key}
    assert not by_kind(docs, "Secret")   # references only
    assert "basic_auth_user_info" not in stage_yaml(docs)
    cfg = load_stage_config(stage_yaml(docs), {k: v for k, v in pod_env(docs).items() if k != "POD_NAME"})
    props = cfg.schema_registry.client_properties()
    assert props["basic.auth.user.info"] == "<secret sr-user/username>:<secret sr-user/password>"
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "schema-registry-tls"]
    assert volume["secret"]["secretName"] == "sr-tls"
    (mount,) = [m for m in container(docs)["volumeMounts"] if m["name"] == "schema-registry-tls"]
    assert mount["readOnly"] is True
    for prop, key in (("ssl.ca.location", "ca.crt"), ("ssl.certificate.location", "tls.crt"),
                      ("ssl.key.location", "tls.key")):
        assert props[prop] == f"{mount['mountPath']}/{key}"
    assert cfg.kafka == {}   # the registry's TLS is not the brokers'
    only_ca = render({"schemaRegistry": {"tls": {"enabled": True, "existingSecret": "sr-ca"}}})
    cfg = load_stage_config(stage_yaml(only_ca), {k: v for k, v in pod_env(only_ca).items() if k != "POD_NAME"})
    assert set(cfg.schema_registry.client_properties()) == {"ssl.ca.location"}
    default = load_stage_config(stage_yaml(render()), {k: v for k, v in pod_env(render()).items() if k != "POD_NAME"})
    assert default.schema_registry.client_properties() == {}


def test_a_registry_key_without_its_certificate_is_refused():
    result = helm_cmd("template", {"schemaRegistry": {"tls": {"enabled": True, "existingSecret": "s",
                                                              "keyKey": "tls.key"}}})
    assert result.returncode != 0
    assert "schemaRegistry.tls.keyKey needs schemaRegistry.tls.certKey" in result.stderr, result.stderr


def test_keda_max_replicas_is_the_partition_count():
    docs = render(AUTOSCALE)
    scaled = one(docs, "ScaledObject")
    assert scaled["spec"]["maxReplicaCount"] == AUTOSCALE["partitions"]
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                                "name": one(docs, "StatefulSet")["metadata"]["name"]}
    assert "replicas" not in one(docs, "StatefulSet")["spec"]  # KEDA's HPA owns the count
    (trigger,) = scaled["spec"]["triggers"]
    config = values_yaml()["config"]
    assert trigger["type"] == "kafka"
    assert trigger["metadata"]["consumerGroup"] == config["group_id"]
    assert trigger["metadata"]["bootstrapServers"] == config["bootstrap_servers"]
    from stage.wire import TopicNames
    assert trigger["metadata"]["topic"] == TopicNames().receipts
    assert trigger["metadata"]["allowIdleConsumers"] == "false"
    assert "authenticationRef" not in trigger
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= one(docs, "Service")["metadata"]["labels"].items()
    explicit = one(render({"keda": {"enabled": True, "maxReplicaCount": 5}, "partitions": 8}), "ScaledObject")
    assert explicit["spec"]["maxReplicaCount"] == 5
    secured = render({**AUTOSCALE, **SECURE})
    (trigger,) = one(secured, "ScaledObject")["spec"]["triggers"]
    auth = one(secured, "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert trigger["metadata"]["sasl"] == "scram_sha512" and trigger["metadata"]["tls"] == "enable"
    refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
    assert refs == {"username": ("kafka-user", "username"), "password": ("kafka-user", "password"),
                    "ca": ("kafka-ca", "ca.crt"), "cert": ("kafka-ca", "tls.crt"), "key": ("kafka-ca", "tls.key")}


def _gpu_limits(docs: list[dict]) -> list:
    text = json.dumps(docs)
    return re.findall(r'"nvidia\.com/gpu": (\d+)', text)


def test_gpu_resources_only_when_enabled():
    for name in ("default", "sasl-tls", "keda-servicemonitor"):
        docs = render(VALUE_SETS[name])
        assert _gpu_limits(docs) == [], name
        assert "ROLLOUT_REASSEMBLER_FINALIZE__DEVICE" not in pod_env(docs)
        assert "tolerations" not in one(docs, "StatefulSet")["spec"]["template"]["spec"]
    docs = render(GPU)
    stage = container(docs)
    assert stage["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert stage["resources"]["limits"]["memory"] == values_yaml()["resources"]["limits"]["memory"]
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    cfg = load_stage_config(stage_yaml(docs), {k: v for k, v in pod_env(docs).items() if k != "POD_NAME"})
    assert cfg.finalize.device == "cuda"
    # the chart's values are not mutated by the GPU merge (rendering twice gives the same result)
    assert _gpu_limits(render({})) == []


@pytest.mark.parametrize("values, image", [
    # the CUDA build's tag as docs/operations.md's build command names it, from the chart's appVersion
    ({}, "rollout-reassembler:{v}-cuda"),
    ({"image": {"tag": "0.2.0"}}, "rollout-reassembler:0.2.0-cuda"),
    ({"image": {"tag": "0.2.0-cuda"}}, "rollout-reassembler:0.2.0-cuda"),
    ({"gpu": {"image": {"tag": "nightly-cu124"}}}, "rollout-reassembler:nightly-cu124"),
    ({"image": {"repository": "reg.example/rr"}, "gpu": {"image": {"repository": "reg.example/rr-cuda"}}},
     "reg.example/rr-cuda:{v}-cuda"),
])
def test_gpu_selects_the_cuda_image(values, image):
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    gpu = _merge(values, {"gpu": {"enabled": True}})
    assert container(render(gpu))["image"] == image.format(v=version)
    # without gpu.enabled: the CPU image, as configured
    cpu = {k: v for k, v in values.items() if k != "gpu"}
    image_values = {"repository": "rollout-reassembler", "tag": version, **cpu.get("image", {})}
    assert container(render(cpu))["image"] == "{repository}:{tag}".format(**image_values)


def test_config_checksum_rolls_pods_on_config_change():
    def checksum(values):
        return one(render(values), "StatefulSet")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert checksum({}) == checksum({})
    assert checksum({}) != checksum({"config": {"bootstrap_servers": "other:9092"}})


# -- the schema and cross-value rules ---------------------------------------------------------
BAD_VALUES = {
    "replicas 0": ({"replicaCount": 0}, "/replicaCount"),
    "negative partitions": ({"partitions": -3}, "/partitions"),
    "zero partitions": ({"partitions": 0}, "/partitions"),
    "partitions not an integer": ({"partitions": "twelve"}, "/partitions"),
    "keda max 0": ({"keda": {"maxReplicaCount": 0}}, "/keda/maxReplicaCount"),
    "metrics_port in config": ({"config": {"bootstrap_servers": "b", "metrics_port": 1}}, "/config"),
    "transactional_id in config": ({"config": {"bootstrap_servers": "b", "transactional_id": "x"}}, "/config"),
    "unknown config key": ({"config": {"bootstrap_servers": "b", "group_timeout": 5}}, "/config"),
    "bad processing": ({"config": {"bootstrap_servers": "b", "processing": "twice"}}, "/config/processing"),
    "confluent framing without registry": ({"config": {"bootstrap_servers": "b", "framing": "confluent"}}, "/config"),
    "sasl without secret": ({"kafka": {"sasl": {"enabled": True}}}, "/kafka/sasl"),
    "tls without secret": ({"kafka": {"tls": {"enabled": True}}}, "/kafka/tls"),
    "registry basic auth without secret": ({"schemaRegistry": {"basicAuth": {"enabled": True}}},
                                           "/schemaRegistry/basicAuth"),
    "registry tls without secret": ({"schemaRegistry": {"tls": {"enabled": True}}}, "/schemaRegistry/tls"),
    "registry user info in the ConfigMap": ({"config": {"bootstrap_servers": "b", "schema_registry": {
        "basic_auth_user_info": "stage:hunter2"}}}, "/config/schema_registry"),
    "typo at the top": ({"replicas": 2}, ""),
    "bad port": ({"metrics": {"port": 70000}}, "/metrics/port"),
    "bad device": ({"gpu": {"device": "tpu"}}, "/gpu/device"),
    "gpu image typo": ({"gpu": {"image": {"tags": "x"}}}, "/gpu/image"),
    "session timeout below the brokers' minimum": ({"staticMembership": {"sessionTimeoutMs": 1000}},
                                                   "/staticMembership/sessionTimeoutMs"),
    "static membership typo": ({"staticMembership": {"enable": True}}, "/staticMembership"),
    "quote in the rule job": ({"prometheusRule": {"job": 'a"b'}}, "/prometheusRule/job"),
    "unknown alert name": ({"prometheusRule": {"disabledAlerts": ["Down"]}}, "/prometheusRule/disabledAlerts/0"),
    "negative poll timeout": ({"config": {"bootstrap_servers": "b", "poll_timeout_ms": -1}}, "/config/poll_timeout_ms"),
    "negative revoke budget": ({"config": {"bootstrap_servers": "b", "revoke_budget_ms": -1}}, "/config/revoke_budget_ms"),
    "finalize device tpu": ({"config": {"bootstrap_servers": "b", "finalize": {"device": "tpu"}}}, "/config/finalize/device"),
    "route plan schema 9": ({"config": {"bootstrap_servers": "b", "finalize": {"route_plan_schema_version": 9}}},
                            "/config/finalize/route_plan_schema_version"),
}


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_schema_rejects_bad_values_in_lint_and_template(name):
    values, where = BAD_VALUES[name]
    for verb in ("lint", "template"):
        result = helm_cmd(verb, values)
        assert result.returncode != 0, f"helm {verb} accepted {values}:\n{result.stdout}"
        text = result.stdout + result.stderr
        assert "schema" in text or "at '" in text, text
        if where:
            assert f"at '{where}" in text, text


@pytest.mark.parametrize("values, message", [
    ({"replicaCount": 13, "partitions": 12}, "replicaCount (13) must not exceed partitions (12)"),
    ({"keda": {"enabled": True, "maxReplicaCount": 13}, "partitions": 12}, "keda.maxReplicaCount (13) must not exceed partitions (12)"),
    ({"keda": {"enabled": True, "minReplicaCount": 5}, "partitions": 4}, "keda.minReplicaCount (5) must not exceed"),
])
def test_templates_refuse_more_replicas_than_partitions(values, message):
    # JSON schema cannot compare two values; the templates `fail` (helm lint only logs that).
    result = helm_cmd("template", values)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert helm_cmd("template", {"replicaCount": 12, "partitions": 12}).returncode == 0


def test_values_yaml_matches_the_schema_and_bad_values_fail_without_helm():
    """The same schema checks with Python's jsonschema (runs where helm cannot be built)."""
    validator = jsonschema.Draft7Validator(schema())
    assert list(validator.iter_errors(values_yaml())) == []
    for name, (values, _) in BAD_VALUES.items():
        merged = _merge(values_yaml(), values)
        assert list(validator.iter_errors(merged)), f"{name}: schema accepted {values}"
    for name, values in VALUE_SETS.items():
        assert list(validator.iter_errors(_merge(values_yaml(), values))) == [], name


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_schema_config_keys_follow_the_stage_config():
    """values.schema.json's `config` is generated from StageConfig (tests/runtime/test_config_schema.py
    checks it is current); here: it is what the chart uses, and values.yaml's config loads."""
    from stage.config.schema import helm_config_schema
    assert schema()["properties"]["config"] == helm_config_schema()
    # every default in values.yaml is accepted by the stage itself
    load_stage_config(yaml.safe_dump(values_yaml()["config"]), {})


def test_chart_app_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    assert container(render())["image"] == f"{values_yaml()['image']['repository']}:{project['version']}"
