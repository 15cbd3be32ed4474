"""Which record each topic carries, and the Schema Registry subject of its values (the names
themselves are settings: stage.config.topics)."""

from __future__ import annotations

# TopicNames field -> the Avro record its values carry (dead letters are the original bytes).
TOPIC_RECORDS: dict[str, str | None] = {
    "receipts": "ReceiptEvent",
    "staged_calls": "StagedCall",
    "canonical_rows": "CanonicalRow",
    "route_plans": "RoutePlan",
    "finalized_groups": "GroupSummary",
    "dead_letter": None,
    "stage_ledger": "LedgerEntry",
}



def value_subject(topic: str) -> str:
    """Schema Registry subject of a topic's values (Confluent TopicNameStrategy)."""
    return f"{topic}-value"
