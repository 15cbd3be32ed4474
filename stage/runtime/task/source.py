"""TokenSource over a group's buffered StagedCall records (finalization reads from here).

The first fetch converts every record of the group together (``staged_rows``: one pass
validates their snapshots and call digests: a dozen numpy calls per group instead of per
rollout, issue 31); a row that pass produced is handed out when its key is first fetched. A
fetch then converts its keys that pass did not produce together, then each key in order through
``staged_row`` unless a pass already produced its row, so errors are those of converting one at
a time. The pass's packed columns are kept: ``packed_rows`` hands a rollout's rows of them to
the verifier, which then does not pack them again."""

from __future__ import annotations

from stage.buffer import StagedItem
from stage.contract.packed import PackedRows
from stage.decode import InputLimits, release_routes, staged_row
from stage.decode.route_chunks import join_route_chunks
from stage.decode.staged_batch import staged_rows
from stage.finalize import FetchedStagedCall
from stage.staging import StagedMedia, StagedRow
from stage.finalize.source import fetched_from_rows


class BufferTokenSource:
    """Rows are converted (and validated, digests included) on first fetch, off the poll thread.
    A record the buffer spilled to disk (stage.buffer.spill) is read back and decoded by
    ``load`` first, as the intake decoded it."""

    validates_snapshots = True

    def __init__(self, staged: dict[str, StagedItem], *, partition_name: str,
                 limits: InputLimits = InputLimits(), load=None, routes=None) -> None:
        self.staged = staged
        self.partition_name = partition_name
        self.limits = limits
        self.load = load             # (SpilledRecord) -> the decoded record dict
        self.routes = routes         # RouteChunks (direct router replay), else None
        self._rows: dict[str, StagedRow] = {}
        self._failed: dict[str, Exception] = {}   # joins that failed in a batch, raised in key order
        # the group-wide pass's outcomes, not fetched yet: a rollout that is never fetched (its
        # receipt refused first) must not show its rows in ``converted`` (the group's plans)
        self._ready: dict[str, StagedRow | Exception] | None = None
        # staging key -> (the pack its row was checked on, its index there): ``packed_rows``
        self._packed: dict[str, tuple] = {}

    def _payload(self, item: StagedItem):
        if item.spilled and self.load is not None:
            return self.load(item.payload)
        return item.payload

    def _row(self, key: str) -> StagedRow | None:
        if key in self._rows:
            return self._rows[key]
        if key in self._failed:
            raise self._failed[key]
        item = self.staged.get(key)
        if item is None:
            return None
        payload = self._payload(item)
        row = self._joined(staged_row(payload, self.limits,  # ValueError -> invalid_staging_row
                                      partition=item.position.partition), payload)
        self._rows[key] = row
        return row

    def _joined(self, row: StagedRow, record: dict) -> StagedRow:
        """Direct router replay: a row staged by reference gets its routes from its chunks
        (KeyError: a chunk was not read; ValueError: one is not what the reference says)."""
        if self.routes is None:
            return row
        return self.routes.join(row)

    def _convert_together(self, keys) -> None:
        if self._ready is None:
            self._ready = self._convert_group()
        for key in keys:   # what the group-wide pass produced for these keys, now fetched
            outcome = self._ready.pop(key, None)
            if isinstance(outcome, StagedRow):
                self._rows[key] = outcome
            elif outcome is not None:
                self._failed[key] = outcome
        todo = [k for k in keys if k not in self._rows and k not in self._failed and k in self.staged]
        if len(todo) < 2:
            return
        items = [self.staged[k] for k in todo]
        payloads = [self._payload(i) for i in items]
        self._store(todo, items, payloads, self._rows, self._failed)

    def _store(self, keys, items, payloads, rows: dict, failed: dict) -> None:
        """``staged_rows`` of ``payloads``: each row produced into ``rows``, each failed join
        (raised when its key is fetched) into ``failed``; a row not produced is left out."""
        packing: dict = {}
        made = staged_rows(payloads, self.limits, partitions=[i.position.partition for i in items],
                           packing=packing)
        packed, indices = packing.get("packed"), packing.get("rows") or [None] * len(made)
        for key, row, payload, index in zip(keys, made, payloads, indices):
            if row is None:
                continue
            try:
                rows[key] = self._joined(row, payload)
            except (KeyError, TypeError, ValueError) as error:
                failed[key] = error
                continue
            if packed is not None and index is not None:
                self._packed[key] = (packed, index)

    def _convert_group(self) -> dict:
        """Every record of the group in one ``staged_rows`` pass (an accelerator only: whatever it
        does not produce, or cannot read, is converted per fetch as before, raising there)."""
        keys, items, payloads = [], [], []
        for key, item in self.staged.items():
            try:
                payload = self._payload(item)
            except Exception:   # noqa: BLE001 - a spilled record that cannot be read back fails
                continue        # when (and if) its own rollout fetches it, not another's
            keys.append(key)
            items.append(item)
            payloads.append(payload)
        rows: dict = {}
        if len(keys) >= 2:
            self._store(keys, items, payloads, rows, rows)
        return rows

    def fetch_for_finalization(self, staging_keys, *, include_route_fragments=False,
                               include_topk=False) -> list[FetchedStagedCall]:
        keys = list(staging_keys)
        if not keys:
            return []
        if len(set(keys)) != len(keys):
            raise KeyError("finalization staging request contains duplicate keys")
        self._convert_together(keys)
        return fetched_from_rows(keys, [self._row(k) for k in keys], where=self.partition_name,
                                 include_route_fragments=include_route_fragments,
                                 include_topk=include_topk)

    def packed_rows(self, staging_keys) -> PackedRows | None:
        """The packed columns of these keys' rows, in this order, when one group pass produced
        them all (verify_and_linearize checks that they are the rows it is given)."""
        found = [self._packed.get(key) for key in staging_keys]
        if not found or None in found or len({id(pack) for pack, _ in found}) != 1:
            return None
        return found[0][0].select([index for _, index in found])

    def converted(self) -> dict[str, StagedRow]:
        """The rows converted so far, by staging key (what the group's plans are built from)."""
        return dict(self._rows)

    def fetch_media(self, staging_keys) -> list[StagedMedia]:
        out = []
        for key in staging_keys:
            row = self._row(key)
            if row is None or row.media is None:
                raise KeyError(f"staged media missing for {key}")
            out.append(row.media)
        return out


