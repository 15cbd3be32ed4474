"""TokenSource over a group's buffered StagedCall records (finalization reads from here).

A fetch converts the records it has not converted yet together (``staged_rows``: one pass
validates their snapshots and call digests), then each key in order through ``staged_row``
unless that pass already produced its row, so errors are those of converting one at a time."""

from __future__ import annotations

from stage.buffer import StagedItem
from stage.decode import InputLimits, staged_row
from stage.decode.staged_batch import staged_rows
from stage.finalize import FetchedStagedCall, StagedMedia, StagedRow
from stage.finalize.source import fetched_from_rows


class BufferTokenSource:
    """Rows are converted (and validated, digests included) on first fetch, off the poll thread."""

    validates_snapshots = True

    def __init__(self, staged: dict[str, StagedItem], *, partition_name: str,
                 limits: InputLimits = InputLimits()) -> None:
        self.staged = staged
        self.partition_name = partition_name
        self.limits = limits
        self._rows: dict[str, StagedRow] = {}

    def _row(self, key: str) -> StagedRow | None:
        if key in self._rows:
            return self._rows[key]
        item = self.staged.get(key)
        if item is None:
            return None
        row = staged_row(item.payload, self.limits)  # ValueError -> invalid_staging_row
        self._rows[key] = row
        return row

    def _convert_together(self, keys) -> None:
        todo = [k for k in keys if k not in self._rows and k in self.staged]
        if len(todo) < 2:
            return
        for key, row in zip(todo, staged_rows([self.staged[k].payload for k in todo], self.limits)):
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

    def fetch_media(self, staging_keys) -> list[StagedMedia]:
        out = []
        for key in staging_keys:
            row = self._row(key)
            if row is None or row.media is None:
                raise KeyError(f"staged media missing for {key}")
            out.append(row.media)
        return out
