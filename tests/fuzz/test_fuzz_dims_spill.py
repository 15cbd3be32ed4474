"""Seeded fuzz classes of issue 29: learned route dims and spilled payloads with bit flips
(tests/fuzz/dims_spill.py), driven through the runtime's own intake and ``finalize_and_encode``
like the families of tests/fuzz/test_fuzz.py, with the same seed, case replay and time bound:

    FUZZ_SEED=7 .venv/bin/python -m pytest -q tests/fuzz/test_fuzz_dims_spill.py
    FUZZ_CASE=spilled_bit_flips:12 ...        # replay one case of a failure report

Each class runs 1% of ``FUZZ_CASES`` (at least 10; 40 by default).
"""

from __future__ import annotations

import logging
import random
import warnings
from collections import Counter
from contextlib import contextmanager

from stage.finalize import ReassemblyConfig
from tests.fuzz.dims_spill import (
    DIMS_LIMIT, SpillDriver, check_dims, check_spill, learned_dims, spilled_bit_flips,
)
from tests.fuzz.driver import Driver
from tests.fuzz.invariants import Violation
from tests.fuzz.test_fuzz import CASE_TIMEOUT_S, ONLY, SEED, TOTAL, CaseTimeout, time_bound

SHARE = 0.01


def cases_of(family: str) -> list[int]:
    if ONLY:
        name, index = ONLY.split(":")
        return [int(index)] if name == family else []
    return list(range(max(10, round(TOTAL * SHARE))))


@contextmanager
def quiet():
    """Every rejection and halt logs; hundreds of cases."""
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            yield
    finally:
        logging.disable(logging.NOTSET)


def _report(family: str, violations: list) -> str:
    lines = [f"{len(violations)} violations in {family} (FUZZ_SEED={SEED}); replay one with "
             f"FUZZ_SEED={SEED} FUZZ_CASE={family}:<case>"]
    lines += [f"  case {index}: {v} | {note}" for index, v, note in violations[:12]]
    return "\n".join(lines)


def test_fuzz_learned_dims():
    driver = Driver(ReassemblyConfig(router_replay=True))
    violations, outcomes = [], Counter()
    with quiet():
        for index in cases_of("learned_dims"):
            case = learned_dims(random.Random(f"{SEED}:learned_dims:{index}"))
            try:
                with time_bound(CASE_TIMEOUT_S):
                    result = driver.run(case.wires)
                    found = check_dims(case, result, driver)
            except CaseTimeout as error:
                found, result = [Violation(None, str(error))], None
            violations += [(index, v, case.note) for v in found]
            for published in result.published if result else ():
                outcomes.update(f"rejection:{r}" for r in published.outputs.rejections)
    print(f"\nlearned_dims (FUZZ_SEED={SEED}): outcomes {dict(outcomes.most_common(8))}")
    assert not violations, _report("learned_dims", violations)
    if not ONLY:   # the class still reaches what it aims at
        assert outcomes[f"rejection:{DIMS_LIMIT}"], dict(outcomes)


def test_fuzz_spilled_bit_flips():
    spilling, plain = SpillDriver(), Driver()
    violations, halts, damaged = [], 0, 0
    try:
        with quiet():
            for index in cases_of("spilled_bit_flips"):
                case = spilled_bit_flips(random.Random(f"{SEED}:spilled_bit_flips:{index}"))
                try:
                    with time_bound(CASE_TIMEOUT_S):
                        in_memory = plain.run(case.wires, measure_memory=False)
                        reference = spilling.run(case.wires, measure_memory=False)
                        spilling.damage = (random.Random(case.seed), case.flips)
                        flipped = spilling.run(case.wires, measure_memory=False)
                        found = check_spill(case, reference, in_memory, flipped, spilling)
                except CaseTimeout as error:
                    found, flipped = [Violation(None, str(error))], None
                violations += [(index, v, f"{case.flips} records damaged") for v in found]
                if flipped is not None:
                    halts += len(flipped.halted)
                    damaged += bool(spilling.damaged)
    finally:
        spilling.close()
    print(f"\nspilled_bit_flips (FUZZ_SEED={SEED}): {damaged} cases damaged, {halts} spill halts")
    assert not violations, _report("spilled_bit_flips", violations)
    if not ONLY:
        assert halts, "no damage was ever detected: the class no longer reaches a spilled record"
