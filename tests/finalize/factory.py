"""Test data for finalization: stage rollouts exactly as a Gym worker would.

Route payloads and digests are produced with the contract's own encoder
(``RolloutBuilder`` + ``encode_routed_experts``), independently of the code under test.
The golden example is the spec's §8.5 ``worked_example``: c1 tokens [10,11,12,13] mask
[0,0,1,1] logprobs [0,0,-0.1,-0.2]; c2 [20,21,22] mask [0,1,1] logprobs [0,-0.3,-0.4].
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from stage.contract import encode_routed_experts
from stage.contract.producer import RolloutBuilder, StagedCall
from stage.finalize import InMemoryTokenSource, StagedMedia, TopK
from stage.routes import (
    ROUTED_EXPERTS_BOUNDARY_FIELD,
    ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD,
    ROUTED_EXPERTS_FIELD,
)

PAD = 0
L, K = 2, 2
TOPK = 3
PATCH = 2                       # media patch size used by media tests
GOLDEN_TOKENS = [10, 11, 12, 13, 20, 21, 22]
GOLDEN_MASK = [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
GOLDEN_LOGPROBS = [0.0, 0.0, -0.1, -0.2, 0.0, -0.3, -0.4]


def route_values(call: int, rows: int, *, layers: int = L, topk: int = K, small: bool = False) -> np.ndarray:
    """Distinct route values per (call, position): ``call*1000 + pos`` (int16-sized) or a
    small int8-sized variant. Every entry of one token row is distinct from other rows."""
    pos = np.arange(rows * layers * topk).reshape(rows, layers, topk)
    base = call * 20 if small else call * 1000
    return (base + pos).astype(np.int64)


def boundary_values(call: int, *, layers: int = L, topk: int = K, sentinel: bool = False,
                    small: bool = False) -> np.ndarray:
    if sentinel:
        return np.full((1, layers, topk), -1, dtype=np.int64)
    return (np.arange(layers * topk).reshape(1, layers, topk) + (100 + call * 4 if small else call * 1000 + 500)
            ).astype(np.int64)


def route_extras(values: np.ndarray, *, dtype: str = "int16", boundary: np.ndarray | None = None,
                 boundary_index: int | None = None, legacy_list: bool = False, **more) -> dict:
    extras = dict(more)
    extras[ROUTED_EXPERTS_FIELD] = values.tolist() if legacy_list else encode_routed_experts(values, dtype=dtype)
    if boundary is not None:
        extras[ROUTED_EXPERTS_BOUNDARY_FIELD] = encode_routed_experts(boundary, dtype=dtype)
    if boundary_index is not None:
        extras[ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD] = boundary_index
    return extras


@dataclass
class CallSpec:
    call_id: str
    parent: str | None
    prompt: list[int]
    generated: list[int]
    logprobs: list[float] | None = None
    weight_version: int = 4
    extras: dict | None = None
    media: StagedMedia | None = None
    topk: TopK | None = None
    staging_key: str | None = None
    stage: bool = True           # False: in the manifest but never staged (ghost row)

    def lps(self) -> list[float]:
        if self.logprobs is not None:
            return self.logprobs
        return [-0.5 - 0.01 * i for i in range(len(self.generated))]


@dataclass
class Staged:
    rollout_id: str
    builder: RolloutBuilder
    calls: dict[str, StagedCall]
    terminal: str
    selection: str | None = "declared"
    order: list[str] | None = None

    @property
    def keys(self) -> list[str]:
        order = self.order or list(self.calls)
        return [self.calls[c].manifest_row.staging_key for c in order]

    def receipt(self):
        return self.builder.receipt(self.terminal, order=self.order,
                                    terminal_selection=self.selection or "declared")

    def receipt_json(self, **overrides) -> dict:
        """The receipt as Gym's JSON dict; ``overrides`` replace top-level fields."""
        data = self.receipt().to_json()
        data.update(overrides)
        return data


def stage_rollout(source: InMemoryTokenSource | None, rollout_id: str, specs: list[CallSpec], *,
                  terminal: str | None = None, selection: str = "declared",
                  order: list[str] | None = None) -> Staged:
    builder = RolloutBuilder(rollout_id)
    calls: dict[str, StagedCall] = {}
    for spec in specs:
        staged = builder.stage(spec.call_id, parent_call_id=spec.parent, prompt_delta=spec.prompt,
                               generated=spec.generated, generated_logprobs=spec.lps(),
                               weight_version=spec.weight_version, extras=spec.extras,
                               staging_key=spec.staging_key)
        calls[spec.call_id] = staged
        if source is not None and spec.stage:
            source.stage(staged.record, media=spec.media, topk=spec.topk)
    return Staged(rollout_id, builder, calls, terminal or specs[-1].call_id, selection, order)


