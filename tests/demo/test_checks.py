"""The demo's checks can fail: each one catches the discrepancy it exists for (no broker)."""

import dataclasses
from collections import Counter

from stage.client import GroupAssembler
from stage.demo import checks as C
from stage.demo.report import percentiles
from stage.finalize import ReassemblyConfig
from stage.publish.records import row_record
from stage.wire import AvroCodec, TopicNames
from stage.workload import FaultRates, WorkloadConfig, generate

TOPICS = TopicNames()
CONFIG = ReassemblyConfig(router_replay=True, staging_partition=TOPICS.staged_calls)
ROWS = AvroCodec("CanonicalRow")
WORKLOAD = generate(WorkloadConfig(groups=4, group_size=3, turns=(1, 3), seed=2,
                                   faults=FaultRates(poisoned_receipt=0.3, tampered_digest=0.3)))


def _read(mutate=None):
    """What a perfect stage + reader would hand over: the recomputed rows through the codec."""
    recomputed = {g.group_id: C.recompute_group(g, CONFIG, staged_topic=TOPICS.staged_calls)
                  for g in WORKLOAD.groups}
    read = {}
    for group_id, group in recomputed.items():
        assembler = GroupAssembler()
        for row in group.rows:
            record = row_record(row)
            if mutate:
                record = mutate(record)
            done = assembler.add_row(ROWS.decode(ROWS.encode(record)))
        read[group_id] = done
    return recomputed, read


def test_a_faithful_run_passes_every_check():
    recomputed, read = _read()
    assert C.check_groups(WORKLOAD, read, Counter()).passed
    assert C.check_rejections(WORKLOAD, read, TOPICS.staged_calls).passed
    assert C.check_rows_equal(WORKLOAD, read, recomputed).passed
    assert C.check_padded_tensors(WORKLOAD, read, recomputed, device="cpu").passed
    assert sum(1 for r in WORKLOAD.rollouts if r.fault) >= 2


def test_a_changed_token_fails_row_equality_and_padded_tensors():
    def bump(record):
        if record["row_index"] == 0 and record["valid"]:
            ids = bytearray(record["input_ids"]["data"])
            ids[-8] ^= 1
            return dict(record, input_ids=dict(record["input_ids"], data=bytes(ids)))
        return record
    recomputed, read = _read(bump)
    rows = C.check_rows_equal(WORKLOAD, read, recomputed)
    assert not rows.passed and "input_ids" in rows.detail
    assert not C.check_padded_tensors(WORKLOAD, read, recomputed, device="cpu").passed


def test_a_wrong_reason_or_a_missing_group_is_reported():
    _, read = _read(lambda r: dict(r, rejection_reason="capture_poisoned") if not r["valid"] else r)
    digest_faults = sum(1 for r in WORKLOAD.rollouts if r.fault == "tampered_digest")
    check = C.check_rejections(WORKLOAD, read, TOPICS.staged_calls)
    assert not check.passed and len(check.failures) == digest_faults and "wrong_digest" in check.detail
    _, read = _read()
    read.pop(WORKLOAD.groups[0].group_id)
    groups = C.check_groups(WORKLOAD, read, Counter(conflicts=1))
    assert not groups.passed and "never completed" in groups.detail and "conflicts" in groups.detail


def test_summaries_dead_letters_and_late_receipts_are_counted_exactly():
    summaries = {g.group_id: {"outcome": "complete", "total_rows": 3,
                              "valid_rows": sum(1 for r in g.rollouts if r.fault is None)}
                 for g in WORKLOAD.groups}
    assert C.check_summaries(WORKLOAD, summaries).passed
    first = WORKLOAD.groups[0].group_id
    assert not C.check_summaries(WORKLOAD, dict(summaries, **{first: dict(summaries[first], outcome="deadline")})).passed
    garbage = dataclasses.replace(WORKLOAD.config, faults=FaultRates(garbage=1.0, late_receipt=0.5))
    workload = generate(dataclasses.replace(garbage, groups=3))
    letters = [(g.value, [("source-topic", getattr(TOPICS, g.topic_role).encode())])
               for group in workload.groups for g in group.garbage]
    assert C.check_dead_letters(workload, letters, TOPICS).passed
    assert not C.check_dead_letters(workload, letters[1:], TOPICS).passed
    assert not C.check_dead_letters(workload, letters + [(b"other", [])], TOPICS).passed
    late = sum(1 for r in workload.rollouts if r.late)
    assert late and C.check_late_receipts(workload, late).passed
    assert not C.check_late_receipts(workload, late - 1).passed


def test_percentiles_nearest_rank():
    assert percentiles([]) == {"count": 0}
    summary = percentiles([float(v) for v in range(1, 101)])
    assert (summary["p50"], summary["p90"], summary["p99"], summary["max"]) == (50.0, 90.0, 99.0, 100.0)
