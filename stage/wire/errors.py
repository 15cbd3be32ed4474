"""The one exception type of the wire layer.

Everything that rejects bytes or a record raises ``WireError`` (a ``ValueError``), so the
consumer loop has exactly one thing to catch before routing a record to the dead-letter topic.
"""

from __future__ import annotations


class WireError(ValueError):
    """Bytes or a record do not satisfy the wire contract. ``field`` is the path when known."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message


class RegistryError(WireError):
    """The Schema Registry could not answer for a schema id or subject.

    ``retriable`` is False when the registry said the schema does not exist (the record is
    undecodable: dead-letter it) and True for outages and for refusals of the client itself
    (401, 403: credentials or certificate), which say nothing about the data: retry, do not
    dead-letter good data. ``status`` is the registry's HTTP status when it answered.
    """

    def __init__(self, message: str, *, retriable: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.retriable = retriable
        self.status = status


class SchemaNotCached(RegistryError):
    """``decode(..., fetch=False)`` met a schema id it has not resolved yet: resolve it off the
    poll thread (``AvroCodec.prefetch``) and decode the record again."""

    def __init__(self, schema_id: int) -> None:
        super().__init__(f"schema id {schema_id} is not resolved yet", retriable=True)
        self.schema_id = schema_id
