"""Seeded fuzz class of issue 29 (items 7 and 8): copies of a row published in parts, as the
trainer's reader meets them. Each case writes one partition's log the way publications and a
broker showing aborted records make it: runs of a split row's parts (each run one copy, its
parts back to back, other tensor bytes per copy), some runs cut short, stale tails of a copy
whose part 0 lies before the reader's start, the group's other rows around them. Whatever the
log, a row handed out is exactly one copy's (never parts of two), and a log holding a whole
run completes the group. Same seed and replay as the other classes:

    FUZZ_SEED=7 .venv/bin/python -m pytest -q tests/fuzz/test_row_part_copies.py
    FUZZ_CASE=row_part_copies:12 ...
"""

from __future__ import annotations

import random

from stage.client import GroupAssembler
from tests.client.test_reader import ROWS
from tests.client.test_row_parts import split_group
from tests.fuzz.test_fuzz import ONLY, SEED, TOTAL

FAMILY = "row_part_copies"
CASES = max(50, round(TOTAL * 0.05))


def _copy(blobs: list[bytes], flip: int) -> list[tuple[dict, bytes]]:
    """A copy of the split row: the same plain fields, token ids XOR ``flip`` (0: the original)."""
    out = []
    for blob in blobs:
        record = ROWS.decode(blob)
        ids = record["input_ids"]
        record["input_ids"] = dict(ids, data=bytes(b ^ flip for b in ids["data"]))
        raw = ROWS.encode(record)
        out.append((ROWS.decode(raw), raw))
    return out


def _case(rng: random.Random, parts):
    """(log, whole copies' token bytes in log order) for one case."""
    split = parts[1]
    runs, whole = [], []
    for flip in rng.sample(range(0, 64), rng.randint(1, 4)):
        run = _copy(split, flip)
        if rng.random() < 0.35:                       # a cut run (an aborted publication)
            run = run[:rng.randint(1, len(run) - 1)]
        runs.append(run)
    if rng.random() < 0.3:                            # a tail before the reader's start
        runs.insert(0, _copy(split, 99)[rng.randint(1, len(split) - 1):])
    others = [(ROWS.decode(b), b) for i in (0, 2) for b in parts[i]]
    log = []
    for run in runs:                                  # runs and whole rows interleave, parts never
        if others and rng.random() < 0.5:
            log.append(others.pop(rng.randrange(len(others))))
        log += run
        if len(run) == len(split) and run[0][0]["row_part"]["index"] == 0:
            whole.append(b"".join(r["input_ids"]["data"] for r, _ in run))
    log += others
    return log, whole


def _cases():
    if ONLY:
        name, index = ONLY.split(":")
        return [int(index)] if name == FAMILY else []
    return range(CASES)


def test_a_row_in_parts_is_always_exactly_one_copy():
    _group, parts = split_group()
    violations = []
    for case in _cases():
        rng = random.Random(f"{SEED}:{FAMILY}:{case}")
        log, whole = _case(rng, parts)
        assembler = GroupAssembler()
        done = [g for offset, (record, raw) in enumerate(log)
                if (g := assembler.add_row(record, raw, ("rows", 0, offset))) is not None]
        if whole and len(done) != 1:
            violations.append(f"case {case}: a whole copy was in the log, {len(done)} groups handed out")
        for group in done:
            got = group.records[1]["input_ids"]["data"]
            if got not in whole:
                violations.append(f"case {case}: the row handed out is no copy's (parts of two mixed?)")
            elif got != whole[0]:
                violations.append(f"case {case}: a later copy replaced the first whole one")
    assert violations == [], (f"{len(violations)} violations (FUZZ_SEED={SEED}; replay with "
                              f"FUZZ_CASE={FAMILY}:<case>): {violations[:5]}")