def golden_specs(*, wv2: int = 4, routes: str | None = None, boundary: str | None = None,
                 topk: bool = False, small: bool = False) -> list[CallSpec]:
    """The worked example. ``routes``: staged dtype ("int8"/"int16"/"int32"/"list") or None;
    ``boundary``: None (legacy), "real" or "sentinel" (child's prefill route of token 3)."""
    c1 = CallSpec("c1", None, [10, 11], [12, 13], [-0.1, -0.2], weight_version=4)
    c2 = CallSpec("c2", "c1", [20], [21, 22], [-0.3, -0.4], weight_version=wv2)
    if routes is not None:
        dtype = "int16" if routes == "list" else routes
        legacy = routes == "list"
        c1.extras = route_extras(route_values(1, 4, small=small), dtype=dtype, legacy_list=legacy)
        kw = {}
        if boundary is not None:
            kw = dict(boundary=boundary_values(2, sentinel=boundary == "sentinel", small=small),
                      boundary_index=3)
        c2.extras = route_extras(route_values(2, 3, small=small), dtype=dtype, legacy_list=legacy, **kw)
    if topk:
        c1.topk = topk_for(1, 2)
        c2.topk = topk_for(2, 2)
    return [c1, c2]


def topk_for(call: int, gen: int, k: int = TOPK) -> TopK:
    ids = (np.arange(gen * k).reshape(gen, k) + 100 * call + 1).astype(np.int32)
    lps = -(np.arange(gen * k).reshape(gen, k) + 1).astype(np.float32) / 8.0 - call
    return TopK(ids=ids, logprobs=lps)


def image(patches: int = 2, *, dtype=np.float32, value: float = 0.5) -> StagedMedia:
    """``patches`` square PATCHxPATCH RGB patches as one still image of 2 x (2*patches) pixels."""
    imgs = np.full((1, patches, 3 * PATCH * PATCH), value, dtype=dtype)
    return StagedMedia(imgs=imgs, imgs_sizes=np.array([[PATCH, PATCH * patches]], dtype=np.int32))


def video(frames: int = 2, *, dtype=np.float32, value: float = 0.25) -> StagedMedia:
    imgs = np.full((1, frames, 3 * PATCH * PATCH), value, dtype=dtype)
    sizes = np.array([[PATCH, PATCH]] * frames, dtype=np.int32)
    return StagedMedia(imgs=imgs, imgs_sizes=sizes, num_frames=np.array([frames], dtype=np.int32))


def tamper_row(source: InMemoryTokenSource, key: str, **changes) -> None:
    """Replace fields of a staged row in place (what a corrupted transport would hand back)."""
    source.rows[key] = replace(source.rows[key], **changes)


class SpySource:
    """A TokenSource that records every call and can rewrite fetched items."""

    def __init__(self, inner: InMemoryTokenSource, rewrite=None) -> None:
        self.inner = inner
        self.rewrite = rewrite
        self.fetch_calls: list[tuple[list[str], dict]] = []
        self.media_calls: list[list[str]] = []

    @property
    def rows(self):
        return self.inner.rows

    def fetch_for_finalization(self, staging_keys, **kwargs):
        self.fetch_calls.append((list(staging_keys), dict(kwargs)))
        items = self.inner.fetch_for_finalization(staging_keys, **kwargs)
        return self.rewrite(items) if self.rewrite else items

    def fetch_media(self, staging_keys):
        self.media_calls.append(list(staging_keys))
        return self.inner.fetch_media(staging_keys)


@dataclass
class Group:
    """Parallel finalize_group arguments built up rollout by rollout."""

    group_id: str = "grp"
    rollout_ids: list[str] = field(default_factory=list)
    receipts: list = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    mask_sample: list[bool] = field(default_factory=list)

    def add(self, rollout_id: str, receipt, reward: float = 0.0, mask: bool = False) -> "Group":
        self.rollout_ids.append(rollout_id)
        self.receipts.append(receipt)
        self.rewards.append(reward)
        self.mask_sample.append(mask)
        return self

    def run(self, finalizer, **kwargs):
        kwargs.setdefault("fallback_weight_version", 9)
        kwargs.setdefault("prompt_idx", 17)
        # The stable logical ids the dispatcher would pass; rollout_ids may be physical ids.
        kwargs.setdefault("canonical_sample_ids",
                          [f"{self.group_id}_g{i}" for i in range(len(self.rollout_ids))])
        return finalizer.finalize_group(self.group_id, self.rollout_ids, self.receipts, self.rewards,
                                        mask_sample=self.mask_sample, **kwargs)