class RouteChunks:
    """A group's buffered route chunks (direct router replay) and where they were read from;
    ``load`` reads a spilled chunk back (stage.buffer.spill)."""

    def __init__(self, chunks: dict, *, group_id: str, topic: str, partition: int, load=None) -> None:
        self.chunks, self.group_id, self.topic, self.partition = chunks, group_id, topic, partition
        self.load = load

    def join(self, row: StagedRow) -> StagedRow:
        return join_route_chunks(row, self.chunks, group_id=self.group_id, topic=self.topic,
                                 partition=self.partition, load=self.load)


def chunk_loader(codec):
    """Read a spilled RouteChunk back and decode it (``codec``: the RouteChunk codec)."""
    def load(ref):
        if codec is None:
            raise ValueError("a spilled route chunk, and no RouteChunk codec to read it")
        return codec.decode(ref.read())
    return load


def spilled_loader(codec, *, keep_routes: bool, limits: InputLimits = InputLimits()):
    """Read a spilled record back and decode it as the intake did (route payloads released
    where the stage never reads them). ``codec``: the StagedCall codec (None where nothing
    was spilled, e.g. a group finalized outside the runtime)."""
    def load(ref):
        if codec is None:
            raise ValueError("a spilled staged record, and no StagedCall codec to read it")
        record = codec.decode(ref.read())
        if not keep_routes:
            release_routes(record, limits)
        return record
    return load
