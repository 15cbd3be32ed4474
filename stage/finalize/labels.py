"""Per-label group statistics (NeMo RL ``group_label_stats``): ``group_stats/{scope}/{name}/{stat}``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

PASS_THRESHOLD = 0.5
DEFAULT_RESULT_SCOPES = ("harness",)


def generated_runs(token_mask) -> tuple[int, int]:
    """(generated token count, number of runs of consecutive generated tokens)."""
    mask = np.asarray(token_mask) != 0
    if not mask.size:
        return 0, 0
    starts = int(mask[0]) + int((mask[1:] & ~mask[:-1]).sum())
    return int(mask.sum()), starts


def _label_key(text: str) -> str:
    return str(text).replace("/", "_")


def group_label_stats(*, labels: Sequence[tuple[str, str]], rewards: Sequence[float],
                      valid: Sequence[bool], mask_sample: Sequence[bool],
                      token_masks: Sequence, seq_lens: Sequence[int], truncated: Sequence[bool],
                      calls: Sequence[int], result_stats: Sequence[tuple[str, float, int]] = (),
                      result_scopes: Sequence[str] = DEFAULT_RESULT_SCOPES) -> dict[str, float]:
    n = len(rewards)
    if not labels or n == 0:
        return {}
    for name, column in (("valid", valid), ("mask_sample", mask_sample), ("token_masks", token_masks),
                         ("seq_lens", seq_lens), ("truncated", truncated), ("calls", calls)):
        if len(column) != n:
            raise ValueError(f"group_label_stats: {name} has {len(column)} entries, expected {n}")
    runs = [generated_runs(mask) for mask in token_masks]
    trained = [bool(v) and not bool(m) for v, m in zip(valid, mask_sample)]
    t_idx = [i for i in range(n) if trained[i]]
    stats: dict[str, float] = {
        "groups": 1.0, "rollouts": float(n), "trained": float(len(t_idx)),
        "placeholders": float(sum(1 for v in valid if not v)),
        "mask_sample": float(sum(1 for v, m in zip(valid, mask_sample) if v and m)),
        "all_reward_sum": float(sum(rewards)),
        "reward_sum": float(sum(rewards[i] for i in t_idx)),
        "pass_count": float(sum(1 for i in t_idx if rewards[i] >= PASS_THRESHOLD)),
        "gen_tokens_sum": float(sum(runs[i][0] for i in t_idx)),
        "gen_tokens_pass_sum": float(sum(runs[i][0] for i in t_idx if rewards[i] >= PASS_THRESHOLD)),
        "gen_tokens_fail_sum": float(sum(runs[i][0] for i in t_idx if rewards[i] < PASS_THRESHOLD)),
        "turns_sum": float(sum(runs[i][1] for i in t_idx)),
        "seq_len_sum": float(sum(seq_lens[i] for i in t_idx)),
        "truncated": float(sum(1 for i in t_idx if truncated[i])),
        "calls_sum": float(sum(calls[i] for i in t_idx)),
    }
    if len(t_idx) >= 2:
        trained_rewards = np.array([rewards[i] for i in t_idx], dtype=np.float64)
        mixed = float(trained_rewards.std()) > 1e-6
        passes = trained_rewards >= PASS_THRESHOLD
        stats.update(multi=1.0, mixed=float(mixed), all_pass=float(passes.all()),
                     all_fail=float((~passes).all()))
    out: dict[str, float] = {}
    for scope, name in labels:
        prefix = f"group_stats/{_label_key(scope)}/{_label_key(name)}"
        for stat, value in stats.items():
            out[f"{prefix}/{stat}"] = value
        if scope in result_scopes:
            for field, total, count in result_stats:
                if isinstance(total, bool) or not isinstance(total, (int, float)) \
                        or not math.isfinite(total):
                    continue
                out[f"{prefix}/result_sum/{field}"] = float(total)
                out[f"{prefix}/result_count/{field}"] = float(count)
    return out
