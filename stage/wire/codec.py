"""Avro record codec: plain schemaless binary or Confluent Schema Registry framing.

Decoding input is untrusted: whatever the bytes are, ``decode`` returns a schema-valid dict
or raises ``WireError``. The defences, in order: a byte cap before anything is read (the
record kind's own cap: ``record_cap``); the 5-byte header; registry writer schemas reduced to
how their records are laid out (``stage.wire.writers``: every field read as our schema types
it, the writer's logical types ignored) and vetted by ``check_decodable`` (no recursion, no
zero-width array items, ``fixed`` sizes that are counts) before use; for the input records,
the decode budget (``stage.wire.bounds``): a walk of the bytes that refuses lengths and counts
the input cannot hold and records whose decoded objects would exceed 16x their size + 64 KiB,
before fastavro builds anything; fastavro reading from a BytesIO, whose ``read(n)`` returns at
most what the input holds; no trailing bytes; and a range check of ``int`` fields, because
fastavro's reader accepts 2^40 in a 32-bit field (a Java reader would not). Enum and union
values need no check: whatever index fastavro reads, it returns a value of the schema.

An input record written with our own schema is first read by a generated one-pass reader
(``stage.wire.fastread``) that applies the budget's checks as it builds the record; anything
off its common path (hostile, malformed, another writer's schema, a memoryview) returns None
from it and goes through the defences above, which give the reason.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Mapping
from typing import Any

from fastavro import schemaless_reader, schemaless_writer
from fastavro.schema import to_parsing_canonical_form
from fastavro.validation import validate

from .bounds import DecodeBudget
from .errors import RegistryError, SchemaNotCached, WireError
from .fastread import FastReader
from .guard import find_error, int_range_checker, named_types
from .schemas import schema, schema_json
from .writers import writer_encoding
from stage.config.sizes import DEFAULT_MAX_RECORD_BYTES, MANAGED_MAX_MESSAGE_BYTES, RECORD_HEADROOM_BYTES  # noqa: F401 - re-exported

MAGIC = 0  # Confluent wire format v0: magic byte 0x00 + 4-byte big-endian schema id
HEADER_BYTES = 5
# Default byte caps: stage.config.sizes says why these numbers. Records without tensors are
# arrays of small items, which inflate up to ~65x when decoded into Python objects (measured:
# 900 kB of 3-byte RowRejection items -> 58 MB): their default is the same cap, and a receipt
# keeps it whatever max_record_bytes says (a 10,000-call receipt is ~3.5 MB).
SMALL_RECORD_MAX_BYTES = DEFAULT_MAX_RECORD_BYTES
_TENSOR_RECORDS = frozenset(("StagedCall", "CanonicalRow", "PackedTensor", "RouteChunk"))
# A kind's own cap, whatever max_record_bytes the codec is given (the runtime gives every codec
# the stage's max_record_bytes, which a self-run broker may raise): a receipt is token-free, and
# its SMALL_RECORD_MAX_BYTES is what keeps its decoded manifest and per-label metrics bounded.
_KIND_CAPS = {"ReceiptEvent": SMALL_RECORD_MAX_BYTES}
# The records producers write: untrusted, so decoded under the budget (stage.wire.bounds).
# The stage's own outputs are not: a GroupSummary of many short rejections legitimately
# decodes to ~20x its bytes.
INPUT_RECORDS = frozenset(("StagedCall", "ReceiptEvent", "RouteChunk"))


# Fields appended to a record since the previous release (each with a default). Plain framing
# has no writer schema to resolve: a record written by the previous release is this record's
# bytes minus these trailing fields, so it is read as written by our schema without them (the
# fields take their defaults) when it does not decode as ours. Registry framing needs none of
# this: the writer's schema id says which version wrote it.
PLAIN_PREVIOUS_FIELDS: dict[str, tuple[str, ...]] = {
    "StagedCall": ("routes_ref",),
    "LedgerEntry": ("max_route_offset",),
}


_MISSING_ID_TTL_S = 30.0  # re-ask the registry about an unknown id after this long
_MISSING_ID_CACHE = 1024  # bound: garbage input can name 2^32 different ids


def default_max_record_bytes(schema_name: str) -> int:
    return DEFAULT_MAX_RECORD_BYTES if schema_name in _TENSOR_RECORDS else SMALL_RECORD_MAX_BYTES


def record_cap(schema_name: str, max_record_bytes: int | None = None) -> int:
    """The byte cap a codec of ``schema_name`` applies: ``max_record_bytes`` (default:
    ``default_max_record_bytes``), never above the kind's own cap (ReceiptEvent:
    SMALL_RECORD_MAX_BYTES)."""
    if max_record_bytes is None:
        max_record_bytes = default_max_record_bytes(schema_name)
    return min(max_record_bytes, _KIND_CAPS.get(schema_name, max_record_bytes))


class AvroCodec:
    """Encode/decode one record type of the contract (``schema_name``, e.g. "StagedCall").

    ``framing="confluent"`` needs a ``registry`` (a confluent_kafka SchemaRegistryClient); the
    writer also needs ``subject`` (TopicNameStrategy: ``"<topic>-value"``) and registers the
    schema there on first use (``auto_register=False``: only look it up). Both cache the id.
    ``max_record_bytes`` caps both directions (default: ``default_max_record_bytes``; never
    above the kind's own cap, see ``record_cap``). ``budget`` (default: on for the
    ``INPUT_RECORDS``) walks the bytes before decoding them (``stage.wire.bounds``).
    Safe to share between threads: caches only ever gain correct entries.
    """

    def __init__(self, schema_name: str, *, framing: str = "plain", registry: Any = None,
                 subject: str | None = None, auto_register: bool = True,
                 max_record_bytes: int | None = None, budget: bool | None = None) -> None:
        if framing not in ("plain", "confluent"):
            raise ValueError(f"framing must be 'plain' or 'confluent', got {framing!r}")
        if framing == "confluent" and registry is None:
            raise ValueError("confluent framing needs a Schema Registry client (registry=...)")
        if max_record_bytes is not None and max_record_bytes <= 0:
            raise ValueError("max_record_bytes must be positive")
        max_record_bytes = record_cap(schema_name, max_record_bytes)
        self.schema_name = schema_name
        self.framing = framing
        self.registry = registry
        self.subject = subject
        self.auto_register = auto_register
        self.max_record_bytes = max_record_bytes
        self.schema = schema(schema_name)
        self._named = named_types(self.schema)
        self._canonical = to_parsing_canonical_form(self.schema)
        self._check_ints = int_range_checker(self.schema)
        if budget is None:
            budget = schema_name in INPUT_RECORDS
        # The walk of our own schema (None: decoded without one); writers' walks by schema id.
        self.decode_budget = DecodeBudget(self.schema, schema_name) if budget else None
        # Records written with our schema take one generated pass first (stage.wire.fastread);
        # None from it means: decode the careful way below.
        self._fast = FastReader.build(self.schema, schema_name, self.decode_budget)
        self._previous = _previous_writer(schema_name)
        self._previous_budget = (DecodeBudget(self._previous, schema_name)
                                 if budget and self._previous is not None else None)
        self._writer_budgets: dict[int, DecodeBudget] = {}  # schema id -> its writer's walk
        self._header: bytes | None = None  # our own id, resolved on first encode
        # schema id -> parsed writer schema, None (reads as ours), or the WireError refusing it
        self._writers: dict[int, Any] = {}
        self._missing: dict[int, float] = {}  # schema id -> monotonic time to ask again

    @property
    def schema_id(self) -> int | None:
        """Our schema's registry id once the first confluent encode resolved it."""
        return int.from_bytes(self._header[1:], "big") if self._header else None

    # -- encode ---------------------------------------------------------------------------

    def encode(self, record: Mapping[str, Any]) -> bytes:
        """Validated Avro bytes of ``record`` (fields with a default may be left out).

        A tensor's ``data`` (bytes or any C-contiguous buffer, e.g. a numpy array's memoryview)
        of at least SPLICE_BYTES is not copied through fastavro's write buffer: the record is
        encoded with a unique 16-byte marker in its place and the payload spliced in where the
        marker stands, so a large row is copied once (into the result) instead of three times.
        Avro bytes are a length and the raw bytes, so the result is the same bytes."""
        for _attempt in range(3):
            shadow, payloads = _shadow(record)
            encoded = self._write(shadow)
            try:
                data = _splice(encoded, payloads) if payloads else encoded
                break
            except _SpliceCollision:
                continue
        else:   # three draws of 128 random bits each matched other bytes: not by chance
            raise WireError(f"{self.schema_name}: tensor payload markers collide")
        if len(data) > self.max_record_bytes:
            raise WireError(
                f"{self.schema_name} record is {len(data)} bytes, over max_record_bytes="
                f"{self.max_record_bytes}: raise the limit together with the topic's "
                "max.message.bytes and the client limits, or make the record smaller")
        return data

    def _write(self, record: Mapping[str, Any]) -> bytes:
        if not validate(record, self.schema, raise_errors=False):
            raise self._record_error(record, None)
        out = io.BytesIO()
        if self.framing == "confluent":
            out.write(self._header or self._register())
        try:
            # strict_allow_default: refuse unknown fields (a typo would vanish silently),
            # fill omitted fields that have a default.
            schemaless_writer(out, self.schema, record, strict_allow_default=True)
        except Exception as e:  # fastavro's writer raises ValueError/TypeError/...
            raise self._record_error(record, e) from None
        return out.getvalue()

    def _record_error(self, record: Any, cause: Exception | None) -> WireError:
        found = find_error(self.schema, record, self.schema_name, self._named)
        if found is None:  # our walk found nothing: fall back to fastavro's words
            found = (self.schema_name, str(cause or "fastavro rejects the record")[:300])
        return WireError(found[1], field=found[0])

    def _register(self) -> bytes:
        if not self.subject:
            raise ValueError("encoding with confluent framing needs subject=... (e.g. '<topic>-value')")
        from confluent_kafka.schema_registry import Schema

        avro = Schema(schema_json(self.schema_name), "AVRO")
        try:
            if self.auto_register:
                schema_id = self.registry.register_schema(self.subject, avro)
            else:
                schema_id = self.registry.lookup_schema(self.subject, avro).schema_id
        except Exception as e:
            raise _registry_error(f"subject {self.subject}", e) from None
        self._writers[schema_id] = None  # our own id decodes without resolution
        self._header = bytes([MAGIC]) + int(schema_id).to_bytes(4, "big")
        return self._header

    # -- decode ---------------------------------------------------------------------------

    def decode(self, data: bytes | bytearray | memoryview, *, fetch: bool = True) -> dict:
        """A schema-valid dict, or WireError for anything else the bytes may be.

        ``fetch=False`` never calls the registry: a schema id not resolved yet raises
        ``SchemaNotCached`` (the consumer loop resolves it on another thread with ``prefetch``)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WireError(f"expected bytes, got {type(data).__name__}")
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size > self.max_record_bytes:
            raise WireError(f"{self.schema_name}: {size} bytes exceeds max_record_bytes="
                            f"{self.max_record_bytes}")
        writer, start, budget = None, 0, self.decode_budget
        if self.framing == "confluent":
            if size < HEADER_BYTES:
                raise WireError(f"{size} bytes is shorter than the 5-byte Confluent header")
            if data[0] != MAGIC:
                raise WireError(f"magic byte 0x{data[0]:02x} is not 0x00 (Confluent v0 "
                                "framing; the v1 GUID framing is not supported)")
            schema_id = int.from_bytes(data[1:5], "big")
            writer, start = self._writer_schema(schema_id, fetch), HEADER_BYTES
            if writer is not None and budget is not None:
                budget = self._writer_budgets[schema_id]
        if writer is None and self._fast is not None and type(data) is bytes:
            record = self._fast.read(data, start, size)
            if record is not None:
                return record
        if budget is not None:
            try:
                budget.check(data, start, size)
            except WireError:
                # plain framing: a record of the previous release ends early for this walk
                if writer is not None or self._previous is None:
                    raise
                self._previous_budget.check(data, start, size)
                writer = self._previous
        buf = io.BytesIO(data)
        buf.seek(start)
        try:
            if writer is None:
                record = schemaless_reader(buf, self.schema, None)
            else:  # resolve the writer's schema against ours: added fields take defaults
                record = schemaless_reader(buf, writer, self.schema)
        except Exception as e:  # EOFError, IndexError, UnicodeDecodeError, resolution errors...
            record = self._as_previous(data, start, size, e) if writer is None else None
            if record is None:
                raise WireError(f"cannot decode {self.schema_name}: {type(e).__name__}: "
                                f"{str(e)[:200]}") from None
            buf.seek(size)
        if buf.tell() != size:
            raise WireError(f"{self.schema_name}: {size - buf.tell()} trailing bytes after the record")
        bad = self._check_ints(record)
        if bad is not None:
            raise WireError(f"{bad[1]} does not fit the int (32-bit) field",
                            field=f"{self.schema_name}{bad[0]}")
        return record

    def _as_previous(self, data, start: int, size: int, error: Exception) -> dict | None:
        """A plain record of the previous release (PLAIN_PREVIOUS_FIELDS), or None. Only a
        record that ended early can be one: it must then decode to its last byte."""
        if self._previous is None or not isinstance(error, EOFError):
            return None
        buf = io.BytesIO(data)
        buf.seek(start)
        try:
            record = schemaless_reader(buf, self._previous, self.schema)
        except Exception:
            return None
        return record if buf.tell() == size else None

    def schema_id_of(self, data: bytes) -> int | None:
        """The schema id in a Confluent-framed record's header (None if it has none)."""
        if self.framing != "confluent" or len(data) < HEADER_BYTES or data[0] != MAGIC:
            return None
        return int.from_bytes(data[1:5], "big")

    def prefetch(self, schema_id: int) -> None:
        """Resolve ``schema_id`` into the cache (blocking; raises RegistryError on an outage).
        A refusal (the registry says it does not exist, or the schema is unusable) is cached
        too, so that the records naming it are dead-lettered when decoded again."""
        try:
            self._writer_schema(schema_id, True)
        except RegistryError as e:
            if e.retriable:
                raise
        except WireError:
            pass

    def ensure_registered(self) -> None:
        """Resolve our own schema id now (encoding must not wait on the registry later)."""
        if self.framing == "confluent" and self._header is None:
            self._register()

    def _writer_schema(self, schema_id: int, fetch: bool = True) -> Any:
        """Parsed writer schema of ``schema_id`` (None when it reads as ours), cached."""
        if schema_id in self._writers:
            writer = self._writers[schema_id]
            if isinstance(writer, WireError):
                raise WireError(str(writer))
            return writer
        if self._missing.get(schema_id, 0.0) > time.monotonic():
            raise RegistryError(f"schema id {schema_id} is not in the registry", retriable=False)
        if not fetch:
            raise SchemaNotCached(schema_id)
        try:
            registered = self.registry.get_schema(schema_id)
        except Exception as e:
            err = _registry_error(f"schema id {schema_id}", e)
            if not err.retriable:
                if len(self._missing) >= _MISSING_ID_CACHE:
                    self._missing.clear()  # atomic, unlike evicting one entry, under threads
                self._missing[schema_id] = time.monotonic() + _MISSING_ID_TTL_S
            raise err from None
        try:
            writer = self._vet_writer(schema_id, registered)
        except WireError as e:  # a registered schema never changes: remember the refusal
            self._writers[schema_id] = e
            raise
        self._writers[schema_id] = writer
        return writer

    def _vet_writer(self, schema_id: int, registered: Any) -> Any:
        if getattr(registered, "schema_type", "AVRO") not in (None, "AVRO"):
            raise WireError(f"schema id {schema_id} is {registered.schema_type}, not AVRO")
        if getattr(registered, "references", None):
            raise WireError(f"schema id {schema_id} uses schema references; register "
                            "self-contained schemas (stage.wire.schema_json)")
        what = f"schema id {schema_id}"
        writer, canonical = writer_encoding(registered.schema_str, what)
        if canonical == self._canonical:
            return None
        if self.decode_budget is not None:
            self._writer_budgets[schema_id] = DecodeBudget(
                writer, f"{self.schema_name} ({what})", reader=self.schema)
        return writer


