"""The ledger-load step: a newly assigned (or rewound) partition stays paused while its ledger
loads on a loader thread; once loaded it gets a fresh buffer that knows the groups already
published ahead of the committed offsets, and its dead-letter watermarks.

Touches, of the partition: ``epoch``, ``load``, ``buffer`` (with its spill store under this
replica's spill directory), ``dead_letter_marks`` and its LOADING pause. Uses: the loader pool, the ledger codec, the start offsets (forgotten at each
load: the fetch restarts from the committed offset), the stop event.
"""

from __future__ import annotations

import logging

from stage.buffer import PartitionBuffer
from stage.buffer.spill import SpillStore
from stage.runtime.ledger import LoadCancelled, load_ledger
from stage.runtime.pauses import LOADING

logger = logging.getLogger("stage.runtime.loop")

_RETRY_S = 2.0


class LedgerLoads:
    def __init__(self, cfg, *, pool, ledger_codec, partitions, pauses, clients, stop,
                 spill_root=None) -> None:
        self.cfg = cfg
        self.spill_root = spill_root     # Path of this replica's spill directory, or None
        self.pool = pool
        self.ledger_codec = ledger_codec
        self.partitions = partitions
        self.pauses = pauses
        self.clients = clients
        self.stop = stop                 # threading.Event: the stage is stopping

    @property
    def loading(self) -> list[int]:
        return [s.number for s in self.partitions if s.loading]

    def start(self, partition: int, delay_s: float = 0.0) -> None:
        """(Re)load ``partition``: a new epoch, no buffer until the ledger is read."""
        state = self.partitions.get(partition) or self.partitions.add(partition)
        self.pauses.adopt(partition, state.paused_for)
        state.epoch = epoch = self.partitions.next_epoch()
        state.release_buffer()
        self.pauses.hold(partition, LOADING)
        if self.clients.start_offsets is not None:
            for topic in (self.cfg.topics.receipts, self.cfg.topics.staged_calls):
                self.clients.start_offsets.forget(topic, partition)

        def stopped() -> bool:
            return self.stop.is_set() or self.partitions.current(partition, epoch) is None

        def load():
            if delay_s and self.stop.wait(delay_s):
                raise LoadCancelled()
            return load_ledger(self.cfg, self.ledger_codec, partition, should_stop=stopped)

        state.load = self.pool.submit(load)

    def finish(self) -> None:
        """Give every partition whose ledger has loaded its buffer, and let it fetch."""
        for state in list(self.partitions):
            future = state.load
            if future is None or not future.done():
                continue
            state.load = None
            try:
                ledger = future.result()
            except LoadCancelled:
                continue
            except Exception as error:  # noqa: BLE001 - broker trouble: keep the partition paused, retry
                logger.warning("loading the ledger of partition %d failed (%s: %s); retrying in %.0fs",
                               state.number, type(error).__name__, error, _RETRY_S)
                self.start(state.number, delay_s=_RETRY_S)
                continue
            self._loaded(state, ledger)

    def _loaded(self, state, ledger) -> None:
        topics = self.cfg.topics
        spill = None
        if self.spill_root is not None:
            spill = SpillStore(self.spill_root / f"partition-{state.number}-epoch-{state.epoch}",
                               max_bytes=self.cfg.max_spill_bytes)
        buffer = PartitionBuffer(state.number, receipts_topic=topics.receipts,
                                 staged_topic=topics.staged_calls,
                                 group_timeout_ms=self.cfg.group_timeout_ms,
                                 late_retention_ms=self.cfg.late_retention_ms, spill=spill)
        for group_id, entry in ledger.groups.items():
            buffer.load_published(group_id, {topics.receipts: entry["max_receipt_offset"],
                                             topics.staged_calls: entry["max_staged_offset"]},
                                  entry["published_at_ms"])
        state.buffer = buffer
        state.dead_letter_marks = {
            topics.receipts: ledger.dead_letter_offsets.get("receipts", -1),
            topics.staged_calls: ledger.dead_letter_offsets.get("staged_calls", -1)}
        self.pauses.release(state.number, LOADING)
        logger.info("partition %d ready: %d published groups in its ledger, dead letters up to "
                    "offsets %s", state.number, len(ledger.groups), ledger.dead_letter_offsets or "none")
