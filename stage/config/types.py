"""Field types shared by the configuration models (StageConfig, ReassemblyConfig, TopicNames).

The models are pydantic models: types, bounds and choices live on the fields, so the loader, the
Helm values schema and docs/configuration.md all follow them (stage/config/schema.py).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError


class ConfigModel(BaseModel):
    """Immutable; unknown keys are errors (a typo must never fall back to a default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def _not_bool(value: Any) -> Any:
    # pydantic reads True as 1; `group_timeout_ms: true` is a mistake, not a 1 ms timeout
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    return value


def _int_text(value: Any) -> Any:
    """Environment values are text: "3" for a field whose choices are integers."""
    return int(value) if isinstance(value, str) and value.strip().lstrip("-").isdigit() else value


# An integer that refuses booleans.
Int = Annotated[int, BeforeValidator(_not_bool)]


def bounded_int(**bounds: int) -> Any:
    """Int with bounds, for use inside a union (``Int | None`` with ``Field(ge=1)`` outside puts
    "ge" instead of "minimum" in pydantic's JSON schema: the bound must precede the validator)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_not_bool)]


# Put before a Literal of integers so that environment text ("2") is read as a number.
IntChoice = BeforeValidator(_int_text)

DEVICE_PATTERN = r"^(cpu|auto|cuda(:[0-9]+)?)$"


def _device(value: str) -> str:
    # what stage/routes/device.py resolve_device accepts (torch would also take e.g. "meta")
    if not re.fullmatch(DEVICE_PATTERN, value):
        raise ValueError(f"must be cpu, cuda, cuda:N or auto, got {value!r}")
    return value


Device = Annotated[str, AfterValidator(_device), Field(json_schema_extra={"pattern": DEVICE_PATTERN})]


def _client_value(value: Any) -> Any:
    # one check instead of pydantic's four union errors (one per member type)
    if isinstance(value, (str, int, float, bool)):
        return value
    raise ValueError(f"a client property must be a string, number or boolean, got {type(value).__name__}")


# A librdkafka property value, passed to confluent-kafka as given.
ClientValue = Annotated[str | int | float | bool, PlainValidator(_client_value),
                        WithJsonSchema({"type": ["string", "number", "boolean"]})]

# Kafka's legal topic names: ASCII letters, digits, '.', '_', '-', at most 249 characters.
TopicName = Annotated[str, Field(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")]


def conflict(message: str, *fields: str) -> PydanticCustomError:
    """A rule between several settings; ``fields`` lets the loader say where each came from."""
    return PydanticCustomError("config_conflict", message, {"fields": list(fields)})
