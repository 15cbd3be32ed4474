"""What the stage does with one group outside its loop, as the benchmarks run it: decode and
buffer the group's input records (the poll thread's share), then ``finalize_and_encode`` (the
finalization worker's share), plus the anchors that bound that work: bare fastavro reads of the
same records, SHA-256 of exactly what verification hashes, base64 + SHA-256 of the route bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
import time

import pybase64
from fastavro import schemaless_reader

from stage.bench.inputs import BENCH_MAX_RECORD_BYTES, RECEIPTS, GroupInputs
from stage.bench.verify import hashed_bytes
from stage.buffer import PartitionBuffer, Position
from stage.contract import RolloutReceipt
from stage.decode import InputLimits, receipt_item, staged_item, staged_row
from stage.finalize import ReassemblyConfig
from stage.routes import RouteDimsCache
from stage.wire import OUTPUT_RECORDS, AvroCodec, TopicNames

TOPICS = TopicNames()
OUTPUT_CODECS = OUTPUT_RECORDS
MODES = {
    "direct": ReassemblyConfig(router_replay=True, staging_partition=TOPICS.staged_calls),
    "deferred": ReassemblyConfig(router_replay=True, defer_routes=True, staging_partition=TOPICS.staged_calls),
    "no-routes": ReassemblyConfig(staging_partition=TOPICS.staged_calls),
}


def codecs() -> dict:
    out = {n: AvroCodec(n, max_record_bytes=BENCH_MAX_RECORD_BYTES) for n in OUTPUT_CODECS}
    out["StagedCall"] = AvroCodec("StagedCall", max_record_bytes=BENCH_MAX_RECORD_BYTES)
    out["ReceiptEvent"] = AvroCodec("ReceiptEvent")
    return out


def keeps_routes(mode: str) -> bool:
    """Only direct router replay reads route payloads; the other modes release them at intake."""
    return MODES[mode].direct_routes


def intake(inputs: GroupInputs, codec_map: dict, *, keep_routes: bool = True):
    """Decode every record and buffer it, as the poll thread does; returns (buffer, group)."""
    buffer = PartitionBuffer(0, receipts_topic=TOPICS.receipts, staged_topic=TOPICS.staged_calls,
                             group_timeout_ms=1 << 40, late_retention_ms=1000)
    limits = InputLimits()
    for offset, (role, value) in enumerate(inputs.records):
        if role == RECEIPTS:
            pos = Position(TOPICS.receipts, 0, offset, 1)
            buffer.add_receipt(receipt_item(codec_map["ReceiptEvent"].decode(value), pos, len(value), limits), 1)
        else:
            pos = Position(TOPICS.staged_calls, 0, offset, 1)
            item = staged_item(codec_map["StagedCall"].decode(value), pos, len(value), limits,
                               keep_routes=keep_routes)
            buffer.add_staged(item, 1)
    return buffer, buffer.groups[inputs.group_id]


def config_for(mode: str, device: str = "cpu") -> ReassemblyConfig:
    return MODES[mode].model_copy(update={"device": device})


def finalize(group, mode: str, codec_map: dict, dims_cache: RouteDimsCache | None = None,
             device: str = "cpu"):
    """The runtime's finalization task for one group (stage.runtime.task.finalize_task)."""
    from stage.runtime.task.finalize_task import finalize_and_encode
    out = finalize_and_encode(group, "complete", 0, config=config_for(mode, device),
                              dims_cache=dims_cache or RouteDimsCache(), codecs=codec_map,
                              topics=TOPICS, limits=InputLimits(), now_ms=lambda: 0)
    if out.error is not None:
        raise RuntimeError(out.error)
    if out.valid_rows != out.total_rows:
        raise RuntimeError(f"rejected rows in a clean benchmark group: {out.rejections}")
    return out


def decode_and_finalize(inputs: GroupInputs, mode: str, device: str = "cpu") -> tuple[int, float]:
    """One group from its wire records to its encoded outputs (a worker's whole job when the
    decode moves off the poll thread); returns (output bytes, seconds). Picklable for pools."""
    started = time.perf_counter()
    codec_map = _worker_codecs()
    _buffer, group = intake(inputs, codec_map, keep_routes=keeps_routes(mode))
    out = finalize(group, mode, codec_map, device=device)
    return sum(len(v) for _t, v in out.records), time.perf_counter() - started


_CODECS: dict | None = None


def _worker_codecs() -> dict:
    global _CODECS
    if _CODECS is None:
        _CODECS = codecs()
    return _CODECS


def worker_init(torch_threads: int) -> None:
    """A worker process set up as the stage's command line sets itself up."""
    import torch

    from stage.runtime.malloc import tune_malloc
    tune_malloc()
    torch.set_num_threads(torch_threads)


def warm_worker(_index: int = 0) -> int:
    _worker_codecs()
    return os.getpid()


def intake_memory(inputs: GroupInputs, keep_routes: bool) -> tuple[int, int]:
    """(buffered bytes, RSS held) of one group's intake, measured in the calling process: run
    it in a fresh one (``held_by_intake``) so freed memory of earlier work does not hide it."""
    import gc
    codec_map = _worker_codecs()
    gc.collect()
    before = rss_bytes()
    buffer, _group = intake(inputs, codec_map, keep_routes=keep_routes)
    gc.collect()
    return buffer.nbytes, rss_bytes() - before


def held_by_intake(inputs: GroupInputs, keep_routes: bool) -> tuple[int, int]:
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=worker_init, initargs=(1,)) as pool:
        return pool.submit(intake_memory, inputs, keep_routes).result()


# -- anchors ----------------------------------------------------------------------------------

def best_seconds(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def raw_decode_seconds(inputs: GroupInputs, codec_map: dict) -> float:
    """Bare fastavro reads of every input record (no checks, no buffer)."""
    schemas = {RECEIPTS: codec_map["ReceiptEvent"].schema, "staged_calls": codec_map["StagedCall"].schema}

    def read():
        for role, value in inputs.records:
            schemaless_reader(io.BytesIO(value), schemas[role], None)
    return best_seconds(read)


def verify_hash_inputs(group) -> list[bytes]:
    """Exactly the SHA-256 inputs verification of every rollout of the group hashes."""
    out = []
    for index in sorted(group.receipts):
        receipt = RolloutReceipt.from_json(group.receipts[index].receipt)
        snapshots = [staged_row(group.staged[r.staging_key].payload).snapshot for r in receipt.manifest]
        out.extend(hashed_bytes(receipt, snapshots))
    return out


def sha256_seconds(blobs: list[bytes]) -> float:
    return best_seconds(lambda: [hashlib.sha256(b).digest() for b in blobs])


def route_payloads(group) -> list[bytes]:
    out = []
    for item in group.staged.values():
        for name in ("routed_experts", "routed_experts_boundary"):
            tensor = item.payload.get(name)
            if tensor is not None:
                out.append(tensor["data"])
    return out


def base64_sha256_seconds(payloads: list[bytes]) -> float:
    """What the direct-mode integrity check cannot avoid: base64 + SHA-256 of every fragment."""
    return best_seconds(lambda: [hashlib.sha256(pybase64.b64encode(p)).digest() for p in payloads])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min) on {os.cpu_count()} CPUs"
