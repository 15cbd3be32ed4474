"""TokenSource over a group's buffered StagedCall records (finalization reads from here).

A fetch converts the records it has not converted yet together (``staged_rows``: one pass
validates their snapshots and call digests), then each key in order through ``staged_row``
unless that pass already produced its row, so errors are those of converting one at a time."""

from __future__ import annotations

from stage.buffer import StagedItem
from stage.decode import InputLimits, release_routes, staged_row
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
                 limits: InputLimits = InputLimits(), load=None) -> None:
        self.staged = staged
        self.partition_name = partition_name
        self.limits = limits
        self.load = load             # (SpilledRecord) -> the decoded record dict
        self._rows: dict[str, StagedRow] = {}

    def _payload(self, item: StagedItem):
        if item.spilled and self.load is not None:
            return self.load(item.payload)
        return item.payload

    def _row(self, key: str) -> StagedRow | None:
        if key in self._rows:
            return self._rows[key]
        item = self.staged.get(key)
        if item is None:
            return None
        row = staged_row(self._payload(item), self.limits,  # ValueError -> invalid_staging_row
                         partition=item.position.partition)
        self._rows[key] = row
        return row

    def _convert_together(self, keys) -> None:
        todo = [k for k in keys if k not in self._rows and k in self.staged]
        if len(todo) < 2:
            return
        items = [self.staged[k] for k in todo]
        for key, row in zip(todo, staged_rows([self._payload(i) for i in items], self.limits,
                                              partitions=[i.position.partition for i in items])):
            if row is not None:
                self._rows[key] = row

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
