"""Finalization settings (NeMo RL's TokenCaptureConfig, the parts that shape rows)."""

from __future__ import annotations

from dataclasses import dataclass

from stage.routes import ROUTE_PLAN_SCHEMA_VERSION


@dataclass(frozen=True)
class ReassemblyConfig:
    router_replay: bool = False        # build route plans (R3)
    defer_routes: bool = False         # deferred: publish plans; direct: execute them here
    top_logprobs: int = 0              # sampler top-k width; 0 = no top-k columns
    capture_media: bool = False        # VLM media columns
    media_patch_size: int = 14
    staging_partition: str = "rollouts.staged-calls"
    pad_token_id: int = 0
    max_seq_len: int | None = None     # `truncated` is exact equality with this length
    device: str = "cpu"                # "cpu", "cuda", "cuda:N" or "auto"
    route_plan_schema_version: int = ROUTE_PLAN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.defer_routes and not self.router_replay:
            raise ValueError("defer_routed_experts_to_policy requires router replay to be enabled")
        if type(self.top_logprobs) is not int or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be a non-negative int, got {self.top_logprobs!r}")
        if self.max_seq_len is not None and self.max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {self.max_seq_len}")
        if self.media_patch_size <= 0:
            raise ValueError(f"media_patch_size must be positive, got {self.media_patch_size}")

    @property
    def direct_routes(self) -> bool:
        return self.router_replay and not self.defer_routes
