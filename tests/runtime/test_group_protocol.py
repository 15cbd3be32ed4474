"""The consumer group protocol setting (``group_protocol``): classic keeps the cooperative-sticky
assignor on the client; consumer (KIP-848) leaves assignment, session timeout and heartbeat to
the brokers, so every client-side setting librdkafka refuses under it is refused by the
configuration first, with a message naming it. No broker."""

import pytest
from confluent_kafka import Consumer, KafkaException

from stage.config.model import CLASSIC_ONLY_CONSUMER_PROPERTIES, StageConfig
from stage.runtime.kafka.clients import consumer_config


def test_classic_is_the_default_and_keeps_the_cooperative_assignor():
    conf = consumer_config(StageConfig(transactional_id="rr-0"))
    assert conf["partition.assignment.strategy"] == "cooperative-sticky"
    assert "group.protocol" not in conf


def test_consumer_protocol_sets_group_protocol_and_drops_the_client_assignor():
    conf = consumer_config(StageConfig(transactional_id="rr-0", group_protocol="consumer"))
    assert conf["group.protocol"] == "consumer"
    assert not set(conf) & set(CLASSIC_ONLY_CONSUMER_PROPERTIES)
    # no static id of the stage's own under KIP-848: the member survives a coordinator restart
    # without one, and a static member could not leave on shutdown (epoch -2); one set in
    # `consumer` (the chart's staticMembership) is Kafka's static behaviour and is kept
    assert "group.instance.id" not in conf
    chart = StageConfig(transactional_id="rr-0", group_protocol="consumer", consumer={"group.instance.id": "pod-0"})
    assert consumer_config(chart)["group.instance.id"] == "pod-0"
    # librdkafka itself accepts what the stage builds (it refuses the classic-only settings at
    # creation, before any connection)
    Consumer({**conf, "bootstrap.servers": "127.0.0.1:1"}).close()


@pytest.mark.parametrize("prop", ["session.timeout.ms", "heartbeat.interval.ms", "group.protocol.type",
                                  "partition.assignment.strategy"])
def test_consumer_protocol_refuses_each_client_side_setting_librdkafka_refuses(prop):
    value = {"partition.assignment.strategy": "cooperative-sticky", "group.protocol.type": "consumer"}.get(prop, 6000)
    with pytest.raises(ValueError, match=f"group_protocol 'consumer' takes {prop} from the brokers"):
        StageConfig(group_protocol="consumer", consumer={prop: value})
    # and librdkafka would have refused it: the configuration's rule mirrors the client's
    conf = consumer_config(StageConfig(transactional_id="rr-0", group_protocol="consumer"))
    with pytest.raises(KafkaException, match="not supported for `group.protocol=consumer`"):
        Consumer({**conf, prop: value, "bootstrap.servers": "127.0.0.1:1"})
    # the classic protocol takes it
    assert consumer_config(StageConfig(consumer={prop: value}))[prop] == value


def test_group_protocol_in_consumer_properties_must_agree_with_the_setting():
    with pytest.raises(ValueError, match="consumer sets group.protocol 'consumer' and group_protocol is 'classic'"):
        StageConfig(consumer={"group.protocol": "consumer"})
    agreed = StageConfig(group_protocol="consumer", consumer={"group.protocol": "consumer"})
    assert consumer_config(agreed)["group.protocol"] == "consumer"


def test_an_unknown_protocol_is_a_configuration_error():
    with pytest.raises(ValueError, match="group_protocol"):
        StageConfig(group_protocol="eager")