# 4xx answers that refuse the client, not the input: timeouts, throttling, credentials or
# certificate refused (401, 403). Records waiting on them are held, never dead-lettered.
_CLIENT_REFUSALS = frozenset((401, 403, 408, 429))


def _registry_error(what: str, e: Exception) -> RegistryError:
    status = getattr(e, "http_status_code", None)
    status = status if isinstance(status, int) else None
    # other 4xx mean the registry answered "no such thing" (or "not that schema"): the input is bad
    retriable = not (status is not None and 400 <= status < 500 and status not in _CLIENT_REFUSALS)
    return RegistryError(f"Schema Registry failed for {what}: {type(e).__name__}: {e}",
                         retriable=retriable, status=status)


# -- splicing large tensor payloads ----------------------------------------------------------
SPLICE_BYTES = 1 << 20
_MARKER_BYTES = 16
_MARKER_PREFIX = 2 * _MARKER_BYTES   # the zigzag varint of the marker's length: one byte


def _shadow(record: Mapping[str, Any]):
    """``record`` with every large or non-bytes tensor payload (a top-level PackedTensor's
    ``data``) replaced by a fresh random marker, and {marker: payload}; ``record`` itself when
    there is none."""
    payloads: dict[bytes, memoryview] = {}
    shadow = None
    for name, value in record.items():
        if not (isinstance(value, dict) and "dtype" in value and "data" in value):
            continue
        data = value["data"]
        if isinstance(data, (bytes, bytearray)) and len(data) < SPLICE_BYTES:
            continue
        try:
            view = memoryview(data).cast("B")
        except TypeError:   # not a C-contiguous buffer: left to validation, which refuses it
            continue
        marker = os.urandom(_MARKER_BYTES)
        payloads[marker] = view
        if shadow is None:
            shadow = dict(record)
        shadow[name] = {**value, "data": marker}
    return (shadow if shadow is not None else record), payloads


