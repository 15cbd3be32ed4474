"""Configuration: defaults, YAML, environment overrides, pass-through client properties, and
clear errors (the setting, its source, what is allowed) for typos and bad values."""

import logging

import pytest

from stage.finalize import ReassemblyConfig
from stage.runtime.kafka.clients import consumer_config, producer_config
from stage.config.model import AT_LEAST_ONCE, StageConfig, load_config
from stage.wire import TopicNames


def _yaml(tmp_path, text: str):
    path = tmp_path / "stage.yaml"
    path.write_text(text)
    return path


def test_yaml_then_environment(tmp_path):
    path = _yaml(tmp_path,
                 "bootstrap_servers: broker:9092\n"
                 "group_timeout_ms: 30000\n"
                 "topics: {receipts: prod.receipts}\n"
                 "finalize: {router_replay: true, defer_routes: true, device: cpu}\n"
                 "kafka: {security.protocol: SASL_SSL, sasl.mechanism: PLAIN}\n")
    env = {"ROLLOUT_REASSEMBLER_GROUP_TIMEOUT_MS": "45000",
           "ROLLOUT_REASSEMBLER_KAFKA__SASL_USERNAME": "svc",
           "ROLLOUT_REASSEMBLER_KAFKA__SASL_PASSWORD": "007",   # stays text (a password, not 7)
           "ROLLOUT_REASSEMBLER_FINALIZE__TOP_LOGPROBS": "5",
           "ROLLOUT_REASSEMBLER_TOPICS__STAGED_CALLS": "prod.staged",
           "KAFKA_BOOTSTRAP_SERVERS": "other:9093",
           "KAFKA_HEAP_OPTS": "-Xmx1g"}          # not ours: ignored
    cfg = load_config(path, env)
    assert cfg.bootstrap_servers == "other:9093" and cfg.group_timeout_ms == 45000
    assert (cfg.topics.receipts, cfg.topics.staged_calls) == ("prod.receipts", "prod.staged")
    assert cfg.finalize.router_replay and cfg.finalize.defer_routes and cfg.finalize.top_logprobs == 5
    consumer, producer = consumer_config(cfg), producer_config(cfg)
    for conf in (consumer, producer):
        assert conf["security.protocol"] == "SASL_SSL" and conf["sasl.username"] == "svc"
        assert conf["sasl.password"] == "007" and conf["bootstrap.servers"] == "other:9093"


def test_more_specific_sources_win():
    env = {"KAFKA_BOOTSTRAP_SERVERS": "generic:1", "ROLLOUT_REASSEMBLER_BOOTSTRAP_SERVERS": "ours:2"}
    assert load_config(None, env).bootstrap_servers == "ours:2"
    assert load_config(None, env, overrides={"bootstrap_servers": "cli:3"}).bootstrap_servers == "cli:3"
    cfg = load_config(None, {"ROLLOUT_REASSEMBLER_FINALIZE": '{"router_replay": true, "device": "auto"}'})
    assert cfg.finalize.router_replay and cfg.finalize.device == "auto"   # a whole section as JSON
    assert load_config(None, {"ROLLOUT_REASSEMBLER_FINALIZE__MAX_SEQ_LEN": "none"}).finalize.max_seq_len is None
    assert load_config(None, {"ROLLOUT_REASSEMBLER_FINALIZE__ROUTE_PLAN_SCHEMA_VERSION": "2"}
                       ).finalize.route_plan_schema_version == 2


def test_client_defaults_follow_the_processing_mode():
    eos = producer_config(StageConfig(transactional_id="stage-0"))
    assert eos["transactional.id"] == "stage-0" and eos["enable.idempotence"] is True
    alos = producer_config(StageConfig(processing=AT_LEAST_ONCE))
    assert "transactional.id" not in alos
    consumer = consumer_config(StageConfig(max_record_bytes=10 << 20))
    assert consumer["isolation.level"] == "read_committed" and consumer["enable.auto.commit"] is False
    assert consumer["partition.assignment.strategy"] == "cooperative-sticky"
    assert consumer["max.partition.fetch.bytes"] > 10 << 20


def test_default_transactional_id_is_stable_per_host():
    cfg = StageConfig(group_id="rr")
    assert cfg.effective_transactional_id == cfg.effective_transactional_id
    assert cfg.effective_transactional_id.startswith("rr-")


# -- Kubernetes service links -------------------------------------------------------------------
SERVICE_LINKS = {   # what a Service `rollout-reassembler` (and `rollout-reassembler-metrics`) give a pod
    "ROLLOUT_REASSEMBLER_SERVICE_HOST": "10.96.0.12",
    "ROLLOUT_REASSEMBLER_SERVICE_PORT": "9400",
    "ROLLOUT_REASSEMBLER_SERVICE_PORT_METRICS": "9400",
    "ROLLOUT_REASSEMBLER_PORT": "tcp://10.96.0.12:9400",
    "ROLLOUT_REASSEMBLER_PORT_9400_TCP": "tcp://10.96.0.12:9400",
    "ROLLOUT_REASSEMBLER_PORT_9400_TCP_PROTO": "tcp",
    "ROLLOUT_REASSEMBLER_PORT_9400_TCP_PORT": "9400",
    "ROLLOUT_REASSEMBLER_PORT_9400_TCP_ADDR": "10.96.0.12",
    "ROLLOUT_REASSEMBLER_METRICS_SERVICE_HOST": "10.96.0.13",
    "ROLLOUT_REASSEMBLER_METRICS_PORT": "tcp://10.96.0.13:9400",   # also the name of a setting
    "ROLLOUT_REASSEMBLER_METRICS_PORT_9400_TCP_ADDR": "10.96.0.13",
}


