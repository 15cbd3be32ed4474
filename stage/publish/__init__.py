"""Finalized groups -> output records; publication tied to the input offsets (transactions).

Names are imported from their modules on first use (stage.lazy_exports): the operator commands need
the dead-letter vocabulary (stage.publish.deadletters), not the finalizer and torch."""

from stage import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "records": ("GroupContext", "ledger_record", "plan_record", "row_record", "summary_record"),
    "transaction": ("AtLeastOncePublisher", "Batch", "PublishAborted", "StageFatal",
                    "TransactionalPublisher"),
})

__all__ = ["AtLeastOncePublisher", "Batch", "GroupContext", "PublishAborted", "StageFatal",
           "TransactionalPublisher", "ledger_record", "plan_record", "row_record",
           "summary_record"]
