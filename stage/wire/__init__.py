"""Avro wire layer: the schemas of every topic, PackedTensor, and the record codec.

No Kafka client here: bytes in, dicts out (and back), for the consumer loop, the producer
SDK and the trainer-side reader alike. The tensor helpers need torch: they are imported on first
use (stage.lazy_exports), so the codecs alone do not import it.
"""

from stage import lazy_exports
from stage.config.topics import (
    CANONICAL_ROWS_TOPIC,
    DEAD_LETTER_TOPIC,
    FINALIZED_GROUPS_TOPIC,
    RECEIPTS_TOPIC,
    ROUTE_PLANS_TOPIC,
    STAGE_LEDGER_TOPIC,
    STAGED_CALLS_TOPIC,
    STAGED_ROUTES_TOPIC,
    TopicNames,
)

from .codec import (
    DEFAULT_MAX_RECORD_BYTES,
    INPUT_RECORDS,
    MANAGED_MAX_MESSAGE_BYTES,
    RECORD_HEADROOM_BYTES,
    SMALL_RECORD_MAX_BYTES,
    AvroCodec,
    default_max_record_bytes,
    record_cap,
    zigzag_long,
)
from .errors import RegistryError, SchemaNotCached, WireError
from .schemas import SCHEMAS_DIR_ENV, schema, schema_json, schema_names, schemas_dir
from .topics import (
    INPUT_LEDGER_FIELDS, INPUT_ROLES, OUTPUT_RECORDS, PRODUCED_ROLES, TOPIC_RECORDS, value_subject)

__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "tensors": ("STORAGE_DTYPES", "pack_tensor", "unpack_tensor", "unpack_torch"),
})

__all__ = [
    "AvroCodec", "DEFAULT_MAX_RECORD_BYTES", "SMALL_RECORD_MAX_BYTES", "default_max_record_bytes",
    "INPUT_RECORDS", "MANAGED_MAX_MESSAGE_BYTES", "RECORD_HEADROOM_BYTES", "record_cap", "zigzag_long",
    "RegistryError", "SchemaNotCached", "WireError",
    "SCHEMAS_DIR_ENV", "schema", "schema_json", "schema_names", "schemas_dir",
    "STORAGE_DTYPES", "pack_tensor", "unpack_tensor", "unpack_torch",
    "RECEIPTS_TOPIC", "STAGED_CALLS_TOPIC", "STAGED_ROUTES_TOPIC", "CANONICAL_ROWS_TOPIC", "ROUTE_PLANS_TOPIC",
    "FINALIZED_GROUPS_TOPIC", "DEAD_LETTER_TOPIC", "STAGE_LEDGER_TOPIC", "TOPIC_RECORDS",
    "INPUT_LEDGER_FIELDS", "INPUT_ROLES", "OUTPUT_RECORDS", "PRODUCED_ROLES",
    "TopicNames", "value_subject",
]
