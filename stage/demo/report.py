"""The demo's report: a dict (``--json-report``) and its text rendering."""

from __future__ import annotations

import json
import math
from pathlib import Path


def percentiles(values: list[float]) -> dict:
    """count, p50, p90, p99, max (nearest rank), in the values' unit; empty -> count 0."""
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered) - 1e-9) - 1))]

    return {"count": len(ordered), "p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99),
            "max": ordered[-1]}


def _ms(summary: dict) -> str:
    if not summary.get("count"):
        return "none"
    return (f"p50 {summary['p50']:.0f} ms, p90 {summary['p90']:.0f} ms, p99 {summary['p99']:.0f} ms, "
            f"max {summary['max']:.0f} ms ({summary['count']} groups)")


def render(report: dict) -> str:
    w, g, r, t = report["workload"], report["groups"], report["rows"], report["throughput"]
    lines = [
        f"rollout-reassembler demo: {'PASS' if report['ok'] else 'FAIL'}",
        f"broker      {report['broker']}, {report['partitions']} partitions, routes {report['route_mode']}, "
        f"device {report['device']}",
        f"workload    profile {w.get('profile', 'toy')}, seed {w['seed']}: {w['groups']} groups x "
        f"{w['group_size']} rollouts, {w['calls']} model calls "
        f"(turns {w['turns'][0]}-{w['turns'][1]}, retries, side calls), "
        + (f"routes L={w['route_layers']} K={w['route_topk']} {'/'.join(w.get('route_dtypes', ()))}"
           if w["route_layers"] else "no routes")
        + f", media rate {w['media_rate']}, sampler top-k {w['topk']}",
        "faults      " + (", ".join(f"{k} {v}" for k, v in sorted(report["faults_injected"].items())) or "none"),
        f"groups      {g['read']}/{g['expected']} read: {g['complete']} complete, {g['deadline']} at the deadline",
        f"rows        {r['total']} ({r['valid']} valid, {r['placeholders']} placeholders), "
        f"{r['duplicates_dropped']} duplicate records dropped by sample id",
        "rejections  " + (", ".join(f"{k} {v}" for k, v in sorted(report["rejections"].items())) or "none"),
        f"stage       {report['stage']['dead_letters']} dead letters, {report['stage']['late_skipped']} late "
        f"receipts skipped, {report['stage']['transactions_committed']} transactions "
        f"({report['stage']['transactions_aborted']} aborted)",
        f"input       {t['input_records']} records, {t['input_bytes'] / 1e6:.2f} MB; first produced -> last "
        f"complete group read {t['seconds']:.2f} s: "
        f"{t['input_records_per_s']:,.0f} records/s, {t['input_mb_per_s']:.2f} MB/s",
        f"output      {t['groups_per_s']:.1f} groups/s, {t['rows_per_s']:.1f} rows/s, "
        f"{t['canonical_tokens_per_s']:,.0f} canonical tokens/s",
        "latency     last input record produced -> group complete at the reader",
        f"  complete  {_ms(report['latency_ms']['complete_groups'])}",
        f"  deadline  {_ms(report['latency_ms']['deadline_groups'])} (group timeout "
        f"{report['group_timeout_ms']} ms)",
    ]
    fetch = report.get("deferred_routes")
    if fetch:
        lines.append(f"deferred    {fetch['rows']} rows' routes rebuilt from {fetch['fragments_fetched']} inline "
                     f"fragments and {fetch.get('chunks_fetched', 0)} route chunks fetched by Kafka coordinates in "
                     f"{fetch['seconds']:.2f} s"
                     + (f", failures {fetch['failures']}" if fetch["failures"] else ""))
    lines.append("checks")
    for check in report["checks"]:
        lines.append(f"  [{'ok' if check['passed'] else 'FAIL'}] {check['name']}: {check['detail']}")
    if report.get("error"):
        lines.append(f"error       {report['error']}")
    return "\n".join(lines)


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
