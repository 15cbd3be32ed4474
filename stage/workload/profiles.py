"""Named workload profiles: the sizes the demo and every benchmark run (``--profile NAME``).

* ``toy``: the demo's default, seconds on a laptop: N=4, 1-4 turns of a few dozen tokens,
  routes L=4 x K=2.
* ``agentic-moe``: agentic GRPO at 2025-2026 sizes: N=16 rollouts of ~64 model calls
  (56-64 chain turns, abandoned retries, side calls), rollouts of 32k tokens on average and up
  to 128k (log-normal), MoE router replay at Qwen3-30B-A3B dims (48 MoE layers x top-8 of 128
  experts), routes staged as int8 by half of the workers and int16 by the other half (384 or 768
  bytes a token: 9-90x the token payload). One group is ~0.5 M tokens and 0.2-0.4 GB of routes.
* ``frontier``: the same agentic traffic (N=16, ~64 calls, 32k mean / 128k max tokens) at a
  frontier MoE's router replay, Nemotron-3-Super-like: 40 MoE layers x top-22 of 512 experts,
  every worker staging int16 (1,760 bytes a token, 2.3x agentic-moe's int16). One group is
  ~0.5 M tokens and ~0.9 GB of routes; a 128k-token rollout alone carries 225 MB (16 of them:
  3.4 GiB). A long call's routes are many times the record cap: they travel by reference.

``profile(name, **overrides)`` returns the WorkloadConfig (overrides: any of its fields).
"""

from __future__ import annotations

import dataclasses

from stage.workload.generator import WorkloadConfig

TOY = "toy"
AGENTIC_MOE = "agentic-moe"
FRONTIER = "frontier"
# The agentic traffic both MoE profiles share: only the model's routes differ.
_AGENTIC = dict(groups=2, group_size=16, turns=(56, 64), prompt_tokens=(1024, 4096),
                rollout_tokens=(32_768, 131_072), retry_rate=0.08, side_call_rate=0.5,
                version_bump_rate=0.05, media_rate=0.0)

PROFILES: dict[str, WorkloadConfig] = {
    TOY: WorkloadConfig(groups=64, group_size=4, media_rate=0.1),
    AGENTIC_MOE: WorkloadConfig(**_AGENTIC, route_layers=48, route_topk=8, num_experts=128,
                                route_dtype=("int8", "int16"), vocab_size=151_936),
    FRONTIER: WorkloadConfig(**_AGENTIC, route_layers=40, route_topk=22, num_experts=512,
                             route_dtype="int16", vocab_size=131_072),
}
PROFILE_NAMES = tuple(PROFILES)


def profile(name: str, **overrides) -> WorkloadConfig:
    if name not in PROFILES:
        raise ValueError(f"unknown workload profile {name!r}; known: {', '.join(PROFILE_NAMES)}")
    return dataclasses.replace(PROFILES[name], **overrides)


def describe(cfg: WorkloadConfig, name: str | None = None) -> str:
    """One line naming the sizes (printed by every benchmark and the demo)."""
    if cfg.rollout_tokens is not None:
        tokens = f"rollouts ~{cfg.rollout_tokens[0]:,} tokens (max {cfg.rollout_tokens[1]:,})"
    else:
        tokens = (f"prompt {cfg.prompt_tokens[0]}-{cfg.prompt_tokens[1]}, turns +{cfg.turn_tokens[0]}-"
                  f"{cfg.turn_tokens[1]}, generated {cfg.generated_tokens[0]}-{cfg.generated_tokens[1]} tokens")
    routes = (f"routes L={cfg.route_layers} K={cfg.route_topk} {'/'.join(cfg.route_dtypes)}"
              if cfg.routes else "no routes")
    label = f"profile {name}: " if name else ""
    return (f"{label}N={cfg.group_size}, {cfg.turns[0]}-{cfg.turns[1]} turns, {tokens}, {routes}")
