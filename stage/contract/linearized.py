"""Output types of verify_and_linearize (Gym section 2.10), with packed token columns."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import repeat

import numpy as np

from .native import native as _native


@dataclass(frozen=True)
class WeightVersionSpan:
    """Absolute half-open range ``[start, end)`` of one call's delta in the row."""

    model_call_id: str
    start: int
    end: int
    weight_version: int


@dataclass(frozen=True)
class ExtrasCommitment:
    model_call_id: str
    extras_digest_version: int
    extras_digest: str


@dataclass(frozen=True, eq=False)
class LinearizedRow:
    """The verified terminal chain, root first.

    token_ids is uint64, token_mask and logprobs float64 (the stored doubles, not their float32
    digest images). link_spans are ``(model_call_id, carry_len, generation_len)`` per call.
    """

    rollout_id: str
    token_ids: np.ndarray
    token_mask: np.ndarray
    logprobs: np.ndarray
    model_call_ids: list[str]
    prompt_len: int
    weight_versions: list[int]
    weight_version_spans: list[WeightVersionSpan]
    link_spans: list[tuple[str, int, int]] = field(default_factory=list)
    extras_commitments: list[ExtrasCommitment] = field(default_factory=list)

    @property
    def call_ids(self) -> list[str]:
        return self.model_call_ids

    def to_json(self) -> dict:
        return {
            "rollout_id": self.rollout_id,
            "token_ids": self.token_ids.tolist(),
            "token_mask": self.token_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "model_call_ids": list(self.model_call_ids),
            "prompt_len": self.prompt_len,
            "weight_versions": list(self.weight_versions),
            "weight_version_spans": [[s.model_call_id, s.start, s.end, s.weight_version]
                                     for s in self.weight_version_spans],
            "link_spans": [list(s) for s in self.link_spans],
            "extras_commitments": [[c.model_call_id, c.extras_digest_version, c.extras_digest]
                                   for c in self.extras_commitments],
        }


_FIELD_NAMES = {cls: tuple(f.name for f in fields(cls)) for cls in (WeightVersionSpan, ExtrasCommitment)}


def build_all(cls, *columns) -> list:
    """``[cls(*row) for row in zip(*columns)]`` for the verifier's frozen output types, without
    a Python ``__init__`` call per row (one instance per chain call is part of verification's
    cost): each instance is allocated and given its field dict in C loops, as unpickling does
    (in one compiled call where stage._native is built)."""
    if _native is not None:
        return _native.build_all(cls, _FIELD_NAMES[cls], list(map(list, columns)))
    items = list(map(object.__new__, repeat(cls, len(columns[0]))))
    names = _FIELD_NAMES[cls]
    list(map(object.__setattr__, items, repeat("__dict__"), map(dict, map(zip, repeat(names), zip(*columns)))))
    return items
