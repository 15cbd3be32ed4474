"""The ledger-load step: a newly assigned (or rewound) partition is not fetched while its ledger
loads on a loader thread (its state's ``load`` is the LOADING pause); once loaded it gets a
fresh buffer that knows the groups already published ahead of the committed offsets, and its
dead-letter marks.

Writes, of the partition: ``epoch``, ``load``, ``buffer`` (with its spill store under this
replica's spill directory) and ``dead_letter_marks``. Uses: the loader pool, the ledger codec,
the start offsets (forgotten at each load: the fetch restarts from the committed offset), the
stop event.
"""

from __future__ import annotations

import logging

from stage.buffer import PartitionBuffer
from stage.buffer.spill import SpillStore
from stage.runtime.kafka.ledger import LoadCancelled, load_ledger
from stage.runtime.state.inputs import STAGED_ROUTES, input_kinds
from stage.runtime.state.partition import DeadLetterMarks

logger = logging.getLogger("stage.runtime.loop")

_RETRY_S = 2.0


class LedgerLoads:
    def __init__(self, cfg, *, pool, ledger_codec, partitions, clients, stop,
                 spill_root=None) -> None:
        self.cfg = cfg
        self.spill_root = spill_root     # Path of this replica's spill directory, or None
        self.pool = pool
        self.ledger_codec = ledger_codec
        self.partitions = partitions
        self.clients = clients           # start offsets, read at call time
        self.stop = stop                 # threading.Event: the stage is stopping

    @property
    def loading(self) -> list[int]:
        return [s.number for s in self.partitions if s.loading]

    def start(self, partition: int, delay_s: float = 0.0) -> None:
        """(Re)load ``partition`` (assigned already): a new epoch, no buffer until the ledger
        is read."""
        state = self.partitions.get(partition)
        state.epoch = epoch = self.partitions.next_epoch()
        state.close()
        if self.clients.start_offsets is not None:
            for kind in input_kinds(self.cfg):
                self.clients.start_offsets.forget(kind.topic(self.cfg.topics), partition)

        def stopped() -> bool:
            return self.stop.is_set() or self.partitions.current(partition, epoch) is None

        def load():
            if delay_s and self.stop.wait(delay_s):
                raise LoadCancelled()
            return load_ledger(self.cfg, self.ledger_codec, partition, should_stop=stopped)

        state.load = self.pool.submit(load)

    def finish(self) -> list[int]:
        """Give every partition whose ledger has loaded its buffer; the partitions now ready."""
        ready = []
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
            ready.append(state.number)
        return ready

    def _loaded(self, state, ledger) -> None:
        topics, kinds = self.cfg.topics, input_kinds(self.cfg)
        spill = None
        if self.spill_root is not None:
            spill = SpillStore(self.spill_root / f"partition-{state.number}-epoch-{state.epoch}",
                               max_bytes=self.cfg.max_spill_bytes)
        buffer = PartitionBuffer(state.number, receipts_topic=topics.receipts,
                                 staged_topic=topics.staged_calls,
                                 group_timeout_ms=self.cfg.group_timeout_ms,
                                 late_retention_ms=self.cfg.late_retention_ms, spill=spill,
                                 routes_topic=topics.staged_routes if STAGED_ROUTES in kinds else None)
        for group_id, entry in ledger.groups.items():
            # an entry written before the route input existed has no max_route_offset: -1
            buffer.load_published(group_id, {kind.topic(topics): entry.get(kind.ledger_field, -1)
                                             for kind in kinds}, entry["published_at_ms"])
        state.buffer = buffer
        state.dead_letter_marks = DeadLetterMarks({
            kind.topic(topics): ledger.dead_letter_offsets.get(kind.role, -1) for kind in kinds})
        logger.info("partition %d ready: %d published groups in its ledger, dead letters up to "
                    "offsets %s", state.number, len(ledger.groups), ledger.dead_letter_offsets or "none")
