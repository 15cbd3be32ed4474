"""Text output of the operator commands (``--json`` prints the data itself)."""

from __future__ import annotations

from datetime import datetime, timezone

def _ts(ms: int | None) -> str:
    """Epoch ms as UTC ISO 8601 with milliseconds."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _at(at: dict) -> str:
    return f"{at['topic']}[{at['partition']}]@{at['offset']}"


def format_report(report: dict) -> list[str]:
    """The report as lines for a person (``--json`` prints the dict itself)."""
    lines = [f"group {report['group_id']}: partition {report['partition']} of {report['partitions']} "
             f"(murmur2 of the key)"]
    if not report["summaries"]:
        lines.append("summary: none found (not finalized yet, or outside the scanned ranges below)")
    for s in report["summaries"]:
        if s["error"]:
            lines.append(f"summary at {_at(s['at'])}: {s['error']}")
            continue
        lines.append(f"summary at {_at(s['at'])}: {s['outcome']}, {s['valid_rows']}/{s['total_rows']} valid "
                     f"rows (group size {s['group_size']}), weight versions {s['group_min_wv']}.."
                     f"{s['group_max_wv']}, {s['canonical_output_tokens']} output tokens")
        lines.append(f"  inputs {_ts(s['first_input_timestamp_ms'])} .. {_ts(s['last_input_timestamp_ms'])}, "
                     f"finalized {_ts(s['finalized_at_ms'])}" + (f", dropped: {s['drop_reason']}"
                                                                  if s["drop_reason"] else ""))
        lines.append(f"  staging keys ({len(s['staging_keys'])}): " + ", ".join(s["staging_keys"]))
    lines.append(f"rows ({len(report['rows'])}):")
    for r in report["rows"]:
        if r["error"]:
            lines.append(f"  {_at(r['at'])}: {r['error']}")
            continue
        status = "valid   " if r["valid"] else "REJECTED"
        reason = f"  {r['rejection_reason']}" if r["rejection_reason"] else ""
        tokens = f"{r['input_lengths']} token" + ("" if r["input_lengths"] == 1 else "s")
        part = f" (part {r['part']['index'] + 1} of {r['part']['count']})" if r.get("part") else ""
        lines.append(f"  row {r['row_index']}{part}  {status} {r['rollout_id']}  {tokens}  "
                     f"reward {r['total_reward']:g}  at {_at(r['at'])}{reason}")
    for plan in report["route_plans"]:
        frags = ", ".join(f"{f['staging_key']} -> {f['topic']}[{f['partition']}]@{f['offset']}"
                          for f in plan.get("fragments", []))
        shown = frags or plan["error"] or "-"
        lines.append(f"  route plan row {plan.get('row_index')} at {_at(plan['at'])}: {shown}")
    ledger = report["ledger"]
    if ledger is None:
        lines.append("ledger: no entry (tombstoned after the late-record retention, or never published)")
    elif ledger["tombstone"]:
        lines.append(f"ledger: tombstone at {_at(ledger['at'])} (the entry expired)")
    else:
        lines.append(f"ledger at {_at(ledger['at'])}: {ledger.get('outcome')}, highest receipt offset "
                     f"{ledger.get('max_receipt_offset')}, highest staged offset "
                     f"{ledger.get('max_staged_offset')}, published {_ts(ledger.get('published_at_ms'))}")
    inputs = report["inputs"]
    lines.append(f"input records ({len(inputs['receipts'])} receipts, "
                 f"{len(inputs['staged_calls'])} staged calls):")
    for r in inputs["receipts"]:
        detail = r["error"] or (f"rollout {r['rollout_index']} {r['rollout_id']}, "
                                + (f"{len(r['staging_keys'])} calls" if r["has_receipt"] else "no receipt")
                                + (", capture poisoned" if r["capture_poisoned"] else ""))
        late = ", after finalization" if r.get("after_finalization") else ""
        lines.append(f"  receipt {_at(r['at'])} {_ts(r['at']['timestamp_ms'])} {r['bytes']:,} B: {detail}{late}")
    for r in inputs["staged_calls"]:
        detail = r["error"] or f"{r['staging_key']} (weight version {r['weight_version']})"
        late = ", after finalization" if r.get("after_finalization") else ""
        lines.append(f"  staged  {_at(r['at'])} {_ts(r['at']['timestamp_ms'])} {r['bytes']:,} B: {detail}{late}")
    if inputs["staging_keys_not_found"]:
        lines.append("  staging keys named but not found in the scanned ranges: "
                     + ", ".join(inputs["staging_keys_not_found"]))
    lines.append(f"dead letters keyed {report['group_id']!r}: {len(report['dead_letters']) or 'none'}")
    for d in report["dead_letters"]:
        lines.append(f"  {_at(d['at'])} from {d['source']} ({d['error_class']}, {d['bytes']:,} B): {d['error']}")
    lines.append("scanned: " + "; ".join(
        f"{s['topic']}[{s['partition']}]@{s['start']}..{s['end'] - 1} ({s['records_read']} read)"
        if s["end"] > s["start"] else f"{s['topic']}[{s['partition']}] (nothing)" for s in report["scanned"]))
    return lines


def marker_target(marker: dict) -> str:
    """Where a replay-log marker says the copy went (``deadletters.read_markers``)."""
    if "unreadable_marker" in marker:
        return (f"? (an unreadable record in the replay log, {marker['unreadable_marker']}, "
                "marks it replayed)")
    to = marker.get("replayed_to") or {}
    return f"{to.get('topic')}[{to.get('partition')}]@{to.get('offset')}"


def source(row: dict) -> str:
    s = row["source"]
    return f"{s['topic']}[{s['partition']}]@{s['offset']}"


def dead_letter_lines(row: dict) -> str:
    """One listed dead letter: its coordinates and source, then its error."""
    d = row["dead_letter"]
    size = "null value" if row["value_bytes"] is None else f"{row['value_bytes']:,} B"
    replayed = row["replayed"]
    state = f"  replayed -> {marker_target(replayed)}" if replayed else ""
    error = (row["error"] or "")[:200]
    return (f"{d['topic']}[{d['partition']}]@{d['offset']} {_ts(d['timestamp_ms'])}  from {source(row)}  "
            f"{row['error_class']}  key {row['key']!r}  {size}{state}\n    {error}")
