"""Finalization settings (NeMo RL's TokenCaptureConfig, the parts that shape rows)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from stage.config.topics import STAGED_CALLS_TOPIC
from stage.config.types import ConfigModel, Device, Int, IntChoice, bounded_int, conflict
from stage.routes import ROUTE_PLAN_SCHEMA_VERSION

DEFAULT_STAGING_PARTITION = STAGED_CALLS_TOPIC


def _none_text(value):
    """Environment text for "no limit": empty, none or null."""
    return None if isinstance(value, str) and value.strip().lower() in ("", "none", "null") else value


class ReassemblyConfig(ConfigModel):
    router_replay: bool = Field(False, description="build route plans")
    defer_routes: bool = Field(
        False, description="deferred mode: publish a RoutePlan per row (fragments stay in the staged-calls "
                           "topic); false = direct mode: execute plans here and publish `routed_experts`")
    top_logprobs: Int = Field(0, ge=0, description="sampler top-k width (staged rows must carry top-k "
                                                    "columns when > 0)")
    capture_media: bool = Field(False, description="VLM media columns")
    media_patch_size: Int = Field(14, ge=1, description="patch size P of staged media")
    staging_partition: str = Field(
        DEFAULT_STAGING_PARTITION, min_length=1,
        description="the name route plans carry as their staging partition; in the stage's "
                    "configuration it defaults to `topics.staged_calls`")
    pad_token_id: Int = Field(0, ge=0, description="placeholder and padding token")
    max_seq_len: Annotated[bounded_int(ge=1) | None, BeforeValidator(_none_text)] = Field(
        None, description="`truncated` is exact equality with this length (null: no limit)")
    device: Device = Field("cpu", description="torch device for row tensors and route execution: "
                                              "`cpu`, `cuda`, `cuda:N`, `auto` (CUDA when present)")
    route_plan_schema_version: Annotated[Literal[2, 3], IntChoice] = Field(
        ROUTE_PLAN_SCHEMA_VERSION, description="2 for consumers that only read legacy plans")
    route_layers: Annotated[bounded_int(ge=1) | None, BeforeValidator(_none_text)] = Field(
        None, description="direct router replay: the model's MoE layers L (routes are `[tokens, L, K]`); "
                          "set with `route_topk`. A rollout whose routes have other dims is rejected "
                          "(`route_assembly:fragment_model_shape`). Null: learned, bounded (L * K <= 2048 "
                          "a token, else `route_assembly:fragment_dims_limit`) and agreed by two rollouts "
                          "holding a majority of the recent ones; before then a valid row without routes "
                          "is `route_dims_unknown` and a group no routes can shape is dropped "
                          "(docs/design.md, Learned route dims)")
    route_topk: Annotated[bounded_int(ge=1) | None, BeforeValidator(_none_text)] = Field(
        None, description="direct router replay: experts per token K (set with `route_layers`)")

    @model_validator(mode="after")
    def _deferred_needs_replay(self) -> ReassemblyConfig:
        if self.defer_routes and not self.router_replay:
            # NeMo RL's message for the same rule
            raise conflict("defer_routed_experts_to_policy requires router replay to be enabled "
                           "(set router_replay: true, or defer_routes: false)", "defer_routes", "router_replay")
        return self

    @model_validator(mode="after")
    def _route_dims_together(self) -> ReassemblyConfig:
        if (self.route_layers is None) != (self.route_topk is None):
            raise conflict("route_layers and route_topk are the model's (L, K): set both or neither",
                           "route_layers", "route_topk")
        return self

    @property
    def route_dims(self) -> tuple[int, int] | None:
        """The configured (L, K), or None (learned from staged routes)."""
        return None if self.route_layers is None else (self.route_layers, self.route_topk)

    @property
    def direct_routes(self) -> bool:
        return self.router_replay and not self.defer_routes
