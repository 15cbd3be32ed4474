"""Which record each topic carries, and the Schema Registry subject of its values (the names
themselves are settings: stage.config.topics)."""

from __future__ import annotations

# TopicNames field -> the Avro record its values carry (dead letters are the original bytes).
TOPIC_RECORDS: dict[str, str | None] = {
    "receipts": "ReceiptEvent",
    "staged_calls": "StagedCall",
    "staged_routes": "RouteChunk",
    "canonical_rows": "CanonicalRow",
    "route_plans": "RoutePlan",
    "finalized_groups": "GroupSummary",
    "dead_letter": None,
    "stage_ledger": "LedgerEntry",
}

# The input roles, each with the LedgerEntry field that holds the highest offset of a group's
# records of that role (and, under the dead-letter watermark key, the highest offset
# dead-lettered). The runtime's table of input kinds (stage.runtime.state.inputs) has one row
# per role here.
INPUT_LEDGER_FIELDS: dict[str, str] = {
    "receipts": "max_receipt_offset",
    "staged_calls": "max_staged_offset",
    # Read by the stage in direct router replay only (-1 in every other mode's entries).
    "staged_routes": "max_route_offset",
}
INPUT_ROLES: tuple[str, ...] = tuple(INPUT_LEDGER_FIELDS)
# Topics producers write: the input roles (the route chunks the staged calls reference are read
# by the trainer's route fetcher, and by the stage in direct mode only).
PRODUCED_ROLES: tuple[str, ...] = INPUT_ROLES
# The records the stage publishes (their schemas are registered at start).
OUTPUT_RECORDS: tuple[str, ...] = tuple(
    record for role, record in TOPIC_RECORDS.items() if record and role not in PRODUCED_ROLES)



def value_subject(topic: str) -> str:
    """Schema Registry subject of a topic's values (Confluent TopicNameStrategy)."""
    return f"{topic}-value"
