"""Producer SDK (inference workers, rollout owners, a Gym bridge) and the trainer-side reader.

Names are imported from their modules on first use (stage.lazy_exports): a tool that needs one helper
(the operator commands use stage.client.consuming) does not import the reader and torch."""

from stage import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "assembly": ("GroupAssembler", "TrainingGroup", "route_plan_from_record", "row_from_record"),
    "connection": ("BrokerUnreachable",),
    "gym_bridge": ("GymBridge",),
    "position": ("PartitionPosition", "ReadPosition"),
    "producer": ("Delivery", "DeliveryError", "DeliveryFailure", "PreparedCall", "ReceiptEmitter",
                 "RolloutStager", "StagingProducer"),
    "reader": ("CanonicalReader",),
    "resume": ("ResumeResult", "RolloutResumer"),
    "records": ("receipt_event", "route_extras", "staged_call_from_record", "staged_call_value"),
    "route_fetch": ("DeferredRouteFetcher",),
    "staleness": ("Staleness",),
})

__all__ = [
    "BrokerUnreachable", "CanonicalReader", "DeferredRouteFetcher", "Delivery", "DeliveryError", "DeliveryFailure", "GroupAssembler",
    "GymBridge", "PartitionPosition", "ReadPosition", "ReceiptEmitter", "ResumeResult", "RolloutResumer",
    "RolloutStager", "Staleness", "StagingProducer", "TrainingGroup", "receipt_event", "route_extras", "route_plan_from_record",
    "row_from_record", "staged_call_from_record", "staged_call_value",
]
