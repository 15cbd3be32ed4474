"""Bounds on untrusted input, checked before anything proportional to them is allocated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputLimits:
    max_group_size: int = 4096          # rollouts per prompt group
    max_manifest_calls: int = 65_536    # calls named by one receipt
    max_delta_tokens: int = 4_194_304   # tokens staged by one call
    max_route_values: int = 1 << 31     # delta_len * L * K of one fragment
    max_topk: int = 1024
    max_media_bytes: int = 1 << 30
    max_id_chars: int = 4096            # group ids, rollout ids, staging keys
