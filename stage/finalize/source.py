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

from stage.contract import StagedCallBaseSnapshot, StagedCallRecord, decode_routed_experts
from stage.finalize.media import StagedMedia
from stage.routes import (
    ROUTE_ENCODING_ENVELOPE,
    ROUTE_ENCODING_LIST,
    ROUTE_ENCODING_NONE,
    ROUTED_EXPERTS_BOUNDARY_FIELD,
    ROUTED_EXPERTS_FIELD,
    RouteFragment,
    encode_extras_metadata_json,
)
from stage.routes.fragment import metadata_boundary_index, parse_extras_metadata, readonly_tensor


@dataclass(frozen=True, eq=False)
class TopK:
    ids: np.ndarray        # int32 [generation_len, k]
    logprobs: np.ndarray   # float32 [generation_len, k]


@dataclass(frozen=True, eq=False)
class StagedRow:
    """One call as staged (the stage's storage form of a StagedCallRecord)."""

    snapshot: StagedCallBaseSnapshot
    route_encoding: int = ROUTE_ENCODING_NONE
    routes: np.ndarray | None = None            # [delta_len, L, K], staged dtype
    boundary_routes: np.ndarray | None = None   # [1, L, K]
    extras_metadata_json: bytes = b"null"
    media: StagedMedia | None = None
    topk: TopK | None = None
    # The route payload was released at intake (a stage that never reads it): its row count.
    released_route_len: int | None = None

    @property
    def staging_key(self) -> str:
        return self.snapshot.staging_key

    @property
    def routed_len(self) -> int:
        if self.released_route_len is not None:
            return self.released_route_len
        return 0 if self.routes is None else int(self.routes.shape[0])

    def fragment(self) -> RouteFragment | None:
        if self.route_encoding == ROUTE_ENCODING_NONE:
            return None
        if self.released_route_len is not None:
            raise KeyError("staged row's route payload was released at intake (this stage "
                           "keeps no route payloads: deferred router replay or none)")
        if self.routes is None:
            raise KeyError("staged row metadata names routed_experts but its field is absent")
        # views, no copy: staged arrays are read-only views of the wire buffer, which the
        # integrity check and the executor only read
        boundary = None if self.boundary_routes is None else readonly_tensor(self.boundary_routes)
        return RouteFragment(routes=readonly_tensor(self.routes), encoding=self.route_encoding,
                             extras_metadata_json=self.extras_metadata_json,
                             boundary_routes=boundary)

    def boundary_token_index(self) -> int | None:
        return metadata_boundary_index(parse_extras_metadata(self.extras_metadata_json))


def staged_row_from_record(record: StagedCallRecord, *, media: StagedMedia | None = None,
                           topk: TopK | None = None) -> StagedRow:
    """Split a validated StagedCallRecord the way the staging sink stores it.

    Routes must already be delta-aligned (one row per delta token), else ValueError.
    """
    extras = record.extras
    encoding, routes, boundary = ROUTE_ENCODING_NONE, None, None
    if extras is not None and ROUTED_EXPERTS_FIELD in extras:
        payload = extras[ROUTED_EXPERTS_FIELD]
        fragment = decode_routed_experts(payload)
        if isinstance(payload, str):
            encoding, routes = ROUTE_ENCODING_ENVELOPE, np.array(fragment.values)
        else:  # legacy nested list: staged as int16, digest recomputed over tolist()
            encoding, routes = ROUTE_ENCODING_LIST, fragment.values.astype(np.int16)
        if routes.ndim != 3 or routes.shape[0] != record.delta_len:
            raise ValueError(f"routed_experts must already be delta-aligned: got shape "
                             f"{tuple(routes.shape)} for delta_len={record.delta_len}")
    if extras is not None and ROUTED_EXPERTS_BOUNDARY_FIELD in extras:
        boundary = np.array(decode_routed_experts(extras[ROUTED_EXPERTS_BOUNDARY_FIELD]).values)
        if boundary.shape[0] != 1:
            raise ValueError(f"routed_experts_boundary must be one token row, got {boundary.shape}")
    return StagedRow(snapshot=record.base_snapshot(), route_encoding=encoding, routes=routes,
                     boundary_routes=boundary, extras_metadata_json=encode_extras_metadata_json(extras),
                     media=media, topk=topk)


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
