"""Schema Registry TLS settings on the real registry: Apicurio's HTTPS port verified with the
configured CA, and a client certificate through a front that requires one (tests/support/tls.py:
Apicurio's build fixes client-certificate authentication off). Every client of the project goes
through it: the stage, the SDK producer and the trainer-side reader."""

import time

import pytest

from stage.client import CanonicalReader, StagingProducer
from stage.runtime.kafka.registry import registry_client
from tests.integration.harness import (
    RunningStage, make_group, send_group, setup_topics, stage_config, unique_topics,
)
from tests.support.apicurio import CCOMPAT
from tests.support.tls import MutualTlsFront


def _settings(apicurio, *, client_certificate: bool) -> dict:
    pki = apicurio.pki
    settings = {"basic_auth_user_info": apicurio.user_info, "ssl_ca_location": str(pki.ca)}
    if client_certificate:
        settings.update(ssl_certificate_location=str(pki.client_cert), ssl_key_location=str(pki.client_key))
    return settings


def test_an_https_registry_is_verified_with_the_configured_ca(apicurio):
    cfg = stage_config("127.0.0.1:1", unique_topics(), framing="confluent",
                       schema_registry_url=apicurio.https_url,
                       schema_registry=_settings(apicurio, client_certificate=False))
    assert isinstance(registry_client(cfg).get_subjects(), list)
    without_ca = cfg.replace(schema_registry={"basic_auth_user_info": apicurio.user_info})
    with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
        registry_client(without_ca).get_subjects()


def test_every_client_presents_the_client_certificate(kafka, apicurio):
    front = MutualTlsFront(apicurio.pki, apicurio.port)
    try:
        url = front.url(CCOMPAT)
        topics = unique_topics()
        settings = _settings(apicurio, client_certificate=True)
        cfg = stage_config(kafka.bootstrap, topics, framing="confluent", schema_registry_url=url,
                           schema_registry=settings)
        setup_topics(cfg, partitions=1)
        sdk = cfg.schema_registry.client_properties()
        producer = StagingProducer(kafka.bootstrap, topics=topics, framing="confluent",
                                   schema_registry_url=url, schema_registry_config=sdk)
        spec = make_group("mtls", 2, seed=91)
        send_group(producer, spec)
        with RunningStage(cfg) as stage:     # registers its output schemas through the front
            stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 90, "publication")
            assert stage.runtime.stats.total("dead_letters") == 0
        reader = CanonicalReader(kafka.bootstrap, topics=topics, framing="confluent",
                                 schema_registry_url=url, schema_registry_config=sdk)
        try:
            groups = []
            for _ in range(150):
                groups += reader.poll(timeout=0.2)
                if groups:
                    break
        finally:
            reader.close()
        assert [g.group_id for g in groups] == ["mtls"]
        assert front.refused == 0 and front.accepted >= 3   # producer, stage, reader
        no_cert = cfg.replace(schema_registry=_settings(apicurio, client_certificate=False))
        with pytest.raises(Exception, match="CERTIFICATE_REQUIRED|certificate required"):
            registry_client(no_cert).get_subjects()
        deadline = time.monotonic() + 5   # the front counts on its own thread
        while front.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert front.refused == 1
    finally:
        front.close()
