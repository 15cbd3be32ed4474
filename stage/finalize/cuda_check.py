"""CPU/CUDA parity of whole-group finalization: ``python -m stage.finalize.cuda_check``.

Finalizes the same group (direct router replay, top-k, one placeholder) with tensors on two
devices and asserts every padded training tensor is identical; then runs the route executor's
own parity check. Prints SKIP and exits 0 where CUDA is unavailable (the CPU half still runs).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from stage.contract import encode_routed_experts
from stage.contract.producer import RolloutBuilder
from stage.finalize import InMemoryTokenSource, Reassembler, ReassemblyConfig, TopK, pad_group
from stage.routes import cuda_check as route_check

K = 3


def _group(source: InMemoryTokenSource):
    rng = np.random.default_rng(7)
    ids, receipts = [], []
    for r in range(3):
        builder = RolloutBuilder(f"cuda_g{r}")
        parent = None
        for c in range(3):
            carry, gen = (5 if parent is None else 2), 4
            staged = builder.stage(
                f"c{c}", parent_call_id=parent, prompt_delta=rng.integers(0, 1000, carry),
                generated=rng.integers(0, 1000, gen), generated_logprobs=-rng.random(gen),
                weight_version=3 + c, extras={"routed_experts": encode_routed_experts(
                    rng.integers(0, 64, (carry + gen, 4, 2)), "int8")})
            topk = TopK(rng.integers(0, 1000, (gen, K)).astype(np.int32),
                        -rng.random((gen, K)).astype(np.float32))
            source.stage(staged.record, topk=topk)
            parent = f"c{c}"
        ids.append(builder.rollout_id)
        receipts.append(builder.receipt(parent).to_json())
    return ids + ["cuda_g3"], receipts + [None]


def check_devices(first: str, second: str) -> int:
    source = InMemoryTokenSource()
    ids, receipts = _group(source)
    padded = []
    for device in (first, second):
        cfg = ReassemblyConfig(router_replay=True, top_logprobs=K, device=device)
        group = Reassembler(source, cfg).finalize_group(
            "cuda", ids, receipts, [1.0, 0.0, 0.5, 0.0], mask_sample=[False] * 4,
            fallback_weight_version=0, prompt_idx=0)
        assert group.valid_row_count == 3, [r.rejection_reason for r in group.rows]
        tensors = pad_group(group)
        assert all(t.device.type == torch.device(device).type for t in tensors.values())
        padded.append({k: v.cpu() for k, v in tensors.items()})
    assert padded[0].keys() == padded[1].keys()
    for name in padded[0]:
        assert torch.equal(padded[0][name], padded[1][name]), f"{name} differs between devices"
    return len(padded[0])


def main(argv: list[str] | None = None) -> int:
    count = check_devices("cpu", "cpu")
    if not torch.cuda.is_available():
        print(f"SKIP: CUDA is not available; compared {count} group tensors CPU vs CPU only.")
        return route_check.main([])
    count = check_devices("cpu", "cuda")
    print(f"OK: {count} padded group tensors identical on CPU and CUDA ({torch.cuda.get_device_name()}).")
    return route_check.main([])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
