"""What the buffer holds: decoded input records with the Kafka position they came from.

Offsets travel with the data they cover, so the buffer alone can say which input offsets an
unpublished group still needs. The payloads are opaque here: validation happens at
finalization, off the poll thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Position:
    topic: str
    partition: int
    offset: int
    timestamp_ms: int


@dataclass(eq=False)
class ReceiptItem:
    """One ReceiptEvent. ``receipt`` is Gym's RolloutReceipt JSON form or None (missing)."""

    group_id: str
    rollout_id: str
    rollout_index: int
    group_size: int
    prompt_idx: int
    reward: float
    receipt: dict | None
    position: Position
    nbytes: int
    mask_sample: bool = False
    loss_multiplier: float = 1.0
    fallback_weight_version: int = 0
    canonical_sample_id: str | None = None
    labels: tuple = ()
    result_stats: tuple = ()

    @property
    def staging_keys(self) -> tuple[str, ...]:
        """Keys the manifest names (empty for a missing or structurally unusable receipt)."""
        manifest = self.receipt.get("manifest") if isinstance(self.receipt, dict) else None
        if not isinstance(manifest, list):
            return ()
        return tuple(row["staging_key"] for row in manifest
                     if isinstance(row, dict) and isinstance(row.get("staging_key"), str))


@dataclass(eq=False)
class StagedItem:
    """One StagedCall; ``payload`` is whatever the decoder produced (kept opaque)."""

    group_id: str
    staging_key: str
    payload: Any
    position: Position
    nbytes: int
    extra: dict = field(default_factory=dict)
    # (field names, values) taken at decode: what a second record under this staging_key is
    # compared with (stage.buffer.duplicates); kept apart from the payload, so it survives a
    # payload the buffer no longer holds whole. () when none was taken. Once spilled, its large
    # values are digests (stage.buffer.digests): it holds no bytes of the record.
    fingerprint: tuple = ()
    # Bytes of its record on local disk once spilled (stage.buffer.spill; the payload is then a
    # SpilledRecord the finalize step reads back), 0 while it is held in memory.
    spilled: int = 0
    # Once spilled: the token and route tensors' digests by column (None: the record had none
    # or released it), what a second copy's tensors are compared with.
    tensors: dict | None = None
    # Direct router replay: the RouteReference of routes staged by reference (routes_ref),
    # checked at intake; the group waits for the chunks it names. None: inline or no routes.
    route_ref: Any = None

    def route_keys(self) -> tuple[tuple[str, int], ...]:
        """The (staging_key, offset) of every route chunk its reference names."""
        if self.route_ref is None:
            return ()
        return tuple((self.staging_key, c.offset) for c in self.route_ref.chunks)


@dataclass(eq=False)
class RouteChunkItem:
    """One RouteChunk (direct router replay): a piece of a staged call's route payload,
    buffered in its group under (staging_key, its offset). ``payload`` is the decoded record,
    or once spilled the SpilledRecord of its bytes."""

    group_id: str
    staging_key: str
    index: int
    count: int
    payload: Any
    position: Position
    nbytes: int
    spilled: int = 0        # bytes of its record on local disk once spilled

    @property
    def key(self) -> tuple[str, int]:
        return (self.staging_key, self.position.offset)
