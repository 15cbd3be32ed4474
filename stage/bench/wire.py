"""``python -m stage.bench.wire``: Avro encode/decode throughput of the hot records.

Cases (the figures in docs/schemas.md): a StagedCall with a 512-token delta (Gym's
uint64/float64 columns, and compact uint32/float32 ones), the same with a 512x48x8 int16 route
fragment, and a ReceiptEvent whose receipt names 32 calls. Each is
timed through ``AvroCodec`` (validation and every decode check included) and through bare
fastavro schemaless write/read, so the cost of the checks is visible; the decode budget's walk
(stage.wire.bounds, part of the decode) is also timed alone. ``--json`` for a report.
The record builders are reused by tests/wire/samples.py.
"""

from __future__ import annotations

import io
import json
import sys

import numpy as np
from fastavro import schemaless_reader, schemaless_writer

from stage.bench.machine import machine_info, machine_line
from stage.bench.timing import time_per_call
from stage.contract.producer import RolloutBuilder
from stage.wire import AvroCodec, pack_tensor

GROUP_ID = "g-000042"


def staged_call_record(delta_len: int = 512, *, routes: tuple[int, int] | None = None,
                       compact: bool = False, seed: int = 0, route_dtype: str = "int16") -> dict:
    """StagedCall of a root call staged by Gym's producer rules (real digests and hashes);
    ``routes=(L, K)`` attaches a delta_len x L x K int16 route fragment (nrlre1-encoded).
    ``compact``: uint32 ids and float32 mask/logprobs instead of Gym's uint64/float64 (the
    digests hash ids as u64 and floats as f32, so nothing they cover is lost)."""
    rng = np.random.default_rng(seed)
    prompt = delta_len // 2
    call = RolloutBuilder("rollout-7").stage(
        "call-0", parent_call_id=None, prompt_delta=rng.integers(0, 151_000, prompt),
        generated=rng.integers(0, 151_000, delta_len - prompt),
        generated_logprobs=-rng.random(delta_len - prompt), weight_version=17).record
    record = {k: getattr(call, k) for k in (
        "schema_version", "digest_version", "extras_digest_version", "rollout_id",
        "model_call_id", "parent_call_id", "mode", "prev_len", "delta_len", "cum_len",
        "weight_version", "digest", "extras_digest", "chain_hash", "cumulative_hash")}
    ids, mask, lps = call.token_ids_delta, call.token_mask_delta, call.generation_log_probs_delta
    if compact:
        ids, mask, lps = ids.astype(np.uint32), mask.astype(np.float32), lps.astype(np.float32)
    record.update(
        group_id=GROUP_ID, staging_key=f"{call.rollout_id}/{call.model_call_id}",
        token_ids_delta=pack_tensor(ids), token_mask_delta=pack_tensor(mask),
        generation_log_probs_delta=pack_tensor(lps))
    if routes is not None:
        layers, k = routes
        fragment = rng.integers(0, 128, (delta_len, layers, k)).astype(route_dtype)
        record.update(route_encoding=1, routed_experts=pack_tensor(fragment),
                      extras_metadata_json='{"routed_experts_boundary_index":null}')
    return record


def receipt_event_record(calls: int = 32, *, rollout_index: int = 3, group_size: int = 8,
                         seed: int = 0) -> dict:
    """ReceiptEvent whose Gym receipt names a ``calls``-long chain of staged calls."""
    rng = np.random.default_rng(seed)
    builder = RolloutBuilder(f"rollout-{rollout_index}")
    parent = None
    for i in range(calls):
        builder.stage(f"call-{i}", parent_call_id=parent,
                      prompt_delta=rng.integers(0, 151_000, 64), generated=rng.integers(0, 151_000, 32),
                      generated_logprobs=-rng.random(32), weight_version=17 + i // 16,
                      admitted_at=1.7e9 + i)
        parent = f"call-{i}"
    receipt = builder.receipt(parent, reward=0.75).to_json()
    return {
        "group_id": GROUP_ID, "rollout_id": receipt["rollout_id"], "rollout_index": rollout_index,
        "group_size": group_size, "prompt_idx": 4242, "reward": 0.75, "mask_sample": False,
        "loss_multiplier": 1.0, "fallback_weight_version": 17,
        "canonical_sample_id": f"{GROUP_ID}_g{rollout_index}",
        "labels": [{"scope": "task", "name": "math"}],
        "result_stats": [{"field": "tool_calls", "sum": 31.0, "count": 32}],
        "receipt": receipt,
    }


def _case(name: str, schema_name: str, record: dict) -> dict:
    codec = AvroCodec(schema_name)
    data = codec.encode(record)

    def raw_write():
        schemaless_writer(io.BytesIO(), codec.schema, record)

    budget = codec.decode_budget
    row = {"case": name, "bytes": len(data)}
    for label, fn in (("encode", lambda: codec.encode(record)), ("decode", lambda: codec.decode(data)),
                      ("raw_write", raw_write),
                      ("raw_read", lambda: schemaless_reader(io.BytesIO(data), codec.schema, None)),
                      ("budget_walk", lambda: budget.check(data, 0, len(data)))):
        t = time_per_call(fn, min_seconds=0.4)["median_s"]
        row[f"{label}_us"] = t * 1e6
        row[f"{label}_per_s"] = 1 / t
        row[f"{label}_MBps"] = len(data) / t / 1e6
    return row


