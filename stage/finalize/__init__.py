"""Rollout and group finalization (NeMo RL's reassembler semantics). No Kafka imports.

decode happens upstream; here: fetch staged rows -> verify (stage.contract) -> build exactly
N canonical rows, route plans and metrics.
"""

from stage.config.finalize import ReassemblyConfig
from stage.finalize.group import REJECTION_LOGGER, CanonicalRow, FinalizedGroup, GroupFinalizer, pad_group
from stage.finalize.group_media import MEDIA_FIELDS, group_media_rows, pad_group_media, row_counts_key
from stage.finalize.media import StagedMedia, concat_media, trainer_media, validate_media
from stage.finalize.reasons import bucket_of
from stage.finalize.rollout import FinalizedRollout, RolloutFinalizer
from stage.finalize.source import (
    FetchedStagedCall,
    InMemoryTokenSource,
    StagedRow,
    TokenSource,
    TopK,
    staged_row_from_record,
)

# The finalizer: finalize_rollout and finalize_group on one object, as in NeMo RL.
Reassembler = GroupFinalizer

__all__ = [
    "MEDIA_FIELDS", "REJECTION_LOGGER", "CanonicalRow", "FetchedStagedCall", "FinalizedGroup",
    "FinalizedRollout", "GroupFinalizer", "InMemoryTokenSource", "ReassemblyConfig", "Reassembler",
    "RolloutFinalizer", "StagedMedia", "StagedRow", "TokenSource", "TopK", "bucket_of",
    "concat_media", "group_media_rows", "pad_group", "pad_group_media", "row_counts_key",
    "staged_row_from_record", "trainer_media", "validate_media",
]
