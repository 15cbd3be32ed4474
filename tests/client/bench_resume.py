"""CPU of judging a resume (stage.client.resume_chain, no Kafka): one agentic-moe-sized rollout,
64 calls and ~32k tokens, its StagedCall values decoded as the resumer reads them (routes by
reference: the records carry no route bytes), taken through the stage's intake, conversion and
verification to the rehydrated builder; next to what regenerating its tokens would take at a
decode speed. Worst case too: the last call corrupt, so the chain is cut one call short (two
verifications). Prints times, asserts nothing.

    PYTHONPATH=$PWD .venv/bin/python -m tests.client.bench_resume [--calls 64] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from stage.buffer import Position
from stage.client import RolloutStager
from stage.client.resume_chain import StagedRecord, held_calls, longest_verified, rehydrate
from stage.wire import AvroCodec

CODEC = AvroCodec("StagedCall")


def rollout(calls: int, tokens: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    stager, parent, out = RolloutStager(None, "g", "g-r0"), None, []
    per = tokens // calls
    for c in range(calls):
        prompt, gen = (per // 2, per - per // 2)
        prepared = stager.prepare(f"c{c}", parent_call_id=parent, prompt_delta=rng.integers(0, 150_000, prompt),
                                  generated=rng.integers(0, 150_000, gen), generated_logprobs=-rng.random(gen),
                                  weight_version=7)
        out.append(CODEC.encode(prepared.value))
        parent = f"c{c}"
    return out


def judge(raw: list[bytes]) -> tuple[float, int]:
    started = time.perf_counter()
    records = [StagedRecord(CODEC.decode(b), Position("staged", 0, i, 0), len(b)) for i, b in enumerate(raw)]
    candidates, dropped, conflicts = held_calls(records, "g", "g-r0")
    verdict = longest_verified("g-r0", candidates, dropped, conflicts)
    rehydrate("g-r0", verdict.calls)
    return time.perf_counter() - started, len(verdict.linearized.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--decode-tokens-per-s", type=float, default=50.0)
    args = parser.parse_args()
    raw = rollout(args.calls, args.tokens)
    judge(raw)   # warm-up
    took, reused = min(judge(raw) for _ in range(3))
    print(f"resume of one rollout ({args.calls} calls, {reused} tokens): {took * 1e3:.1f} ms; "
          f"regenerating it at {args.decode_tokens_per_s:g} tokens/s: {reused / args.decode_tokens_per_s:.0f} s")
    value = CODEC.decode(raw[-1])
    ids = value["token_ids_delta"]
    tampered = np.frombuffer(ids["data"], dtype=ids["dtype"]).copy()
    tampered[0] += 1
    raw[-1] = CODEC.encode({**value, "token_ids_delta": {**ids, "data": tampered.tobytes()}})
    took, reused = min(judge(raw) for _ in range(3))
    print(f"the last call corrupt: {took * 1e3:.1f} ms, {reused} tokens reused")


if __name__ == "__main__":
    main()
