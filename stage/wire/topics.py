"""Default topic names and which record each carries (every topic is keyed by group_id)."""

from __future__ import annotations

from dataclasses import dataclass, fields

RECEIPTS_TOPIC = "rollouts.receipts"
STAGED_CALLS_TOPIC = "rollouts.staged-calls"
CANONICAL_ROWS_TOPIC = "rollouts.canonical-rows"
ROUTE_PLANS_TOPIC = "rollouts.route-plans"
FINALIZED_GROUPS_TOPIC = "rollouts.finalized-groups"
DEAD_LETTER_TOPIC = "rollouts.dead-letter"
STAGE_LEDGER_TOPIC = "rollouts.stage-ledger"

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


@dataclass(frozen=True)
class TopicNames:
    """The stage's topics; override any name by keyword (e.g. per environment prefix)."""

    receipts: str = RECEIPTS_TOPIC
    staged_calls: str = STAGED_CALLS_TOPIC
    canonical_rows: str = CANONICAL_ROWS_TOPIC
    route_plans: str = ROUTE_PLANS_TOPIC
    finalized_groups: str = FINALIZED_GROUPS_TOPIC
    dead_letter: str = DEAD_LETTER_TOPIC
    stage_ledger: str = STAGE_LEDGER_TOPIC

    def all(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def value_subject(topic: str) -> str:
    """Schema Registry subject of a topic's values (Confluent TopicNameStrategy)."""
    return f"{topic}-value"
