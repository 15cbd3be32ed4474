"""Producer-side helpers (inference workers, rollout owners) and the trainer-side reader."""

from stage.client.records import receipt_event, staged_call_from_record, staged_call_value

__all__ = ["receipt_event", "staged_call_from_record", "staged_call_value"]
