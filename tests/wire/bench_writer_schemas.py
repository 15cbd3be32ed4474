"""What a writer schema's ``decimal`` on tensor bytes costs a decode, against the same record
written with our schema (the anchor, measured in the same run). Not a test: a figure.

    PYTHONPATH=$PWD .venv/bin/python -m tests.wire.bench_writer_schemas [--sizes 30000,120000,400000] [--repeat 5]

Each line: the decimal payload's bytes (token_ids_delta.data; the record also carries the
other token columns), the anchor's decode time, the decimal writer's, and their ratio
(1x: the writer's logical type costs nothing; fastavro converting it was quadratic).
"""

from __future__ import annotations

import argparse
import io
import json
import time

import numpy as np
from confluent_kafka.schema_registry import Schema
from fastavro import parse_schema, schemaless_writer

from stage.wire import AvroCodec, pack_tensor, schema_json
from tests.wire.samples import staged_call_record


class _Registry:
    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = texts

    def get_schema(self, schema_id: int) -> Schema:
        return Schema(self.texts[schema_id], "AVRO")


def _writers() -> dict[int, str]:
    ours = json.loads(schema_json("StagedCall"))
    decimal = json.loads(schema_json("StagedCall"))
    decimal["fields"].append({"name": "producer_host", "type": ["null", "string"], "default": None})
    packed = next(f for f in decimal["fields"] if f["name"] == "token_ids_delta")["type"]
    data = next(f for f in packed["fields"] if f["name"] == "data")
    data["type"] = {"type": "bytes", "logicalType": "decimal", "precision": 1 << 20, "scale": 0}
    # the anchor: our schema plus the same added field, so both are resolved the same way
    ours["fields"].append({"name": "producer_host", "type": ["null", "string"], "default": None})
    return {1: json.dumps(ours), 2: json.dumps(decimal)}


def _framed(schema_id: int, text: str, record: dict) -> bytes:
    out = io.BytesIO(b"\x00" + schema_id.to_bytes(4, "big"))
    out.seek(5)
    schemaless_writer(out, parse_schema(json.loads(text), named_schemas={}), record)
    return out.getvalue()


def _best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="30000,120000,400000",
                        help="token payload bytes, comma-separated")
    parser.add_argument("--repeat", type=int, default=5,
                        help="best of this many decodes (1 before the fix: minutes each)")
    args = parser.parse_args()
    texts = _writers()
    codec = AvroCodec("StagedCall", framing="confluent", registry=_Registry(texts))
    for schema_id in texts:   # resolved (and vetted) before anything is timed
        codec.prefetch(schema_id)
    for size in (int(s) for s in args.sizes.split(",")):
        tokens = size // 4
        record = staged_call_record(tokens)
        record["token_ids_delta"] = pack_tensor(np.arange(tokens, dtype=np.uint32))
        anchor, decimal = (_framed(i, texts[i], record) for i in (1, 2))
        t_anchor = _best_of(lambda: codec.decode(anchor), args.repeat)
        t_decimal = _best_of(lambda: codec.decode(decimal), args.repeat)
        print(f"decimal payload {size:>7} bytes (record {len(decimal):>7}): ours "
              f"{t_anchor * 1e3:7.2f} ms, decimal writer {t_decimal * 1e3:10.2f} ms, "
              f"{t_decimal / t_anchor:8.1f}x", flush=True)


if __name__ == "__main__":
    main()