def _splice(encoded: bytes, payloads: dict) -> bytes:
    """Each payload where its marker was encoded, with the marker's length prefix replaced by
    the payload's. Raises _SpliceCollision unless every marker occurs exactly once."""
    found = []
    for marker, payload in payloads.items():
        at = encoded.find(marker)
        if at < 1 or encoded.find(marker, at + 1) != -1 or encoded[at - 1] != _MARKER_PREFIX:
            raise _SpliceCollision()
        found.append((at, payload))
    chunks, start = [], 0
    for at, payload in sorted(found, key=lambda item: item[0]):   # in the schema's field order
        chunks += [encoded[start:at - 1], zigzag_long(payload.nbytes), payload]
        start = at + _MARKER_BYTES
    chunks.append(encoded[start:])
    return b"".join(chunks)


class _SpliceCollision(RuntimeError):
    """A marker's 16 random bytes also occur elsewhere in the record: draw new ones."""


def zigzag_long(value: int) -> bytes:
    """Avro's long encoding: zigzag, then base-128 varint, low group first."""
    n = (value << 1) ^ (value >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _previous_writer(schema_name: str):
    """Our schema without the fields appended since the previous release (parsed), or None."""
    added = PLAIN_PREVIOUS_FIELDS.get(schema_name)
    if not added:
        return None
    import json
    from fastavro import parse_schema
    doc = json.loads(schema_json(schema_name))
    names = [f["name"] for f in doc["fields"]]
    if tuple(names[-len(added):]) != added:
        raise WireError(f"{schema_name}: PLAIN_PREVIOUS_FIELDS {added} are not its last fields")
    doc["fields"] = doc["fields"][:-len(added)]
    return parse_schema(doc, named_schemas={})
