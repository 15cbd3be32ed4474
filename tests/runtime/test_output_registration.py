"""Registering the stage's output schemas at start: what the registry's answer makes the stage do
(exit 9 at once with what to fix, or retry through an outage)."""

import threading
import time

import pytest
from confluent_kafka.schema_registry.error import SchemaRegistryError

from stage.runtime.exits import EXIT_SCHEMA_REGISTRY, StageExit
from stage.runtime.kafka.startup import register_output_schemas
from stage.wire import AvroCodec


class _Answers:
    """A registry client whose register_schema answers with the given HTTP statuses in turn
    (None: success, id 7)."""

    def __init__(self, *statuses) -> None:
        self.statuses = list(statuses)
        self.calls = 0

    def register_schema(self, subject, schema):
        self.calls += 1
        status = self.statuses.pop(0) if self.statuses else None
        if status is None:
            return 7
        raise SchemaRegistryError(status, status * 100, f"answer {status}")


def _register(registry, timeout_s=30.0):
    codecs = {"GroupSummary": AvroCodec("GroupSummary", framing="confluent", registry=registry,
                                        subject="summaries-value")}
    register_output_schemas(codecs, ["GroupSummary"], threading.Event(), timeout_s=timeout_s)
    return codecs["GroupSummary"]


@pytest.mark.parametrize("status, hint", [
    (401, "refused the credentials: check schema_registry.basic_auth_user_info"),
    (403, "check schema_registry.basic_auth_user_info and schema_registry.ssl_certificate_location"),
    (409, "incompatible with the versions already registered under this subject"),
])
def test_refusals_end_the_start_at_once_with_what_to_fix(status, hint):
    registry = _Answers(status, None)
    started = time.monotonic()
    with pytest.raises(StageExit) as info:
        _register(registry)
    assert info.value.code == EXIT_SCHEMA_REGISTRY
    assert "cannot register the GroupSummary schema under subject summaries-value" in str(info.value)
    assert hint in str(info.value)
    assert registry.calls == 1 and time.monotonic() - started < 5   # no retry


def test_an_outage_is_retried_until_the_registry_answers():
    registry = _Answers(503, 503, None)
    assert _register(registry).schema_id == 7
    assert registry.calls == 3