def test_service_link_variables_are_not_settings():
    cfg = load_config(None, {**SERVICE_LINKS, "ROLLOUT_REASSEMBLER_GROUP_TIMEOUT_MS": "7000"})
    assert cfg.group_timeout_ms == 7000 and cfg.metrics_port == StageConfig().metrics_port   # the default
    # the setting of the same name still works with a port number
    assert load_config(None, {**SERVICE_LINKS, "ROLLOUT_REASSEMBLER_METRICS_PORT": "9400"}).metrics_port == 9400
    # and names that only look similar are still refused
    with pytest.raises(ValueError, match="ROLLOUT_REASSEMBLER_SERVICE_HOSTS"):
        load_config(None, {"ROLLOUT_REASSEMBLER_SERVICE_HOSTS": "x"})


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,needle", [
    ("group_timeot_ms: 5\n", r"group_timeot_ms \(file .*stage.yaml\): unknown setting; known: bootstrap_servers"),
    ("topics: {receipt: x}\n", r"topics.receipt \(file .*\): unknown setting; known: receipts, staged_calls"),
    ("processing: twice\n", r"processing = 'twice' \(file .*\): Input should be 'exactly_once' or 'at_least_once'"),
    ("framing: confluent\n", r"framing 'confluent' needs schema_registry_url \[framing: file .*, "
                             r"schema_registry_url: default\]"),
    ("max_inflight_groups: 0\n", r"max_inflight_groups = 0 .*greater than or equal to 1"),
    ("revoke_budget_ms: -1\n", r"revoke_budget_ms = -1 .*greater than or equal to 0"),
    ("poll_timeout_ms: -1\n", r"poll_timeout_ms = -1 .*greater than or equal to 1"),
    ("poll_timeout_ms: 60000\n", r"poll_timeout_ms = 60000 .*less than or equal to 1000"),
    ("metrics_port: -1\n", r"metrics_port = -1 .*greater than or equal to 0"),
    ("metrics_port: 70000\n", r"metrics_port = 70000 .*less than or equal to 65535"),
    ("transaction_timeout_ms: 1000000\n", r"transaction_timeout_ms = 1000000 .*less than or equal to 900000"),
    ("group_timeout_ms: true\n", r"group_timeout_ms = True .*expected an integer, got a boolean"),
    ("group_timeout_ms: 1.5\n", r"group_timeout_ms = 1.5 .*valid integer"),
    ("resume_fraction: 1\n", r"resume_fraction = 1 .*less than 1"),
    ("max_record_bytes: 2000000000\n", r"max_record_bytes = 2000000000 .*less than or equal to"),
    ("finalize: {defer_routes: true}\n", r"requires router replay .*\[finalize.defer_routes: file .*"
                                         r"finalize.router_replay: default\]"),
    ("finalize: {device: tpu}\n", r"finalize.device = 'tpu' .*must be cpu, cuda, cuda:N or auto"),
    ("finalize: {device: 'cuda:x'}\n", r"finalize.device = 'cuda:x'"),
    ("finalize: {route_plan_schema_version: 9}\n", r"route_plan_schema_version = 9 .*Input should be 2 or 3"),
    ("finalize: {max_seq_len: 0}\n", r"finalize.max_seq_len = 0"),
    ("finalize: {top_logprobs: -1}\n", r"finalize.top_logprobs = -1"),
    ("finalize: {staging_partition: ''}\n", r"finalize.staging_partition = ''"),
    ("topics: {receipts: 'has space'}\n", r"topics.receipts = 'has space' .*pattern"),
    ("topics: {receipts: same, staged_calls: same}\n", r"receipts and staged_calls = 'same'"),
    ("kafka: {linger.ms: null}\n", r"kafka.linger.ms \(file .*\): a client property must be a string"),
    ("kafka: [a]\n", r"kafka \(file .*\): Input should be a valid dictionary"),
    ("max_poll_interval_ms: 100000\ntransaction_timeout_ms: 95000\n",
     r"max_poll_interval_ms \(100000\) must exceed revoke_budget_ms \+ transaction_timeout_ms \(105000\): "
     r"raise max_poll_interval_ms or lower the others \[max_poll_interval_ms: file .*, "
     r"revoke_budget_ms: default, transaction_timeout_ms: file .*\]"),
    ("- a list\n", "top level must be a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_configuration_is_a_clear_error(tmp_path, text, needle):
    with pytest.raises(ValueError, match=needle):
        load_config(_yaml(tmp_path, text), {})


@pytest.mark.parametrize("env,needle", [
    ({"ROLLOUT_REASSEMBLER_NOPE": "1"}, r"ROLLOUT_REASSEMBLER_NOPE \(environment\): unknown setting 'nope'"),
    ({"ROLLOUT_REASSEMBLER_FINALIZE__NOPE": "1"},
     r"finalize.nope \(environment ROLLOUT_REASSEMBLER_FINALIZE__NOPE\): unknown setting; known: router_replay"),
    ({"ROLLOUT_REASSEMBLER_GROUP_TIMEOUT_MS__X": "1"}, r"group_timeout_ms is not a section"),
    ({"ROLLOUT_REASSEMBLER_FINALIZE": "cuda"},
     r"ROLLOUT_REASSEMBLER_FINALIZE \(environment\): a whole section must be one JSON object"),
    ({"ROLLOUT_REASSEMBLER_FINALIZE__ROUTER_REPLAY": "maybe"},
     r"finalize.router_replay = 'maybe' \(environment ROLLOUT_REASSEMBLER_FINALIZE__ROUTER_REPLAY\): "
     r"Input should be a valid boolean"),
    ({"ROLLOUT_REASSEMBLER_GROUP_TIMEOUT_MS": "30s"},
     r"group_timeout_ms = '30s' \(environment ROLLOUT_REASSEMBLER_GROUP_TIMEOUT_MS\): Input should be a valid integer"),
    ({"ROLLOUT_REASSEMBLER_FINALIZE__DEVICE": "tpu"},
     r"finalize.device = 'tpu' \(environment ROLLOUT_REASSEMBLER_FINALIZE__DEVICE\): must be cpu, cuda, cuda:N or auto"),
    ({"ROLLOUT_REASSEMBLER_POLL_TIMEOUT_MS": "-1", "ROLLOUT_REASSEMBLER_METRICS_PORT": "-1"},
     r"2 problems:\n  poll_timeout_ms = '-1' .*\n  metrics_port = '-1'"),
])
def test_bad_environment_is_a_clear_error(env, needle):
    with pytest.raises(ValueError, match=needle):
        load_config(None, env)


def test_client_property_values_are_never_repeated_in_errors(tmp_path):
    with pytest.raises(ValueError) as error:
        load_config(_yaml(tmp_path, "kafka: {sasl.password: [hunter2]}\n"), {})
    assert "kafka.sasl.password" in str(error.value) and "hunter2" not in str(error.value)


def test_not_settings_in_our_namespace_are_ignored():
    env = {name: "1" for name in ("ROLLOUT_REASSEMBLER_FAULT", "ROLLOUT_REASSEMBLER_MALLOC_TUNING",
                                  "ROLLOUT_REASSEMBLER_SCHEMAS_DIR", "ROLLOUT_REASSEMBLER_KAFKA_JARS")}
    assert load_config(None, env) == StageConfig()


# -- the staging partition follows the staged-calls topic ---------------------------------------
def test_staging_partition_follows_the_staged_calls_topic(tmp_path):
    cfg = load_config(_yaml(tmp_path, "topics: {staged_calls: prod.staged}\n"), {})
    assert cfg.finalize.staging_partition == "prod.staged"
    cfg = StageConfig(topics=TopicNames(staged_calls="a.staged"), finalize=ReassemblyConfig(router_replay=True))
    assert cfg.finalize.staging_partition == "a.staged" and cfg.finalize.router_replay
    # a copy with other topics derives it again; an explicit value is kept
    assert cfg.replace(topics=TopicNames(staged_calls="b.staged")).finalize.staging_partition == "b.staged"
    explicit = StageConfig(topics=TopicNames(staged_calls="a.staged"),
                           finalize=ReassemblyConfig(staging_partition="logical"))
    assert explicit.replace(topics=TopicNames()).finalize.staging_partition == "logical"
    assert StageConfig().finalize.staging_partition == TopicNames().staged_calls


def test_replace_validates():
    with pytest.raises(ValueError, match="poll_timeout_ms"):
        StageConfig().replace(poll_timeout_ms=0)
    assert StageConfig().replace(group_id="x").group_id == "x"


def test_rejection_log_level_variable_is_not_a_setting_and_is_checked():
    from stage.runtime.kafka.logs import rejection_log_level
    load_config(None, {"ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL": "OFF"})   # accepted, not a setting
    assert rejection_log_level("warning") == logging.WARNING
    assert rejection_log_level(" off ") > logging.CRITICAL
    assert rejection_log_level("15") == 15
    with pytest.raises(ValueError, match="ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL must be"):
        rejection_log_level("loud")


def test_run_refuses_a_bad_rejection_log_level(monkeypatch, capsys):
    from stage.cli import main
    monkeypatch.setenv("ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL", "loud")
    assert main(["run", "--bootstrap-servers", "127.0.0.1:1"]) == 3
    assert "ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL" in capsys.readouterr().err