def sdk_staging(tokens: int = 2048, layers: int = 48, k: int = 8, dtypes=("int8", "int16"),
                calls: int = 12) -> list[dict]:
    """RolloutStager.prepare of a ``tokens``-token child call with ``layers`` x ``k`` routes (and
    its boundary route): Gym's digests plus the StagedCall value, against base64 + SHA-256 of the
    same route bytes (what the extras digest cannot avoid)."""
    import pybase64
    import hashlib
    import statistics
    import time

    from stage.client import RolloutStager
    rng = np.random.default_rng(0)
    out = []
    for dtype in dtypes:
        stager = RolloutStager(None, GROUP_ID, "rollout-sdk")
        stager.prepare("c0", prompt_delta=rng.integers(0, 151_000, 64), generated=rng.integers(0, 151_000, 16),
                       generated_logprobs=-rng.random(16), weight_version=1,
                       routed_experts=rng.integers(0, 128, (80, layers, k)).astype(dtype), route_dtype=dtype)
        seconds, routes = [], None
        for i in range(calls):
            half = tokens // 2
            routes = rng.integers(0, 128, (tokens, layers, k)).astype(dtype)
            kwargs = dict(prompt_delta=rng.integers(0, 151_000, half), generated=rng.integers(0, 151_000, tokens - half),
                          generated_logprobs=-rng.random(tokens - half), weight_version=1, routed_experts=routes,
                          routed_experts_boundary=rng.integers(0, 128, (1, layers, k)).astype(dtype),
                          route_dtype=dtype)
            started = time.perf_counter()
            stager.prepare(f"c{i + 1}", parent_call_id=f"c{i}", **kwargs)
            seconds.append(time.perf_counter() - started)
        raw = routes.tobytes()
        anchor = min(time_per_call(lambda: hashlib.sha256(pybase64.b64encode(raw)).digest(), min_seconds=0.2)
                     ["median_s"] for _ in range(1))
        median = statistics.median(seconds)
        out.append({"case": f"RolloutStager.prepare, {tokens}-token call + {tokens}x{layers}x{k} {dtype} routes",
                    "route_bytes": len(raw), "prepare_ms": median * 1e3, "base64_sha256_ms": anchor * 1e3,
                    "ratio": median / anchor})
    return out


def run(profile: str = "default") -> list[dict]:
    if profile == "default":
        return [
            _case("StagedCall, 512-token delta", "StagedCall", staged_call_record(512)),
            _case("StagedCall, 512-token delta, compact dtypes", "StagedCall",
                  staged_call_record(512, compact=True)),
            _case("StagedCall, 512-token delta + 512x48x8 int16 routes", "StagedCall",
                  staged_call_record(512, routes=(48, 8))),
            _case("ReceiptEvent, 32-call manifest", "ReceiptEvent", receipt_event_record(32)),
        ]
    from stage.bench.inputs import bench_profile
    cfg = bench_profile(profile)
    layers, k = cfg.routes or (0, 0)
    mean_call = (cfg.rollout_tokens[0] // sum(cfg.turns) * 2) if cfg.rollout_tokens else 64
    calls = sum(cfg.turns) // 2
    rows = []
    for tokens in (mean_call, 4 * mean_call):
        for dtype in cfg.route_dtypes if layers else ():
            rows.append(_case(f"StagedCall, {tokens}-token delta + {tokens}x{layers}x{k} {dtype} routes",
                              "StagedCall", staged_call_record(tokens, routes=(layers, k), compact=True,
                                                               route_dtype=dtype)))
        if not layers:
            rows.append(_case(f"StagedCall, {tokens}-token delta, compact dtypes", "StagedCall",
                              staged_call_record(tokens, compact=True)))
    rows.append(_case(f"ReceiptEvent, {calls}-call manifest", "ReceiptEvent",
                      receipt_event_record(calls, group_size=cfg.group_size)))
    return rows


def main(argv: list[str] | None = None, profile: str = "default") -> int:
    from stage.bench.pipeline import load_average
    load = load_average()
    rows = run(profile)
    sdk = sdk_staging()
    if "--json" in (argv if argv is not None else sys.argv[1:]):
        print(json.dumps({"benchmark": "wire", "profile": profile, "load": load, "results": rows,
                          "sdk": sdk, "machine": machine_info()}, indent=2))
        return 0
    print(f"# one thread, median of 5 rounds; profile {profile}; machine load {load}")
    print(f"# {machine_line()}")
    print("| case | bytes | encode us (rec/s, MB/s) | decode us (rec/s, MB/s) "
          "| bare fastavro write / read us | of the decode: budget walk us |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['bytes']:,} "
              f"| {r['encode_us']:.1f} ({r['encode_per_s']:,.0f}, {r['encode_MBps']:,.0f}) "
              f"| {r['decode_us']:.1f} ({r['decode_per_s']:,.0f}, {r['decode_MBps']:,.0f}) "
              f"| {r['raw_write_us']:.1f} / {r['raw_read_us']:.1f} | {r['budget_walk_us']:.1f} |")
    print("\nSDK staging (target <= 2 ms for 2k tokens with 48x8 routes), against base64 + SHA-256 of the routes:")
    for r in sdk:
        print(f"  {r['case']}: {r['prepare_ms']:.2f} ms; anchor {r['base64_sha256_ms']:.2f} ms "
              f"({r['route_bytes'] / 1e6:.2f} MB); ratio {r['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
