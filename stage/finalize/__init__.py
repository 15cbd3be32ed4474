"""Rollout and group finalization (NeMo RL's reassembler semantics). No Kafka imports.

decode happens upstream; here: fetch staged rows -> verify (stage.contract) -> build exactly
N canonical rows, route plans and metrics. Names are imported from their modules on first use
(stage.lazy_exports): the settings model (ReassemblyConfig) needs no torch.
"""

from stage import lazy_exports
from stage.config.finalize import ReassemblyConfig

__getattr__, __dir__ = lazy_exports(__name__, globals(), {
    "group": ("REJECTION_LOGGER", "CanonicalRow", "FinalizedGroup", "GroupFinalizer", "pad_group"),
    "group_media": ("MEDIA_FIELDS", "group_media_rows", "pad_group_media", "row_counts_key"),
    "media": ("StagedMedia", "concat_media", "trainer_media", "validate_media"),
    "reasons": ("bucket_of",),
    "rollout": ("FinalizedRollout", "RolloutFinalizer"),
    "source": ("FetchedStagedCall", "InMemoryTokenSource", "StagedRow", "TokenSource", "TopK",
               "staged_row_from_record"),
}, aliases={
    # The finalizer: finalize_rollout and finalize_group on one object, as in NeMo RL.
    "Reassembler": "GroupFinalizer",
})

__all__ = [
    "MEDIA_FIELDS", "REJECTION_LOGGER", "CanonicalRow", "FetchedStagedCall", "FinalizedGroup",
    "FinalizedRollout", "GroupFinalizer", "InMemoryTokenSource", "ReassemblyConfig", "Reassembler",
    "RolloutFinalizer", "StagedMedia", "StagedRow", "TokenSource", "TopK", "bucket_of",
    "concat_media", "group_media_rows", "pad_group", "pad_group_media", "row_counts_key",
    "staged_row_from_record", "trainer_media", "validate_media",
]
