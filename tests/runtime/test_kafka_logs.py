"""librdkafka's own log lines go through a rate-limited logger: a broker down for minutes is a
few lines a minute per kind of line, and the next line after a window says how many were
suppressed."""

import logging

from stage.config.model import StageConfig
from stage.runtime.kafka.clients import consumer_config, producer_config
from stage.runtime.kafka.logs import KAFKA_LOGGER, RateLimit


def _record(text: str) -> logging.LogRecord:
    # the shape confluent-kafka logs in: "%s [%s] %s" % (facility, client name, message)
    return logging.LogRecord(KAFKA_LOGGER, logging.ERROR, "", 0, "%s [%s] %s",
                             ("FAIL", "rdkafka#producer-1", text), None)


def test_a_storm_of_one_kind_is_cut_to_a_few_lines_a_window():
    now = [0.0]
    limit = RateLimit(burst=3, window_s=60, clock=lambda: now[0])
    storm = [_record(f"127.0.0.1:{9092 + i % 2}/bootstrap: Connect failed (after {i}ms in state CONNECT)")
             for i in range(3682)]
    passed = [r for r in storm if limit.filter(r)]
    assert len(passed) == 3
    other = _record("127.0.0.1:9092/1: Disconnected: connection closed by peer")
    assert limit.filter(other)                       # another kind is not held back by the storm
    now[0] = 61.0
    after = _record("127.0.0.1:9092/bootstrap: Connect failed (after 0ms in state CONNECT)")
    assert limit.filter(after) and "3679 more like it in the last 60s" in after.getMessage()


def test_every_stage_client_logs_through_it():
    cfg = StageConfig(bootstrap_servers="127.0.0.1:1")
    for conf in (consumer_config(cfg), producer_config(cfg)):
        logger = conf["logger"]
        assert logger.name == KAFKA_LOGGER and any(isinstance(f, RateLimit) for f in logger.filters)
