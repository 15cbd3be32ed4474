"""Configuration: defaults, YAML, environment overrides, pass-through client properties, and
clear errors for typos and bad values."""

import logging

import pytest

from stage.runtime.clients import consumer_config, producer_config
from stage.runtime.config import AT_LEAST_ONCE, StageConfig, load_config


def test_yaml_then_environment(tmp_path):
    path = tmp_path / "stage.yaml"
    path.write_text(
        "bootstrap_servers: broker:9092\n"
        "group_timeout_ms: 30000\n"
        "topics: {receipts: prod.receipts}\n"
        "finalize: {router_replay: true, defer_routes: true, device: cpu}\n"
        "kafka: {security.protocol: SASL_SSL, sasl.mechanism: PLAIN}\n")
    env = {"ROLLOUT_REASSEMBLER_GROUP_TIMEOUT_MS": "45000",
           "ROLLOUT_REASSEMBLER_KAFKA__SASL_USERNAME": "svc",
           "ROLLOUT_REASSEMBLER_KAFKA__SASL_PASSWORD": "secret",
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
        assert conf["sasl.password"] == "secret" and conf["bootstrap.servers"] == "other:9093"


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


@pytest.mark.parametrize("text,needle", [
    ("group_timeot_ms: 5\n", r"unknown stage setting\(s\): group_timeot_ms"),
    ("topics: {receipt: x}\n", r"unknown topics setting\(s\): receipt"),
    ("processing: twice\n", "processing must be"),
    ("framing: confluent\n", "needs schema_registry_url"),
    ("max_inflight_groups: 0\n", "max_inflight_groups must be positive"),
    ("finalize: {defer_routes: true}\n", "requires router replay"),
    ("- a list\n", "top level must be a mapping"),
])
def test_bad_configuration_is_a_clear_error(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        load_config(path, {})


def test_unknown_environment_setting_is_an_error():
    with pytest.raises(ValueError, match="ROLLOUT_REASSEMBLER_NOPE"):
        load_config(None, {"ROLLOUT_REASSEMBLER_NOPE": "1"})
    with pytest.raises(ValueError, match="expected a boolean"):
        load_config(None, {"ROLLOUT_REASSEMBLER_FINALIZE__ROUTER_REPLAY": "maybe"})


def test_rejection_log_level_variable_is_not_a_setting_and_is_checked():
    from stage.runtime.logs import rejection_log_level
    load_config(None, {"ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL": "OFF"})   # accepted, not a setting
    assert rejection_log_level("warning") == logging.WARNING
    assert rejection_log_level(" off ") > logging.CRITICAL
    assert rejection_log_level("15") == 15
    with pytest.raises(ValueError, match="ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL must be"):
        rejection_log_level("loud")


def test_run_refuses_a_bad_rejection_log_level(monkeypatch, capsys):
    from stage.cli import main
    monkeypatch.setenv("ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL", "loud")
    assert main(["run", "--bootstrap-servers", "127.0.0.1:1"]) == 2
    assert "ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL" in capsys.readouterr().err
