"""What the demo checks, against an independent recomputation (no Kafka here).

The recomputation finalizes each group with ``stage.finalize.GroupFinalizer`` over an
``InMemoryTokenSource`` fed the workload's own Gym records (faults applied as the transport
applied them), exactly what the stage would compute without any of the Kafka path: decode,
buffering, deadlines, transactions, the reader.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from stage.finalize import FinalizedGroup, GroupFinalizer, InMemoryTokenSource, ReassemblyConfig, pad_group
from stage.publish.records import plan_record, row_record
from stage.routes import RouteDimsCache
from stage.workload import GroupSpec, Workload

MAX_LISTED = 5


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "detail": self.detail,
                "failures": self.failures[:MAX_LISTED], "failure_count": len(self.failures)}


def _check(name: str, failures: list[str], ok_detail: str) -> Check:
    if failures:
        shown = "; ".join(failures[:MAX_LISTED])
        more = f" (+{len(failures) - MAX_LISTED} more)" if len(failures) > MAX_LISTED else ""
        return Check(name, False, f"{len(failures)} failure(s): {shown}{more}", failures)
    return Check(name, True, ok_detail)


def recompute_group(group: GroupSpec, config: ReassemblyConfig, *, staged_topic: str,
                    dims_cache: RouteDimsCache | None = None) -> FinalizedGroup:
    """The group as the library finalizes it from the workload's records (no Kafka)."""
    source = InMemoryTokenSource(partition=staged_topic)
    for rollout in group.rollouts:
        for record, call in rollout.staged_records():
            source.stage(record, media=call.media, topk=call.topk)
    ids, receipts, rewards = [], [], []
    for rollout in group.rollouts:
        if rollout.late:  # at the deadline the stage knows nothing of this rollout
            ids.append(f"{group.group_id}_g{rollout.rollout_index}")
            receipts.append(None)
            rewards.append(0.0)
        else:
            ids.append(rollout.rollout_id)
            receipts.append(rollout.emitted_receipt())
            rewards.append(rollout.reward)
    n = group.group_size
    return GroupFinalizer(source, config, dims_cache).finalize_group(
        group.group_id, ids, receipts, rewards, mask_sample=[False] * n,
        fallback_weight_version=0, prompt_idx=group.prompt_idx)


def _without_reason(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "rejection_reason"}


