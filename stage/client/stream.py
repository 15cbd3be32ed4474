"""The Kafka-free core of ``CanonicalReader``: decoded records in, complete groups out, in the
order they complete, each handed out at most once, with the position that proves it.

``GroupStream`` ties together the ``GroupAssembler`` (join by group id, de-duplicate), the
``PositionTracker`` (offsets of everything read, waiting and handed out) and the staleness
check. ``CanonicalReader`` feeds it from Kafka; tests feed it directly.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Mapping

from stage.client.assembly import GroupAssembler, TrainingGroup
from stage.client.position import TP, PositionTracker, ReadPosition
from stage.client.staleness import HOLD, Staleness

logger = logging.getLogger("stage.client.reader")

DEFAULT_MAX_PENDING_RECORDS = 10_000
DEFAULT_REMEMBER_RECORDS = 2_000
_PRUNE_EVERY = 64   # batches between prunes of the tracker when nobody asks for a position


class GroupStream:
    """``offer`` records (in partition order), ``next_group`` hands out the complete ones.

    ``max_pending_records``: an incomplete group whose first record is this many records behind
    its partition's read position is given up (logged, counted ``abandoned``) so it cannot hold
    the position back forever; the stage publishes a group's rows in one transaction, so only
    broken input leaves a group incomplete that long. ``remember_records``: the position names
    the groups handed out within this many records below its offsets (``stage.client.position``).
    """

    def __init__(self, *, with_plans: bool = False, device="cpu", staleness: Staleness | None = None,
                 max_pending_records: int = DEFAULT_MAX_PENDING_RECORDS,
                 remember_records: int = DEFAULT_REMEMBER_RECORDS) -> None:
        self.assembler = GroupAssembler(with_plans=with_plans, device=device)
        self.tracker = PositionTracker(remember_records)
        self.staleness = staleness
        self.weight_version: int | None = None
        self.max_pending_records = max_pending_records
        self.ready: deque[TrainingGroup] = deque()    # complete, not handed out yet
        self.held: list[TrainingGroup] = []           # stale, set aside (on_stale="hold")
        self._batches = 0

    @property
    def counts(self) -> Counter:
        return self.assembler.counts

    # -- intake ------------------------------------------------------------------------------
    def restore(self, position: ReadPosition) -> None:
        self.tracker.restore(position)
        self.assembler.mark_done(position.handed_out())

    def assigned(self, tp: TP, offset: int | None) -> None:
        self.tracker.assigned(tp, offset)

    def offer(self, kind: str, tp: TP, offset: int, record: Mapping | None, raw: bytes | None) -> None:
        """One record read at ``tp``/``offset``; ``record`` None: it did not decode (consumed,
        nothing to assemble)."""
        self.tracker.consumed(tp, offset)
        if record is None:
            return
        add = self.assembler.add_row if kind == "rows" else self.assembler.add_plan
        group = add(record, raw, (tp[0], tp[1], offset))
        if group is not None:
            self.tracker.wait(group.group_id, group.offsets)
            self.ready.append(group)
        elif self.assembler.last_done:
            self.tracker.extend(self.assembler.last_group, tp, offset)

    def end_batch(self) -> tuple[str, tuple[str, int, int], str] | None:
        """After a batch of ``offer``s: give up stuck groups; return the first complete group
        whose rows cannot be built (group id, (topic, partition, its lowest offset), error), or
        None. Such a group is never handed out nor given up: it keeps holding the position, and
        the caller stops (CanonicalReader raises UnreadableRecord)."""
        if self.assembler.unusable:
            group_id, offsets, error = self.assembler.unusable[0]
            self.assembler.unusable.clear()
            (topic, partition), (low, _high) = min(offsets.items(), key=lambda item: item[1][0],
                                                    default=(("?", -1), (-1, -1)))
            return group_id, (topic, partition, low), error
        for group_id, pending in list(self.assembler.pending.items()):
            for tp, (low, _) in pending.offsets.items():
                nxt = self.tracker.next.get(tp)
                if nxt is not None and nxt - low > self.max_pending_records:
                    self.tracker.finish(group_id, self.assembler.abandon(group_id))
                    logger.error("group %s abandoned incomplete: %d of %s rows (%d plans) held since "
                                 "%s[%d]@%d, now %d records behind", group_id, len(pending.rows),
                                 pending.group_size or "?", len(pending.plans), tp[0], tp[1], low, nxt - low)
                    break
        self._batches += 1
        if self._batches % _PRUNE_EVERY == 0:
            self.tracker.prune(self.assembler.lowest_pending_offsets())
        return None

    def forget(self, tps) -> None:
        """Partitions revoked from this reader: forget everything read from them."""
        gone = set(tps)
        self.tracker.forget(gone)
        self.assembler.forget(gone)
        self.ready = deque(g for g in self.ready if not gone & set(g.offsets))
        self.held = [g for g in self.held if not gone & set(g.offsets)]

    # -- hand-out ----------------------------------------------------------------------------
    def next_group(self) -> TrainingGroup | None:
        """The next complete group that passes the staleness check (it counts as handed out
        from now on), or None when none is ready. Stale groups are skipped or held, counted."""
        while self.ready:
            group = self.ready[0]
            fresh = self._fresh(group)        # may raise (no weight version): the group stays ready
            self.ready.popleft()
            if fresh:
                self.tracker.finish(group.group_id)
                self.counts["handed_out"] += 1
                return group
        return None

    def _fresh(self, group: TrainingGroup) -> bool:
        if self.staleness is None:
            return True
        reason = self.staleness.reason(group.group_min_wv, group.group_max_wv, self.weight_version,
                                       group.valid_rows > 0)
        if reason is None:
            return True
        hold = self.staleness.on_stale == HOLD
        logger.info("group %s %s: %s (weight versions %d..%d, policy at %s)", group.group_id,
                    "held" if hold else "skipped", reason, group.group_min_wv, group.group_max_wv,
                    self.weight_version)
        if hold:
            self.held.append(group)       # keeps holding the position until taken
        else:
            self.tracker.finish(group.group_id)
        return False

    def take_held(self) -> list[TrainingGroup]:
        """The stale groups set aside; they count as handed out from now on."""
        out, self.held = self.held, []
        for group in out:
            self.tracker.finish(group.group_id)
        return out

    # -- positions ---------------------------------------------------------------------------
    def resume_offsets(self) -> dict[TP, int | None]:
        return self.tracker.resume_offsets(self.assembler.lowest_pending_offsets())

    def position(self) -> ReadPosition:
        return self.tracker.position(self.assembler.lowest_pending_offsets())
