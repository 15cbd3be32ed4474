"""Producer SDK (inference workers, rollout owners, a Gym bridge) and the trainer-side reader."""

from stage.client.assembly import GroupAssembler, TrainingGroup, route_plan_from_record, row_from_record
from stage.client.gym_bridge import GymBridge
from stage.client.position import PartitionPosition, ReadPosition
from stage.client.producer import (
    Delivery,
    DeliveryError,
    DeliveryFailure,
    PreparedCall,
    ReceiptEmitter,
    RolloutStager,
    StagingProducer,
)
from stage.client.reader import CanonicalReader
from stage.client.records import receipt_event, route_extras, staged_call_from_record, staged_call_value
from stage.client.route_fetch import DeferredRouteFetcher
from stage.client.staleness import Staleness

__all__ = [
    "CanonicalReader", "DeferredRouteFetcher", "Delivery", "DeliveryError", "DeliveryFailure", "GroupAssembler",
    "GymBridge", "PartitionPosition", "PreparedCall", "ReadPosition", "ReceiptEmitter", "RolloutStager",
    "Staleness", "StagingProducer", "TrainingGroup", "receipt_event", "route_extras", "route_plan_from_record",
    "row_from_record", "staged_call_from_record", "staged_call_value",
]
