"""Bounds on untrusted input, checked before anything proportional to them is allocated."""

from __future__ import annotations

from dataclasses import dataclass

from stage.wire import DEFAULT_MAX_RECORD_BYTES, STAGED_ROUTES_TOPIC


@dataclass(frozen=True)
class InputLimits:
    max_group_size: int = 4096          # rollouts per prompt group
    max_manifest_calls: int = 65_536    # calls named by one receipt
    max_delta_tokens: int = 4_194_304   # tokens staged by one call
    max_route_values: int = 1 << 31     # delta_len * L * K of one fragment
    max_topk: int = 1024
    max_media_bytes: int = 1 << 30
    max_id_chars: int = 4096            # group ids, rollout ids, staging keys
    # Per-label metrics are labels x result fields keys in one GroupSummary (8 MiB cap): 32
    # labels x 128 fields x 2 keys of <= ~420 characters stay near 3.5 MB.
    max_labels: int = 32                # labels of one receipt
    max_result_stats: int = 128         # result_stats entries of one receipt
    max_name_chars: int = 128           # a label's scope or name, a result_stats field
    # Routes staged by reference (stage.staging.route_refs): the topic a reference must name
    # (the stage's topics.staged_routes) and the largest chunk payload it may name (a chunk
    # record fits the stage's max_record_bytes). The runtime sets both from its settings.
    route_topic: str = STAGED_ROUTES_TOPIC
    max_route_chunk_bytes: int = DEFAULT_MAX_RECORD_BYTES
