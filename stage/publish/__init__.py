"""Finalized groups -> output records; publication tied to the input offsets (transactions)."""

from stage.publish.records import GroupContext, ledger_record, plan_record, row_record, summary_record
from stage.publish.transaction import (
    AtLeastOncePublisher,
    Batch,
    PublishAborted,
    StageFatal,
    TransactionalPublisher,
)

__all__ = ["AtLeastOncePublisher", "Batch", "GroupContext", "PublishAborted", "StageFatal",
           "TransactionalPublisher", "ledger_record", "plan_record", "row_record",
           "summary_record"]