def _differing(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_groups(workload: Workload, read: dict, counts: Counter) -> Check:
    """Every group read once, with exactly N rows (sample ids g0..g{N-1}), nothing else."""
    failures = []
    expected = {g.group_id: g for g in workload.groups}
    for group_id in sorted(set(expected) - set(read)):
        failures.append(f"group {group_id} never completed")
    for group_id in sorted(set(read) - set(expected)):
        failures.append(f"unexpected group {group_id}")
    for group_id, got in read.items():
        spec = expected.get(group_id)
        if spec is None:
            continue
        ids = [row.sample_id for row in got.rows]
        want = [f"{group_id}_g{i}" for i in range(spec.group_size)]
        if ids != want:
            failures.append(f"group {group_id}: rows {ids}, expected {want}")
    for name in ("conflicts", "invalid"):
        if counts.get(name):
            failures.append(f"{counts[name]} {name} row record(s) at the reader")
    rows = sum(len(g.rows) for g in read.values())
    return _check("exactly_n_rows", failures,
                  f"{len(read)} groups, {rows} rows, exactly N each "
                  f"({counts.get('duplicates', 0)} duplicate record(s) dropped by sample id)")


def check_rejections(workload: Workload, read: dict, staged_topic: str) -> Check:
    """Every faulted rollout's row carries the reason its fault must cause; every clean
    rollout's row is valid."""
    failures, checked = [], 0
    for spec in workload.groups:
        got = read.get(spec.group_id)
        if got is None:
            continue
        for rollout, row in zip(spec.rollouts, got.rows):
            checked += 1
            expected = rollout.expected_rejection(staged_topic)
            if expected is None:
                if not row.valid:
                    failures.append(f"{row.sample_id}: clean rollout rejected: {row.rejection_reason}")
            elif row.valid:
                failures.append(f"{row.sample_id}: {rollout.fault} not rejected (expected {expected})")
            elif not expected.matches(row.rejection_reason):
                failures.append(f"{row.sample_id}: {rollout.fault}: reason {row.rejection_reason!r}, "
                                f"expected {expected}")
    faulted = sum(1 for r in workload.rollouts if r.fault)
    return _check("rejection_reasons", failures,
                  f"{checked} rows: {faulted} faulted rollouts rejected with the expected reason, "
                  "every clean rollout valid")


def check_rows_equal(workload: Workload, read: dict, recomputed: dict) -> Check:
    """Every published row equals the recomputation (placeholders: all but their reason,
    which ``check_rejections`` judges)."""
    failures, valid = [], 0
    for spec in workload.groups:
        got, want = read.get(spec.group_id), recomputed.get(spec.group_id)
        if got is None or want is None:
            continue
        if want.dropped:
            failures.append(f"group {spec.group_id}: recomputation dropped it ({want.drop_reason})")
            continue
        for published, row in zip(got.records, want.rows):
            expected = row_record(row)
            if row.valid != published["valid"]:
                failures.append(f"{row.sample_id}: valid={published['valid']}, recomputed {row.valid}")
                continue
            if row.valid:
                valid += 1
                if published != expected:
                    failures.append(f"{row.sample_id}: differs in {_differing(published, expected)}")
            elif _without_reason(published) != _without_reason(expected):
                failures.append(f"{row.sample_id} (placeholder): differs in "
                                f"{_differing(_without_reason(published), _without_reason(expected))}")
    return _check("rows_equal_recomputation", failures,
                  f"{valid} valid rows byte-identical to the library's recomputation; placeholders too")


def check_plans_equal(workload: Workload, read: dict, recomputed: dict) -> Check:
    """Deferred mode: every published RoutePlan equals the recomputed row's plan (where each
    span's routes are aside: a StagedCall's Kafka coordinates, or the chunks a reference names,
    which ``check_padded_tensors`` exercises by fetching)."""
    failures, count = [], 0
    for spec in workload.groups:
        got, want = read.get(spec.group_id), recomputed.get(spec.group_id)
        if got is None or want is None or got.plans is None:
            continue
        for plan, row in zip(got.plans, want.rows):
            count += 1
            published = {**plan, "spans": [{**s, "fragment": None, "chunks": None} for s in plan["spans"]]}
            if published != plan_record(row, {}):
                failures.append(f"{row.sample_id}: route plan differs")
            missing = [s["staging_key"] for s in plan["spans"]
                       if s["staged_route_len"] > 0 and (s["fragment"] is None) == (s.get("chunks") is None)]
            if missing:
                failures.append(f"{row.sample_id}: spans without exactly one of coordinates and chunks: {missing}")
    return _check("route_plans_equal_recomputation", failures, f"{count} route plans equal")


def check_padded_tensors(workload: Workload, read: dict, direct: dict, *, device) -> Check:
    """The reader's padded training tensors equal ``pad_group`` of the recomputation with
    direct routes (in deferred mode: the routes the fetcher rebuilt from Kafka coordinates)."""
    failures = []
    for spec in workload.groups:
        got, want = read.get(spec.group_id), direct.get(spec.group_id)
        if got is None or want is None or want.dropped:
            continue
        ours = got.tensors(device=device)
        theirs = pad_group(want, device=device)
        if ours.keys() != theirs.keys():
            failures.append(f"group {spec.group_id}: tensors {sorted(ours)} vs {sorted(theirs)}")
            continue
        for name, tensor in ours.items():
            if tensor.shape != theirs[name].shape or not torch.equal(tensor, theirs[name]):
                failures.append(f"group {spec.group_id}: {name} differs")
    return _check("padded_tensors_equal_recomputation", failures,
                  f"{len(read)} groups padded to NeMo RL training tensors, equal to pad_group of the "
                  "recomputation")


def check_summaries(workload: Workload, summaries: dict) -> Check:
    """One GroupSummary per group: expected outcome (complete, or deadline when a staged row or
    receipt never came in time), N rows, the valid count of clean rollouts."""
    failures = []
    for spec in workload.groups:
        summary = summaries.get(spec.group_id)
        if summary is None:
            failures.append(f"group {spec.group_id}: no summary")
            continue
        clean = sum(1 for r in spec.rollouts if r.fault is None)
        got = (summary["outcome"], summary["total_rows"], summary["valid_rows"])
        want = (spec.expected_outcome, spec.group_size, clean)
        if got != want:
            failures.append(f"group {spec.group_id}: (outcome, rows, valid) {got}, expected {want}")
    outcomes = Counter(s["outcome"] for s in summaries.values())
    return _check("group_summaries", failures,
                  ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items())) or "none")


def check_dead_letters(workload: Workload, letters: list, topics) -> Check:
    """Every garbage record, and nothing else, reached the dead-letter topic untouched, with
    its source topic in the headers."""
    want = Counter((getattr(topics, g.topic_role), g.value) for spec in workload.groups
                   for g in spec.garbage)
    got = Counter()
    for value, headers in letters:
        source = dict(headers or []).get("source-topic", b"").decode("utf-8", "replace")
        got[(source, value or b"")] += 1
    failures = [f"missing from the dead-letter topic: {n} x {v[:16]!r} from {t}"
                for (t, v), n in (want - got).items()]
    failures += [f"unexpected dead letter: {n} x {v[:16]!r} from {t}" for (t, v), n in (got - want).items()]
    return _check("dead_letters", failures,
                  f"{sum(want.values())} garbage records dead-lettered with their bytes and source topic")


def check_late_receipts(workload: Workload, skipped_late: float) -> Check:
    late = sum(1 for r in workload.rollouts if r.late)
    failures = [] if skipped_late >= late else [
        f"the stage counted {int(skipped_late)} late receipts, {late} were sent"]
    return _check("late_receipts", failures,
                  f"{late} late receipts counted and skipped by the stage, none republished")


def check_sdk(mismatches: list[str], calls: int) -> Check:
    return _check("sdk_coordinates", mismatches,
                  f"{calls} CallRecords from the SDK equal the workload's own (digests, chain and "
                  "cumulative hashes)")


def check_route_fetches(failures: Counter, rows: int) -> Check:
    listed = [f"{n} x {reason}" for reason, n in sorted(failures.items())]
    return _check("deferred_route_fetch", listed,
                  f"{rows} rows' routes rebuilt from staged fragments fetched by Kafka coordinates "
                  "(inline) or route chunks (by reference)")
