"""A staged call as the stage stores it (``StagedRow``): what the decoder produces from a
StagedCall record and finalization reads. The base snapshot (token columns + metadata), the
route fragment split out of the extras (tensor in its staged dtype, its encoding, the remaining
extras as canonical JSON), the optional boundary route, media and sampler top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stage.contract import StagedCallBaseSnapshot, StagedCallRecord, decode_routed_experts
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
from stage.staging.media import StagedMedia
from stage.staging.route_refs import RouteReference


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
    # The route payload was staged by reference (stage.staging.route_refs): where its chunks
    # are. ``routes`` is then None until a direct-mode stage joins the chunks; a deferred stage
    # never reads them and copies the reference into the row's plan.
    route_ref: RouteReference | None = None

    @property
    def staging_key(self) -> str:
        return self.snapshot.staging_key

    @property
    def routed_len(self) -> int:
        if self.released_route_len is not None:
            return self.released_route_len
        if self.routes is None and self.route_ref is not None:
            return self.route_ref.shape[0]
        return 0 if self.routes is None else int(self.routes.shape[0])

    def fragment(self) -> RouteFragment | None:
        if self.route_encoding == ROUTE_ENCODING_NONE:
            return None
        if self.released_route_len is not None:
            raise KeyError("staged row's route payload was released at intake (this stage "
                           "keeps no route payloads: deferred router replay or none)")
        if self.routes is None and self.route_ref is not None:
            raise KeyError(f"staged row {self.staging_key}'s routes are staged by reference and were not "
                           "joined from their chunks (direct router replay joins them at finalization)")
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
