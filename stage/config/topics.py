"""The stage's topics: their default names and ``TopicNames``, the setting that overrides them
(every topic is keyed by group_id; stage.wire.topics says which record each carries)."""

from __future__ import annotations

from pydantic import Field, model_validator

from stage.config.types import ConfigModel, TopicName

RECEIPTS_TOPIC = "rollouts.receipts"
STAGED_CALLS_TOPIC = "rollouts.staged-calls"
STAGED_ROUTES_TOPIC = "rollouts.staged-routes"
CANONICAL_ROWS_TOPIC = "rollouts.canonical-rows"
ROUTE_PLANS_TOPIC = "rollouts.route-plans"
FINALIZED_GROUPS_TOPIC = "rollouts.finalized-groups"
DEAD_LETTER_TOPIC = "rollouts.dead-letter"
STAGE_LEDGER_TOPIC = "rollouts.stage-ledger"


class TopicNames(ConfigModel):
    """The stage's topics; override any name by keyword (e.g. per environment prefix)."""

    receipts: TopicName = Field(RECEIPTS_TOPIC, description="input: receipt events")
    staged_calls: TopicName = Field(STAGED_CALLS_TOPIC, description="input: staged model calls")
    staged_routes: TopicName = Field(STAGED_ROUTES_TOPIC, description="route chunks the staged calls "
                                     "reference (read by the trainer's route fetcher; an input of the "
                                     "stage in direct mode only)")
    canonical_rows: TopicName = Field(CANONICAL_ROWS_TOPIC, description="output: canonical rows")
    route_plans: TopicName = Field(ROUTE_PLANS_TOPIC, description="output: route plans (deferred mode)")
    finalized_groups: TopicName = Field(FINALIZED_GROUPS_TOPIC, description="output: one summary per group")
    dead_letter: TopicName = Field(DEAD_LETTER_TOPIC, description="output: undecodable input records")
    stage_ledger: TopicName = Field(STAGE_LEDGER_TOPIC, description="the stage's compacted ledger")

    @model_validator(mode="after")
    def _distinct(self) -> TopicNames:
        # two roles on one topic would feed outputs back in as input (or mix record types)
        names = self.all()
        shared = sorted({n for n in names.values() if list(names.values()).count(n) > 1})
        if shared:
            roles = {n: [r for r, v in names.items() if v == n] for n in shared}
            raise ValueError("every topic must be distinct, got " + "; ".join(
                f"{' and '.join(r)} = {n!r}" for n, r in roles.items()))
        return self

    def all(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in type(self).model_fields}
