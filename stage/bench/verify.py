"""``rollout-reassembler bench verify``: verify_and_linearize throughput vs the SHA-256 bound.

Builds a long agentic rollout (64 calls, ~33k tokens) and a small one, times the verifier,
and in the same run times plain hashlib SHA-256 over exactly the bytes the verifier must hash
(every row's call-digest payload, the chain-hash input of every chain call, and the terminal's
cumulative-hash input). The ratio says how close verification is to its hashing floor.
``--profile agentic-moe`` (or ``frontier``, the same token plan): the rollouts of one generated group instead (the one nearest the
profile's mean length, and the longest; routes are not generated: verification never reads them).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time

import numpy as np

from stage.bench.machine import machine_info, machine_line
from stage.bench.timing import time_per_call
from stage.contract import encoding as enc
from stage.contract import RolloutReceipt, verify_and_linearize
from stage.contract.packed import PackedRows
from stage.contract.constants import CALL_DIGEST_DOMAIN, CHAIN_HASH_DOMAIN, PREFIX_HASH_DOMAIN
from stage.contract.producer import RolloutBuilder


# Issue 31: >= 0.6 of the bound on the large rollout, >= 0.5 on ~10k-token ones (agentic-moe's
# shortest), on any core.
RATIO_TARGETS = {"large": 0.6, "shortest": 0.5}


def build_rollout(*, calls: int, root_prompt: int, carry: int, generated: int, seed: int = 0):
    """A linear multi-turn chain plus one abandoned retry per 8 calls (off-chain rows)."""
    rng = np.random.default_rng(seed)
    builder = RolloutBuilder(f"bench-{calls}x{generated}")
    parent = None
    for i in range(calls):
        prompt = rng.integers(0, 151_000, root_prompt if parent is None else carry)
        kwargs = dict(prompt_delta=prompt, generated=rng.integers(0, 151_000, generated),
                      generated_logprobs=-rng.random(generated), weight_version=10 + i // 16)
        if parent is not None and i % 8 == 0:  # a retried call: first attempt abandoned
            builder.stage(f"call-{i}-retry", parent_call_id=parent, **kwargs)
        builder.stage(f"call-{i}", parent_call_id=parent, **kwargs)
        parent = f"call-{i}"
    return builder.receipt(parent), builder.snapshots()


def hashed_bytes(receipt, snapshots) -> list[bytes]:
    """The exact SHA-256 inputs of one verification, prebuilt (so only hashing is timed)."""
    by_id = {s.model_call_id: s for s in snapshots}
    inputs = []
    for s in snapshots:
        ids = enc.token_image(s.token_ids_delta).tobytes()
        mask = enc.f32_image(s.token_mask_delta, "m").tobytes()
        lps = enc.f32_image(s.generation_log_probs_delta, "l").tobytes()
        head = (bytes((2, 2, 1)) + enc.text(s.rollout_id) + enc.text(s.model_call_id)
                + enc.opt_text(s.parent_call_id) + enc.text(s.mode)
                + b"".join(enc.u64(v) for v in (s.prev_len, s.delta_len, s.cum_len, s.weight_version)))
        inputs.append(CALL_DIGEST_DOMAIN + head
                      + enc.u64(8 + len(ids)) + enc.u64(len(ids) // 8) + ids
                      + enc.u64(8 + len(mask)) + enc.u64(len(mask) // 4) + mask
                      + enc.u64(8 + len(lps)) + enc.u64(len(lps) // 4) + lps
                      + bytes.fromhex(s.extras_digest) + b"\x01" + bytes.fromhex(s.chain_hash)
                      + b"\x01" + bytes.fromhex(s.cumulative_hash))
    chain, node = [], receipt.terminal_model_call_id
    while node is not None:
        chain.append(by_id[node])
        node = by_id[node].parent_call_id
    chain.reverse()
    images = [enc.token_image(s.token_ids_delta).tobytes() for s in chain]
    for i, (s, image) in enumerate(zip(chain, images)):
        marker = b"\x00" if i == 0 else b"\x01" + bytes.fromhex(chain[i - 1].chain_hash)
        inputs.append(CHAIN_HASH_DOMAIN + marker + enc.u64(len(image) // 8) + image)
    total = sum(len(x) for x in images) // 8
    inputs.append(PREFIX_HASH_DOMAIN + enc.u64(total) + b"".join(images))
    return inputs


def stage_path(receipt, snapshots):
    """What the stage runs per rollout once its group's staged calls were converted (their
    digests checked then, their columns packed for the whole group): the receipt parsed from
    its decoded form, then verified on its rows of that pack (``PackedRows.select``)."""
    raw, pack, rows = receipt.to_json(), PackedRows.try_pack(snapshots), list(range(len(snapshots)))

    def run():
        parsed = RolloutReceipt.from_json(raw)
        return verify_and_linearize(parsed, snapshots, digests_verified=True,
                                    packed=pack.select(rows) if pack is not None else None)
    return run


def measure(name: str, receipt, snapshots, min_seconds: float) -> dict:
    row = verify_and_linearize(receipt, snapshots)
    tokens = int(len(row.token_ids))
    # CPU time of this (single-threaded) process: the machine may be shared (see timing.py)
    verify_t = time_per_call(lambda: verify_and_linearize(receipt, snapshots), min_seconds=min_seconds,
                             clock=time.process_time)
    stage_t = time_per_call(stage_path(receipt, snapshots), min_seconds=min_seconds,
                            clock=time.process_time)
    inputs = hashed_bytes(receipt, snapshots)
    hash_t = time_per_call(lambda: [hashlib.sha256(b).digest() for b in inputs], min_seconds=min_seconds,
                           clock=time.process_time)
    verify_rate = tokens / verify_t["median_s"]
    hash_rate = tokens / hash_t["median_s"]
    return {
        "case": name, "calls": len(snapshots), "chain_calls": len(row.model_call_ids),
        "tokens": tokens, "staged_tokens": int(sum(s.delta_len for s in snapshots)),
        "hashed_bytes": sum(len(b) for b in inputs),
        "verify_ms": verify_t["median_s"] * 1e3, "hash_only_ms": hash_t["median_s"] * 1e3,
        "verify_tokens_per_s": verify_rate, "hash_bound_tokens_per_s": hash_rate,
        "ratio_to_hash_bound": verify_rate / hash_rate,
        # the stage's path (stage_path): the same anchor, although it hashes less (no call digests)
        "stage_path_ms": stage_t["median_s"] * 1e3,
        "stage_path_ratio": hash_t["median_s"] / stage_t["median_s"],
    }


def profile_cases(profile: str) -> tuple[str, list[tuple[str, object, list]]]:
    """(profile line, [(case, receipt, snapshots)]) of one generated group of ``profile``."""
    from stage.bench.inputs import bench_profile, profile_line
    from stage.workload import generate_group
    cfg = bench_profile(profile, route_layers=0, groups=1)
    group = generate_group(cfg, 0)
    rollouts = sorted(group.rollouts, key=lambda r: sum(c.record.delta_len for c in r.calls))
    mean = cfg.rollout_tokens[0] if cfg.rollout_tokens else None
    def length(r):
        return sum(c.record.delta_len for c in r.calls if c.role == "chain")
    typical = min(rollouts, key=lambda r: abs(length(r) - mean)) if mean else rollouts[len(rollouts) // 2]
    cases = [("typical", typical), ("longest", rollouts[-1]), ("shortest", rollouts[0])]
    return profile_line(profile, cfg), [(name, r.receipt, [c.record.base_snapshot() for c in r.calls])
                                        for name, r in cases]


def run(*, as_json: bool = False, min_seconds: float = 2.0, target: float = 10e6,
        profile: str = "default") -> dict:
    from stage.bench.pipeline import load_average
    load_before = load_average()
    if profile == "default":
        line = ("profile default: large = 64 chained calls (512-token root prompt, 256 carry + 256 "
                "generated each, an abandoned retry every 8 calls), small = 4 calls")
        large = build_rollout(calls=64, root_prompt=512, carry=256, generated=256)
        small = build_rollout(calls=4, root_prompt=64, carry=16, generated=32, seed=1)
        results = [measure("large", *large, min_seconds), measure("small", *small, min_seconds / 4)]
    else:
        line, cases = profile_cases(profile)
        results = [measure(name, receipt, snapshots, min_seconds) for name, receipt, snapshots in cases]
    report = {
        "benchmark": "verify", "profile": profile, "profile_line": line,
        "python": platform.python_version(), "machine": machine_info(),
        "malloc_tuning": os.environ.get("ROLLOUT_REASSEMBLER_MALLOC_TUNING", "1") != "0",
        "load_before": load_before, "load_after": load_average(),
        "target_tokens_per_s": target, "results": results,
        "meets_target": results[0]["verify_tokens_per_s"] >= target,
    }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(f"verify_and_linearize vs SHA-256 of the same bytes (single thread, CPU time); "
              f"{line}; machine load {load_before}")
        print(machine_line(report["machine"]))
        print(f"{'case':8} {'calls':>5} {'tokens':>7} {'verify ms':>10} {'hash ms':>8} "
              f"{'verify Mtok/s':>14} {'hash Mtok/s':>12} {'ratio':>6} {'stage path ms':>14} {'ratio':>6}")
        for r in results:
            print(f"{r['case']:8} {r['calls']:>5} {r['tokens']:>7} {r['verify_ms']:>10.3f} "
                  f"{r['hash_only_ms']:>8.3f} {r['verify_tokens_per_s'] / 1e6:>14.2f} "
                  f"{r['hash_bound_tokens_per_s'] / 1e6:>12.2f} {r['ratio_to_hash_bound']:>6.2f} "
                  f"{r['stage_path_ms']:>14.3f} {r['stage_path_ratio']:>6.2f}")
        print("stage path: the receipt parsed + verify with the digests checked at conversion, on "
              "the group pass's packed columns (what the stage runs per rollout), same anchor")
        verdict = "meets" if report["meets_target"] else "MISSES"
        print(f"target >= {target / 1e6:.0f} M tokens/s on the {results[0]['case']} rollout: {verdict}")
        for r in results:   # issue 31's ratios, for a core without AVX-512 as for one with it
            if r["case"] in RATIO_TARGETS:
                goal = RATIO_TARGETS[r["case"]]
                print(f"target ratio >= {goal:.2f} of the SHA-256 bound on the {r['case']} rollout: "
                      f"{'meets' if r['ratio_to_hash_bound'] >= goal else 'MISSES'}")
    return report
