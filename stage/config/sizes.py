"""Record sizes: the one cap every record the project writes fits by default (below config
and wire, which both read it)."""

# One cap for every record the project writes, sized for managed Kafka: a
# record batch there may be at most 8,388,608 bytes (8 MiB: the largest topic max.message.bytes
# Confluent Cloud accepts on Basic, Standard and Enterprise clusters, and what `topics create`
# sets by default). 8,000,000 bytes of value leave 388,608 bytes for everything else in the
# batch: the key (a group id, at most 4,096 characters: 16 KiB of UTF-8), a dead letter's
# headers (~4.2 kB) and the batch framing (61 bytes + a few a record); RECORD_HEADROOM_BYTES is
# the least a topic must allow above the cap. Larger values travel in pieces under the cap:
# routes in RouteChunk records (DEFAULT_ROUTE_CHUNK_BYTES), canonical rows in row parts.
# A self-run broker may raise it (max_record_bytes, with the topics' max.message.bytes).
DEFAULT_MAX_RECORD_BYTES = 8_000_000
RECORD_HEADROOM_BYTES = 64 << 10
MANAGED_MAX_MESSAGE_BYTES = 8 << 20
