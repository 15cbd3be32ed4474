"""Producer SDK (inference workers, rollout owners, a Gym bridge) and the trainer-side reader."""

from stage.client.gym_bridge import GymBridge
from stage.client.producer import (
    Delivery,
    DeliveryError,
    DeliveryFailure,
    PreparedCall,
    ReceiptEmitter,
    RolloutStager,
    StagingProducer,
)
from stage.client.reader import (
    CanonicalReader,
    DeferredRouteFetcher,
    GroupAssembler,
    TrainingGroup,
    route_plan_from_record,
    row_from_record,
)
from stage.client.records import receipt_event, route_extras, staged_call_from_record, staged_call_value

__all__ = [
    "CanonicalReader", "DeferredRouteFetcher", "Delivery", "DeliveryError", "DeliveryFailure", "GroupAssembler",
    "GymBridge", "PreparedCall", "ReceiptEmitter", "RolloutStager", "StagingProducer",
    "TrainingGroup", "receipt_event", "route_extras", "route_plan_from_record", "row_from_record",
    "staged_call_from_record", "staged_call_value",
]
