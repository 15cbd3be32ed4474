"""Verification before and after a change, interleaved round-robin in one process (issue 31).

    git archive main stage schemas | tar -x -C /tmp/perf_base
    PYTHONPATH=$PWD .venv/bin/python tools/perf/verify_before_after.py /tmp/perf_base/stage/contract

"before" is another tree's stage/contract loaded as the package ``contract_before`` (it imports
only itself); "after" is this tree's, with stage._native and with its Python loops
(``_native`` set to None). Every case is built once and converted into each package's own
records through JSON. CPU time, best of 15 rounds of 50 calls; the anchor is bench verify's
SHA-256 of the same bytes. "stage path": the receipt parsed + verify with the digests checked
at conversion, on rows ``select``ed from a pack (what the stage runs per rollout).
"""
import hashlib, importlib.util, sys, time
from stage.runtime.malloc import tune_malloc; tune_malloc()
from stage.bench.machine import machine_info, machine_line
from stage.bench.verify import build_rollout, hashed_bytes, profile_cases
import stage.contract as new
import stage.contract.linearized as new_linearized
import stage.contract.packed as new_packed
import stage.contract.verify as new_verify
BASE = sys.argv[1]   # e.g. /tmp/perf_base/stage/contract
spec = importlib.util.spec_from_file_location("contract_before", f"{BASE}/__init__.py",
                                              submodule_search_locations=[BASE])
old = importlib.util.module_from_spec(spec); sys.modules["contract_before"] = old; spec.loader.exec_module(old)
import contract_before.packed as old_packed
assert new_packed._native is not None, "stage._native is not built"
ROUNDS = 15
print(machine_line(machine_info()))
cases = [("large",) + build_rollout(calls=64, root_prompt=512, carry=256, generated=256)]
cases += [c for c in profile_cases("agentic-moe")[1] if c[0] in ("shortest", "typical")]

def native(on):
    module = sys.modules["stage._native"] if on else None
    new_packed._native = new_verify._native = new_linearized._native = module

def variants(receipt, snaps):
    out = {}
    for name, pkg, packed_mod, on in (("before", old, old_packed, None), ("after", new, new_packed, True),
                                      ("after, Python loops", new, new_packed, False)):
        r = pkg.RolloutReceipt.from_json(receipt.to_json())
        s = [pkg.StagedCallBaseSnapshot.from_json(x.to_json()) for x in snaps]
        raw, pack, rows = r.to_json(), packed_mod.PackedRows.try_pack(s), list(range(len(s)))
        def verify(pkg=pkg, r=r, s=s, on=on):
            if on is not None: native(on)
            pkg.verify_and_linearize(r, s)
        def stage(pkg=pkg, s=s, raw=raw, pack=pack, rows=rows, on=on):
            if on is not None: native(on)
            pkg.verify_and_linearize(pkg.RolloutReceipt.from_json(raw), s, digests_verified=True,
                                     packed=pack.select(rows))
        out[name] = (verify, stage)
    return out

for case, receipt, snaps in cases:
    inputs = hashed_bytes(receipt, snaps)
    fns = {"sha256": lambda: [hashlib.sha256(b).digest() for b in inputs]}
    for name, (verify, stage) in variants(receipt, snaps).items():
        fns[f"{name}: bench verify"] = verify
        fns[f"{name}: stage path"] = stage
    for fn in fns.values(): fn()
    best = dict.fromkeys(fns, 1e9)
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            t = time.process_time()
            for _ in range(50): fn()
            best[name] = min(best[name], (time.process_time() - t) / 50)
    native(True)
    h = best["sha256"]
    tokens = len(new.verify_and_linearize(receipt, snaps).token_ids)
    print(f"{case}: {len(snaps)} calls, {tokens} tokens, SHA-256 only {h * 1e3:.3f} ms")
    for name, t in best.items():
        if name != "sha256":
            print(f"  {name:34} {t * 1e3:7.3f} ms  ratio {h / t:.2f}")
