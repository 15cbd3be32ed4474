"""The SDK's clients with a bootstrap address where no broker answers (issue 27 item 3): the
producer's first record, the reader's creation and the route fetcher's first fetch fail within
their connect timeout with BrokerUnreachable, one line naming the address and the setting;
librdkafka's own lines go through the rate-limited logger, never straight to stderr."""

from __future__ import annotations

import logging

import pytest

from stage.brokers.kraft import free_port
from stage.client import BrokerUnreachable, CanonicalReader, DeferredRouteFetcher, RolloutStager, StagingProducer
from stage.client.connection import KAFKA_LOGGER, RateLimit
from stage.client.consuming import reader_defaults
from stage.client.producer import producer_defaults
from tests.client.test_producer import ROOT


@pytest.fixture(scope="module")
def nowhere() -> str:
    return f"127.0.0.1:{free_port()}"      # nothing listens there


def _one_line_naming(error: BrokerUnreachable, address: str, who: str) -> None:
    text = str(error)
    assert "\n" not in text and text.startswith(f"{who}: no Kafka broker answered at {address} within 1s")
    assert "bootstrap_servers" in text and "security.protocol" in text


def test_the_producers_first_record_fails_naming_the_address_and_later_ones_at_once(nowhere):
    producer = StagingProducer(nowhere, connect_timeout=1)
    stager = RolloutStager(producer, "g", "g-r0")
    with pytest.raises(BrokerUnreachable) as first:
        stager.stage("c0", **ROOT)
    _one_line_naming(first.value, nowhere, "StagingProducer")
    with pytest.raises(BrokerUnreachable) as again:     # known now: not probed again
        producer.produce("t", "g", b"x")
    assert again.value is first.value


@pytest.mark.parametrize("group", [None, "trainer"])
def test_the_reader_fails_at_creation_naming_the_address(nowhere, group):
    with pytest.raises(BrokerUnreachable) as raised:
        CanonicalReader(nowhere, group_id=group, connect_timeout=1)
    _one_line_naming(raised.value, nowhere, "CanonicalReader")


def test_the_route_fetcher_fails_at_its_first_fetch_naming_the_address(nowhere):
    fetcher = DeferredRouteFetcher(nowhere, dims=(2, 2), connect_timeout=1)
    assert fetcher.fetch([]) == {}                       # nothing to read: no contact
    with pytest.raises(BrokerUnreachable) as raised:
        fetcher.fetch([("rollouts.staged-calls", 0, 5)])
    _one_line_naming(raised.value, nowhere, "DeferredRouteFetcher")
    fetcher.close()


def test_sdk_clients_log_librdkafka_through_the_rate_limited_logger():
    for conf in (producer_defaults("b:9092", 1 << 20), reader_defaults("b:9092", "g")):
        logger = conf["logger"]
        assert isinstance(logger, logging.Logger) and logger.name == KAFKA_LOGGER
        assert any(isinstance(f, RateLimit) for f in logger.filters)


def test_sdk_producers_find_a_broker_back_well_within_the_stages_deadline_settle():
    """After an outage the stage fires due deadlines SETTLE_S after a partition answers again;
    a producer still backing off then would see its queued records' groups published as
    placeholders (librdkafka's default back-off reaches 10 s)."""
    from stage.runtime.kafka.availability import SETTLE_S
    backoff_ms = producer_defaults("b:9092", 1 << 20)["reconnect.backoff.max.ms"]
    assert backoff_ms * 2 <= SETTLE_S * 1000
