"""``rollout-reassembler inspect GROUP_ID`` on a real broker: the stage publishes a group with
rejected rows and a misrouted record of it is dead-lettered; inspect finds the group in the
partition its key maps to and reports the summary, every row's status and reason, the staging
keys, the exact coordinates of every input record, and the dead letter."""

from __future__ import annotations

from stage.finalize import ReassemblyConfig
from stage.wire.partitioner import partition_for
from tests.debug.helpers import CoordinateFeeder, run_cli
from tests.integration.harness import (
    RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics,
)


def _published_group(kafka, **overrides):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=3000,
                       finalize=ReassemblyConfig(router_replay=True, defer_routes=True), **overrides)
    setup_topics(cfg, partitions=3)
    spec = make_group("insp", 3, seed=4)
    spec.receipts[1] = dict(spec.receipts[1], receipt=None)             # row 1: missing_receipt
    tampered = spec.staged[-1]                                          # rollout 2's last call
    spec.staged[-1] = dict(tampered, digest="0" * 64)
    feeder = CoordinateFeeder(kafka.bootstrap, topics)
    feeder.staged(spec)
    feeder.receipts(spec)
    home = partition_for(b"insp", 3)
    feeder.send(topics.receipts, b"insp", feeder.receipt_codec.encode(spec.receipts[0]),
                partition=(home + 1) % 3)                               # misrouted: dead-lettered
    feeder.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 60, "publication")
        stage.wait(lambda: read_all(kafka.bootstrap, topics.dead_letter, timeout=2), 30, "the dead letter")
    return cfg, spec, feeder, home


def test_inspect_reports_summary_rows_reasons_staging_keys_and_input_coordinates(kafka, capsys, tmp_path):
    cfg, spec, feeder, home = _published_group(kafka)
    rc, report, _ = run_cli(capsys, cfg, tmp_path, "inspect", "insp")
    assert rc == 0
    assert (report["partition"], report["partitions"]) == (home, 3)
    (summary,) = report["summaries"]
    assert summary["at"]["partition"] == home and summary["outcome"] == "complete"
    assert summary["valid_rows"] == 1 and summary["total_rows"] == 3
    reasons = {r["row_index"]: r["reason"] for r in summary["rejections"]}
    assert reasons[1] == "missing_receipt" and 2 in reasons
    rows = report["rows"]
    assert [r["row_index"] for r in rows] == [0, 1, 2]
    assert [r["valid"] for r in rows] == [True, False, False]
    assert {r["row_index"]: r["rejection_reason"] for r in rows if not r["valid"]} == reasons
    assert all(r["at"]["partition"] == home for r in rows)
    assert sorted(summary["staging_keys"]) == sorted(s["staging_key"] for s in spec.staged
                                                     if not s["staging_key"].startswith("insp-r1/"))
    # every input record, at exactly the coordinates the broker acknowledged (the misrouted copy
    # sits in another partition and is not an input of this group)
    inputs = report["inputs"]
    topics = cfg.topics
    assert sorted((r["at"]["partition"], r["at"]["offset"]) for r in inputs["receipts"]) == \
        [c for c in feeder.where(topics.receipts, b"insp") if c[0] == home]
    assert sorted((r["at"]["partition"], r["at"]["offset"]) for r in inputs["staged_calls"]) == \
        feeder.where(topics.staged_calls, b"insp")
    assert sorted(r["rollout_index"] for r in inputs["receipts"]) == [0, 1, 2]
    assert inputs["staging_keys_not_found"] == []
    assert report["ledger"]["max_receipt_offset"] == max(o for _, o in feeder.where(topics.receipts, b"insp")
                                                         if _ == home)
    # deferred routes: each plan names the staged-calls coordinates of its fragments
    staged_at = {r["staging_key"]: r["at"]["offset"] for r in inputs["staged_calls"]}
    fragments = [f for plan in report["route_plans"] for f in plan["fragments"]]
    assert fragments and all(f["offset"] == staged_at[f["staging_key"]] for f in fragments)
    (dead,) = report["dead_letters"]
    assert dead["error_class"] == "misrouted"
    assert dead["source"] == f"{topics.receipts}[{(home + 1) % 3}]@0"

    rc, text, _ = run_cli(capsys, cfg, tmp_path, "inspect", "insp", as_json=False)
    assert rc == 0
    assert f"group insp: partition {home} of 3" in text
    assert "row 1  REJECTED insp-r1" in text and "missing_receipt" in text
    assert "from " + f"{topics.receipts}[{(home + 1) % 3}]@0 (misrouted" in text


def test_inspect_of_an_unknown_group_says_where_it_looked_and_exits_1(kafka, capsys, tmp_path):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=2)
    rc, text, err = run_cli(capsys, cfg, tmp_path, "inspect", "nobody", as_json=False)
    assert rc == 1 and "summary: none found" in text, err and f"{topics.finalized_groups}[" in text


def test_inspect_builds_its_clients_from_the_stage_config_like_run(kafka, capsys, tmp_path):
    """The ``kafka:`` passthrough (SASL/TLS in production) reaches inspect's clients: SASL
    against this PLAINTEXT broker cannot connect, so the command fails instead of reading."""
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    setup_topics(cfg, partitions=2)
    sasl = stage_config(kafka.bootstrap, topics, kafka={
        "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "p"})
    rc, out, err = run_cli(capsys, sasl, tmp_path, "inspect", "g", as_json=False)
    assert rc == 1 and out == "" and err.startswith("rollout-reassembler inspect: ")
    rc, out, err = run_cli(capsys, cfg, tmp_path, "inspect", "g", as_json=False)
    assert rc == 1 and "summary: none found" in out, err     # the same config without it reads
