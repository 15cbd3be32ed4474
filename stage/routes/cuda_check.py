"""CPU/CUDA parity check for the route executor: ``python -m stage.routes.cuda_check``.

Executes a handful of plans (full, tail, sentinel, boundary repair, int8/int32 staging,
an integrity failure) plus a group tensor on two devices and asserts identical results.
Exits 0 with a SKIP line when CUDA is unavailable (the CPU half still runs).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from stage.contract import compute_extras_digest, encode_routed_experts
from stage.routes.constants import ROUTE_ENCODING_ENVELOPE, ROUTE_ENCODING_LIST
from stage.routes.executor import RouteDimsCache, build_group_route_tensor, execute_route_plan
from stage.routes.fragment import RouteFragment, encode_extras_metadata_json
from stage.routes.plan import RouteAssemblyPlan, RouteSpan


def _stage(values, dtype="int16", encoding=ROUTE_ENCODING_ENVELOPE, boundary=None, index=None):
    extras: dict = {}
    if encoding == ROUTE_ENCODING_LIST:
        extras["routed_experts"] = values.tolist()
        tensor = torch.tensor(values.tolist(), dtype=torch.int16)
    else:
        extras["routed_experts"] = encode_routed_experts(values, dtype=dtype)
        tensor = torch.from_numpy(values.astype(dtype))
    sidecar = None
    if boundary is not None:
        extras["routed_experts_boundary"] = encode_routed_experts(boundary, dtype=dtype)
        extras["routed_experts_boundary_index"] = index
        sidecar = torch.from_numpy(boundary.astype(dtype))
    fragment = RouteFragment(tensor, encoding, encode_extras_metadata_json(extras), sidecar)
    return fragment, compute_extras_digest(extras)


def _cases(layers=3, topk=4):
    rng = np.random.default_rng(0)

    def r(rows, hi=120):
        return rng.integers(0, hi, size=(rows, layers, topk))

    root, root_d = _stage(r(6), dtype="int8")
    child, child_d = _stage(r(5), dtype="int32", boundary=r(1), index=5)
    lst, lst_d = _stage(r(4), encoding=ROUTE_ENCODING_LIST)
    tail, tail_d = _stage(r(9))
    frags = {"a": root, "b": child, "c": lst, "d": tail}
    keys = tuple(frags) + ("e",)
    spans = [
        RouteSpan("a", 3, 3, 6, 1, root_d),
        RouteSpan("b", 2, 3, 5, 1, child_d, 5, True),
        RouteSpan("c", 1, 3, 4, 1, lst_d),
        RouteSpan("d", 2, 4, 9, 1, tail_d),  # tail
        RouteSpan("e", 1, 1, 0, 1, "0" * 64),  # sentinel
    ]
    plans = [RouteAssemblyPlan(3, "p", tuple(spans[:k]), keys, sum(s.carry_len + s.generation_len for s in spans[:k]))
             for k in range(1, len(spans) + 1)]
    tampered = dict(frags, a=RouteFragment(root.routes + 1, root.encoding, root.extras_metadata_json))
    return [(p, frags) for p in plans] + [(plans[-1], tampered)], (layers, topk)


def check_devices(first: str, second: str) -> int:
    """Run every case on both devices; raise AssertionError on any difference."""
    cases, dims = _cases()
    outputs = []
    for plan, frags in cases:
        results = [execute_route_plan(plan, frags, dims=dims, canonical_len=plan.expected_token_length, device=d)
                   for d in (first, second)]
        (t1, r1), (t2, r2) = results
        assert r1 == r2, f"failure reasons differ: {r1!r} vs {r2!r}"
        if t1 is not None:
            assert t1.device.type == torch.device(first).type and t2.device.type == torch.device(second).type
            assert t1.dtype == t2.dtype == torch.int16
            assert torch.equal(t1.cpu(), t2.cpu()), "assembled routes differ between devices"
            outputs.append(t1.cpu())
    # Guard against a vacuous pass: only the tampered case may fail.
    assert len(outputs) == len(cases) - 1, f"only {len(outputs)} of {len(cases) - 1} plans assembled"
    lengths = [len(t) for t in outputs]
    groups = [build_group_route_tensor(outputs + [None], lengths + [0], RouteDimsCache(),
                                       valid=[True] * len(outputs) + [False], device=d) for d in (first, second)]
    assert torch.equal(groups[0][0].cpu(), groups[1][0].cpu()) and groups[0][1] == groups[1][1]
    return len(cases) + 1


def main(argv: list[str] | None = None) -> int:
    count = check_devices("cpu", "cpu")
    if not torch.cuda.is_available():
        print(f"SKIP: CUDA is not available; ran {count} route checks on CPU only (no CPU/CUDA comparison).")
        return 0
    count = check_devices("cpu", "cuda")
    print(f"OK: {count} route checks identical on CPU and CUDA ({torch.cuda.get_device_name()}).")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
