"""``rollout-reassembler bench finalize``: groups through what the stage runs outside its loop.

Per routes mode (direct: routes executed and integrity-checked here; deferred: plans only,
route payloads released at intake; no-routes), for each group of the profile:

* intake: decode + buffer every input record (the poll thread's share), against bare fastavro
  reads of the same records; the bytes the buffer counts and the RSS they cost;
* finalize: ``finalize_and_encode`` (the finalization worker's task), split into verify (fetch
  + verify_and_linearize), routes (plans, integrity, executor), tensorize (rows, group route
  tensor, plans) and encode (output records), against SHA-256 of exactly the bytes verification
  hashes and base64 + SHA-256 of the route bytes (the direct-mode integrity check's floor).

``--workers N``: the same groups decoded and finalized by 1..N threads and 1..N processes, in
groups per second (a process gets the wire records and returns the encoded outputs).

Profiles: ``default`` is the fixed group docs/performance.md's figures use (N=8 x 32 calls x 512 tokens,
routes 48x8 int16, 96 MiB); ``toy``, ``agentic-moe`` and ``frontier`` are generated
(stage.workload.profiles).
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import logging
import multiprocessing
import statistics
import time

from stage.bench import pipeline as P
from stage.bench.inputs import GroupInputs, bench_profile, fixed_group, profile_groups, profile_line
from stage.bench.machine import machine_info, machine_line

DEFAULT = "default"
PROFILE_CHOICES = (DEFAULT, "toy", "agentic-moe", "frontier")


def groups_of(profile: str, count: int, *, layers: int | None = None, topk: int = 8, n: int = 8,
              calls: int = 32, tokens: int = 512) -> tuple[str, list[GroupInputs]]:
    if profile == DEFAULT:
        layers = 48 if layers is None else layers
        line = (f"profile default: N={n} x {calls} calls x {tokens} tokens, routes L={layers} K={topk} "
                f"int16 ({n * calls * tokens * layers * topk * 2 / 2**20:.0f} MiB a group)")
        return line, [fixed_group(n=n, calls=calls, tokens=tokens, layers=layers, topk=topk, seed=i,
                                  group_id=f"bench-{i}") for i in range(count)]
    cfg = bench_profile(profile, groups=count, **({} if layers is None else {"route_layers": layers}))
    return profile_line(profile, cfg), list(profile_groups(cfg, count))


def _measure_mode(inputs: GroupInputs, mode: str, codec_map: dict, repeats: int, device: str,
                  rss: bool = True) -> dict:
    keep = P.keeps_routes(mode)
    # RSS in a fresh process: here, memory freed by earlier work would be reused and hide it
    _buffered, rss_held = P.held_by_intake(inputs, keep) if rss else (0, 0)
    gc.collect()
    started = time.perf_counter()
    buffer, group = P.intake(inputs, codec_map, keep_routes=keep)
    intake_s = time.perf_counter() - started
    samples = []
    for _ in range(repeats):
        out = P.finalize(group, mode, codec_map, device=device)
        m = out.metrics
        total = out.finalize_s * 1e3
        samples.append({
            "total_ms": total, "verify_ms": m["row_assembly/verify_ms"], "routes_ms": m["row_assembly/routes_ms"],
            "tensorize_ms": m["row_assembly/tensorize_ms"],
            "encode_ms": total - m["row_assembly/rollouts_ms"] - m["row_assembly/tensorize_ms"]})
        output_bytes = sum(len(v) for _t, v in out.records)
        del out
    result = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    result["best_total_ms"] = min(s["total_ms"] for s in samples)
    result.update(intake_ms=intake_s * 1e3, buffered_bytes=buffer.nbytes, rss_held_bytes=rss_held,
                  output_bytes=output_bytes, keeps_routes=keep)
    del buffer, group
    return result


def _anchors(inputs: GroupInputs, codec_map: dict) -> dict:
    _buffer, group = P.intake(inputs, codec_map, keep_routes=True)
    hashes = P.verify_hash_inputs(group)
    payloads = P.route_payloads(group)
    return {"raw_decode_ms": P.raw_decode_seconds(inputs, codec_map) * 1e3,
            "verify_sha256_ms": P.sha256_seconds(hashes) * 1e3,
            "verify_hashed_bytes": sum(len(b) for b in hashes),
            "route_base64_sha256_ms": P.base64_sha256_seconds(payloads) * 1e3 if payloads else 0.0}


def _scaling(groups: list[GroupInputs], mode: str, workers: int, device: str) -> list[dict]:
    """Groups per second through decode + finalize + encode with 1..workers threads / processes
    (each process with torch's threads as this one's)."""
    import torch
    threads = torch.get_num_threads()
    out = []
    for kind in ("thread", "process"):
        for k in range(1, workers + 1):
            if kind == "thread":
                pool = concurrent.futures.ThreadPoolExecutor(k)
            else:  # spawn: a fork of a process that imported torch may inherit its threads' locks
                pool = concurrent.futures.ProcessPoolExecutor(
                    k, mp_context=multiprocessing.get_context("spawn"),
                    initializer=P.worker_init, initargs=(threads,))
            with pool:
                list(pool.map(P.warm_worker, range(k)))          # start-up (imports) not timed
                started = time.perf_counter()
                results = list(pool.map(P.decode_and_finalize, groups, [mode] * len(groups),
                                        [device] * len(groups)))
                seconds = time.perf_counter() - started
            out.append({"kind": kind, "workers": k, "groups": len(groups), "seconds": seconds,
                        "groups_per_s": len(groups) / seconds,
                        "per_group_ms": statistics.median(s for _b, s in results) * 1e3})
    base = {r["kind"]: r["groups_per_s"] for r in out if r["workers"] == 1}
    for r in out:
        r["speedup_vs_1_thread"] = r["groups_per_s"] / base["thread"]
    return out


def run(*, as_json: bool = False, repeats: int = 3, profile: str = DEFAULT, groups: int = 1,
        modes=tuple(P.MODES), workers: int = 0, workers_mode: str | None = None, n: int = 8,
        calls: int = 32, tokens: int = 512, layers: int | None = None, topk: int = 8, device: str = "cpu",
        torch_threads: int = 0, rss: bool = True) -> dict:
    # Calls staged without a turn-boundary sidecar make the plan builder warn once per child
    # call ("legacy captured call"): correct, and noise for a benchmark.
    logging.getLogger("stage.routes.builder").setLevel(logging.ERROR)
    load_before = P.load_average()
    started = time.perf_counter()
    line, inputs = groups_of(profile, max(groups, 1), layers=layers, topk=topk, n=n, calls=calls,
                             tokens=tokens)
    build_s = time.perf_counter() - started
    codec_map = P.codecs()
    per_group = []
    for g in inputs:
        entry = {"group_id": g.group_id, "rollouts": g.rollouts, "calls": g.calls, "tokens": g.chain_tokens,
                 "input_bytes": g.nbytes, "route_bytes": g.route_bytes, "anchors": _anchors(g, codec_map),
                 "modes": {}}
        for mode in modes:
            entry["modes"][mode] = _measure_mode(g, mode, codec_map, repeats, device, rss)
        if rss and g.route_bytes and any(not P.keeps_routes(m) for m in modes):
            # what a route-less mode held before releasing payloads at intake: all of it
            kept, kept_rss = P.held_by_intake(g, True)
            entry["kept_routes_intake"] = {"buffered_bytes": kept, "rss_held_bytes": kept_rss}
        _ratios(entry)
        per_group.append(entry)
    scaling = None
    if workers:
        mode = workers_mode or ("direct" if "direct" in modes else modes[0])
        scaling = {"mode": mode, "results": _scaling(inputs, mode, workers, device)}
    import torch
    report = {"benchmark": "finalize", "profile": profile, "profile_line": line, "device": device,
              "torch_threads": torch.get_num_threads(),
              "repeats": repeats, "build_s": build_s, "load_before": load_before,
              "load_after": P.load_average(), "groups": per_group, "scaling": scaling,
              "machine": machine_info()}
    print(json.dumps(report, indent=2) if as_json else render(report))
    return report


def _ratios(entry: dict) -> None:
    a, modes = entry["anchors"], entry["modes"]
    for mode, r in modes.items():
        r["ratio_intake_to_raw_decode"] = r["intake_ms"] / a["raw_decode_ms"]
        r["ratio_verify_to_sha256"] = r["verify_ms"] / a["verify_sha256_ms"]
        r["tokens_per_s"] = entry["tokens"] / (r["total_ms"] / 1e3)
    direct = modes.get("direct")
    if direct and a["route_base64_sha256_ms"]:
        direct["ratio_total_to_base64_sha256"] = direct["total_ms"] / a["route_base64_sha256_ms"]
        base = modes.get("no-routes")
        if base:  # what routes add to a group, against what their integrity check must hash
            direct["ratio_route_work_to_base64_sha256"] = (
                (direct["total_ms"] - base["total_ms"]) / a["route_base64_sha256_ms"])


def render(report: dict) -> str:
    lines = [f"bench finalize: {report['profile_line']}; device {report['device']}, torch threads "
             f"{report['torch_threads']}, median of {report['repeats']}; machine load {report['load_before']}",
             machine_line(report["machine"])]
    for g in report["groups"]:
        a = g["anchors"]
        lines.append(f"group {g['group_id']}: {g['rollouts']} rollouts, {g['calls']} calls, {g['tokens']:,} tokens, "
                     f"input {g['input_bytes'] / 1e6:,.1f} MB (routes {g['route_bytes'] / 1e6:,.1f} MB)")
        lines.append(f"  anchors: raw fastavro decode {a['raw_decode_ms']:.1f} ms, SHA-256 of the verified bytes "
                     f"{a['verify_sha256_ms']:.1f} ms ({a['verify_hashed_bytes'] / 1e6:.1f} MB), base64 + SHA-256 "
                     f"of the routes {a['route_base64_sha256_ms']:.1f} ms")
        lines.append(f"  {'mode':9} {'intake ms':>9} {'x raw':>6} {'buffered MB':>11} {'RSS MB':>7} "
                     f"{'total ms':>9} {'verify':>7} {'x sha':>6} {'routes':>7} {'tensorize':>9} {'encode':>7} "
                     f"{'M tok/s':>8}")
        for mode, r in g["modes"].items():
            lines.append(
                f"  {mode:9} {r['intake_ms']:>9.1f} {r['ratio_intake_to_raw_decode']:>6.2f} "
                f"{r['buffered_bytes'] / 1e6:>11.1f} {r['rss_held_bytes'] / 1e6:>7.1f} {r['total_ms']:>9.1f} "
                f"{r['verify_ms']:>7.1f} {r['ratio_verify_to_sha256']:>6.2f} {r['routes_ms']:>7.1f} "
                f"{r['tensorize_ms']:>9.1f} {r['encode_ms']:>7.1f} {r['tokens_per_s'] / 1e6:>8.2f}")
        kept = g.get("kept_routes_intake")
        if kept:
            lines.append(f"  a route-less mode keeping the route payloads (before): buffered "
                         f"{kept['buffered_bytes'] / 1e6:,.1f} MB, RSS {kept['rss_held_bytes'] / 1e6:,.1f} MB")
        direct = g["modes"].get("direct", {})
        if "ratio_total_to_base64_sha256" in direct:
            text = f"  direct: total {direct['ratio_total_to_base64_sha256']:.2f}x the base64 + SHA-256 of its routes"
            if "ratio_route_work_to_base64_sha256" in direct:
                text += (f"; what routes add over no-routes: "
                         f"{direct['ratio_route_work_to_base64_sha256']:.2f}x (target <= 1.5x)")
            lines.append(text)
    if report["scaling"]:
        s = report["scaling"]
        lines.append(f"workers ({s['mode']}: decode + finalize + encode per group, {s['results'][0]['groups']} groups):")
        for r in s["results"]:
            lines.append(f"  {r['kind']:7} x{r['workers']}: {r['groups_per_s']:.2f} groups/s "
                         f"(per group {r['per_group_ms']:.0f} ms), {r['speedup_vs_1_thread']:.2f}x one thread")
    lines.append(f"machine load after: {report['load_after']}")
    return "\n".join(lines)
