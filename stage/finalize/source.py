"""Where finalization reads staged rows: the ``TokenSource`` interface and an in-memory one.

A staged row is what an inference worker staged for one call, as the stage stores it: the base
snapshot (token columns + metadata), the route fragment split out of the extras (tensor in its
staged dtype, its encoding, the remaining extras as canonical JSON), the optional boundary
route, media and sampler top-k. The Kafka runtime implements TokenSource over its buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from stage.contract import StagedCallBaseSnapshot
from stage.routes import RouteFragment
from stage.staging import StagedMedia, StagedRow, TopK, staged_row_from_record  # noqa: F401 - re-exported


@dataclass(frozen=True, eq=False)
class FetchedStagedCall:
    """One row as finalization sees it (NeMo RL's FetchedStagedCall)."""

    staging_key: str
    snapshot: StagedCallBaseSnapshot
    routed_len: int
    fragment: RouteFragment | None
    media_present: bool
    media_has_frames: bool
    topk: TopK | None
    boundary_token_index: int | None


class TokenSource(Protocol):
    """Batched reads of staged rows by staging key."""

    def fetch_for_finalization(self, staging_keys: Sequence[str], *,
                               include_route_fragments: bool = False,
                               include_topk: bool = False) -> list[FetchedStagedCall]:
        """Exactly one row per key, in order. KeyError when rows are missing; ValueError or
        TypeError when a row is malformed."""

    def fetch_media(self, staging_keys: Sequence[str]) -> list[StagedMedia]:
        """Media of rows whose media_present is true, in order."""


def fetched_from_rows(keys: Sequence[str], rows: Sequence[StagedRow | None], *, where: str,
                      include_route_fragments: bool, include_topk: bool) -> list[FetchedStagedCall]:
    """Shared fetch semantics: duplicates, missing rows, identity, optional columns."""
    if len(set(keys)) != len(keys):
        raise KeyError("finalization staging request contains duplicate keys")
    present = [row for row in rows if row is not None]
    if len(present) != len(keys):
        raise KeyError(f"staged rows missing: requested {len(keys)} keys from {where!r}, "
                       f"got {len(present)} rows")
    out = []
    for key, row in zip(keys, rows):
        if row.staging_key != key:
            raise KeyError(f"staged row identity mismatch: requested {key}, got {row.staging_key}")
        if include_topk and row.topk is None:
            raise KeyError(f"staged row {key} has no generation top-k columns")
        out.append(FetchedStagedCall(
            staging_key=key, snapshot=row.snapshot, routed_len=row.routed_len,
            fragment=row.fragment() if include_route_fragments else None,
            media_present=row.media is not None,
            media_has_frames=row.media is not None and row.media.has_frames,
            topk=row.topk if include_topk else None,
            boundary_token_index=row.boundary_token_index()))
    return out


class InMemoryTokenSource:
    """A dict of staged rows; the test double and the reference semantics."""

    def __init__(self, partition: str = "staging") -> None:
        self.partition = partition
        self.rows: dict[str, StagedRow] = {}
        self.fetches = 0

    def put(self, row: StagedRow) -> None:
        self.rows[row.staging_key] = row

    def stage(self, record: StagedCallRecord, *, media: StagedMedia | None = None,
              topk: TopK | None = None) -> str:
        row = staged_row_from_record(record, media=media, topk=topk)
        self.put(row)
        return row.staging_key

    def fetch_for_finalization(self, staging_keys, *, include_route_fragments=False,
                               include_topk=False) -> list[FetchedStagedCall]:
        keys = list(staging_keys)
        if not keys:
            return []
        self.fetches += 1
        return fetched_from_rows(keys, [self.rows.get(k) for k in keys], where=self.partition,
                                 include_route_fragments=include_route_fragments,
                                 include_topk=include_topk)

    def fetch_media(self, staging_keys) -> list[StagedMedia]:
        out = []
        for key in staging_keys:
            row = self.rows.get(key)
            if row is None or row.media is None:
                raise KeyError(f"staged media missing for {key}")
            out.append(row.media)
        return out

    def clear(self, staging_keys) -> None:
        for key in staging_keys:
            self.rows.pop(key, None)
