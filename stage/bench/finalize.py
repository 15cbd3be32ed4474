"""``rollout-reassembler bench finalize``: one group through finalize_group, time split.

N=8 rollouts x 32 calls x 512 tokens with routes (L=48, K=8, int16 envelopes), direct router
replay (routes executed and integrity-checked here) and deferred (plans only), on the
configured device. Prints per-group time split into verify (fetch + verify_and_linearize),
routes (plan + integrity + executor), tensorize (rows, group route tensor, plans).
"""

from __future__ import annotations

import json
import logging
import statistics
import time

import numpy as np

from stage.contract import encode_routed_experts
from stage.contract.producer import RolloutBuilder
from stage.finalize import InMemoryTokenSource, Reassembler, ReassemblyConfig


def build_group(source: InMemoryTokenSource, *, n: int, calls: int, tokens: int, layers: int,
                topk: int, seed: int = 0):
    """Stage ``n`` rollouts of ``calls`` chained calls, ``tokens`` delta tokens each (half carry,
    half generated), with delta-aligned route envelopes; returns (rollout_ids, receipts)."""
    rng = np.random.default_rng(seed)
    ids, receipts = [], []
    for r in range(n):
        builder = RolloutBuilder(f"bench_g{r}")
        parent = None
        for c in range(calls):
            carry, gen = tokens // 2, tokens - tokens // 2
            routes = rng.integers(0, 128, (tokens, layers, topk), dtype=np.int16)
            staged = builder.stage(
                f"c{c}", parent_call_id=parent, prompt_delta=rng.integers(0, 151_000, carry),
                generated=rng.integers(0, 151_000, gen), generated_logprobs=-rng.random(gen),
                weight_version=5, extras={"routed_experts": encode_routed_experts(routes, "int16")})
            source.stage(staged.record)
            parent = f"c{c}"
        ids.append(builder.rollout_id)
        receipts.append(builder.receipt(parent).to_json())
    return ids, receipts


def run(*, as_json: bool = False, repeats: int = 3, n: int = 8, calls: int = 32, tokens: int = 512,
        layers: int = 48, topk: int = 8, device: str = "cpu") -> dict:
    # The synthetic calls stage no turn-boundary sidecar, so the plan builder warns once per
    # child call ("legacy captured call"): correct, and noise for a benchmark.
    logging.getLogger("stage.routes.builder").setLevel(logging.ERROR)
    source = InMemoryTokenSource()
    t = time.perf_counter()
    ids, receipts = build_group(source, n=n, calls=calls, tokens=tokens, layers=layers, topk=topk)
    build_s = time.perf_counter() - t
    results = {}
    for mode, cfg in (("direct", ReassemblyConfig(router_replay=True, device=device)),
                      ("deferred", ReassemblyConfig(router_replay=True, defer_routes=True, device=device)),
                      ("no-routes", ReassemblyConfig(device=device))):
        finalizer = Reassembler(source, cfg)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            group = finalizer.finalize_group("bench", ids, receipts, [1.0] * n, mask_sample=[False] * n,
                                             fallback_weight_version=0, prompt_idx=0)
            total = (time.perf_counter() - start) * 1e3
            assert group.valid_row_count == n, [r.rejection_reason for r in group.rows]
            m = group.metrics
            samples.append({"total_ms": total, "verify_ms": m["row_assembly/verify_ms"],
                            "routes_ms": m["row_assembly/routes_ms"],
                            "tensorize_ms": m["row_assembly/tensorize_ms"]})
        results[mode] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    tokens_per_group = n * calls * tokens
    report = {"benchmark": "finalize", "device": device, "group": {
        "rollouts": n, "calls_per_rollout": calls, "tokens_per_call": tokens, "layers": layers,
        "topk": topk, "tokens": tokens_per_group,
        "route_bytes_int16": tokens_per_group * layers * topk * 2}, "build_s": build_s,
        "results": results}
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        g = report["group"]
        print(f"finalize_group: N={n} x {calls} calls x {tokens} tokens = {g['tokens']} tokens, "
              f"routes L={layers} K={topk} ({g['route_bytes_int16'] / 2**20:.0f} MiB int16), "
              f"device={device}, median of {repeats}")
        print(f"{'mode':10} {'total ms':>9} {'verify ms':>10} {'routes ms':>10} {'tensorize ms':>13} "
              f"{'M tokens/s':>11}")
        for mode, r in results.items():
            print(f"{mode:10} {r['total_ms']:>9.1f} {r['verify_ms']:>10.1f} {r['routes_ms']:>10.1f} "
                  f"{r['tensorize_ms']:>13.1f} {g['tokens'] / r['total_ms'] / 1e3:>11.2f}")
    return report
