"""`rollout-reassembler demo` end to end on a small workload with every fault, on the embedded
Tansu broker (the command line, direct and deferred router replay) and on the real broker."""

import json

import pytest

from stage.cli import _parser, main
from stage.cli.demo import options
from stage.demo import DemoOptions, run_demo
from stage.workload import GARBAGE, ROLLOUT_FAULTS, FaultRates, WorkloadConfig, generate

# seed 2: every fault kind occurs at least once in these 10 groups (asserted below)
WORKLOAD = WorkloadConfig(groups=10, group_size=3, media_rate=0.2, topk=2, seed=2,
                          faults=FaultRates.uniform(0.1, garbage=0.3))
SMALL = ["--groups", "10", "--group-size", "3", "--seed", "2", "--fault-rate", "0.1", "--fault",
         "garbage=0.3", "--media-rate", "0.2", "--sampler-topk", "2", "--group-timeout-ms", "1500",
         "--no-progress"]
CHECKS = {"sdk_coordinates", "exactly_n_rows", "rejection_reasons", "rows_equal_recomputation",
          "padded_tensors_equal_recomputation", "group_summaries", "dead_letters", "late_receipts"}


def _assert_passed(report: dict) -> None:
    failed = [c for c in report["checks"] if not c["passed"]]
    assert report["ok"] and not failed, failed
    counts = generate(WORKLOAD).fault_counts()
    assert set(counts) == {*ROLLOUT_FAULTS, GARBAGE}          # the run exercised every fault
    assert report["groups"] == {"expected": 10, "read": 10, "complete": report["groups"]["complete"],
                                "deadline": report["groups"]["deadline"]}
    assert report["groups"]["deadline"] > 0 and report["groups"]["complete"] > 0
    assert report["rows"]["total"] == 30
    faulted = sum(v for k, v in counts.items() if k != GARBAGE)
    assert report["rows"]["placeholders"] == faulted
    assert report["stage"]["dead_letters"] == counts[GARBAGE]
    assert report["stage"]["late_skipped"] == counts["late_receipt"]
    assert report["latency_ms"]["complete_groups"]["count"] == report["groups"]["complete"]


def test_demo_command_on_the_embedded_broker_writes_a_passing_json_report(tansu, tmp_path, capsys):
    assert options(_parser().parse_args(["demo", *SMALL])).workload == WORKLOAD
    path = tmp_path / "report.json"
    # --bootstrap-servers points at the session's Tansu so the test does not start a second one
    code = main(["demo", *SMALL, "--bootstrap-servers", tansu.bootstrap, "--json-report", str(path)])
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert code == 0, out
    assert out.startswith("rollout-reassembler demo: PASS")
    assert {c["name"] for c in report["checks"]} == CHECKS
    _assert_passed(report)


def test_demo_with_deferred_router_replay_on_tansu(tansu):
    report = run_demo(DemoOptions(workload=WORKLOAD, bootstrap_servers=tansu.bootstrap,
                                  route_mode="deferred", group_timeout_ms=1500, progress=False))
    _assert_passed(report)
    names = {c["name"] for c in report["checks"]}
    assert names == CHECKS | {"route_plans_equal_recomputation", "deferred_route_fetch"}
    assert report["deferred_routes"]["failures"] == {} and report["deferred_routes"]["rows"] == 30


def test_demo_on_the_real_broker(kafka):
    report = run_demo(DemoOptions(workload=WORKLOAD, bootstrap_servers=kafka.bootstrap,
                                  group_timeout_ms=1500, progress=False))
    _assert_passed(report)


def test_demo_exits_non_zero_when_a_check_fails(monkeypatch, capsys):
    failing = {"ok": False, "checks": [{"name": "x", "passed": False, "detail": "broken"}]}
    monkeypatch.setattr("stage.demo.run_demo", lambda opts: failing)
    monkeypatch.setattr("stage.demo.render", lambda report: "rendered FAIL")
    assert main(["demo", "--no-progress"]) == 1
    assert "rendered FAIL" in capsys.readouterr().out
    assert main(["demo", "--fault", "bogus=1"]) == 2


def test_embedded_broker_is_the_default(monkeypatch):
    started = []

    class Broker:
        bootstrap = "127.0.0.1:1"

        def start(self):
            started.append(True)
            return self

        def stop(self):
            started.append(False)

    class Stop(Exception):
        pass

    def no_run(self, bootstrap, bar):
        assert bootstrap == "127.0.0.1:1"
        raise Stop

    monkeypatch.setattr("stage.brokers.embedded.TansuBroker", Broker)
    monkeypatch.setattr("stage.demo.run.Demo._run", no_run)
    with pytest.raises(Stop):
        run_demo(DemoOptions(workload=WorkloadConfig(groups=1), progress=False))
    assert started == [True, False]


def test_produce_only_feeds_the_standard_topic_layout_for_a_stage_running_elsewhere(tansu):
    from stage.demo import DemoOptions, run_demo
    from stage.workload import FaultRates, WorkloadConfig
    from stage.wire import AvroCodec
    from tests.integration.harness import read_all
    opts = DemoOptions(workload=WorkloadConfig(groups=3, group_size=2, seed=5, faults=FaultRates()),
                       bootstrap_servers=tansu.bootstrap, topic_prefix="po", produce_only=True,
                       progress=False, route_mode="direct")
    from confluent_kafka.admin import AdminClient
    from stage.config.model import StageConfig
    from stage.runtime.kafka.topics import create_topics
    from stage.wire import TopicNames
    topics = TopicNames(**{k: f"po.{v}" for k, v in TopicNames().all().items()})
    create_topics(AdminClient({"bootstrap.servers": tansu.bootstrap}),
                  StageConfig(bootstrap_servers=tansu.bootstrap, topics=topics), partitions=1,
                  replication=1, min_insync_replicas=1)
    report = run_demo(opts)
    assert report["mode"] == "produce-only" and report["groups"] == 3 and report["ok"]
    receipts = [AvroCodec("ReceiptEvent").decode(m.value())
                for m in read_all(tansu.bootstrap, topics.receipts, expect=6, timeout=20)]
    assert sorted((r["group_id"], r["rollout_index"]) for r in receipts) == sorted(
        (g, i) for g in {r["group_id"] for r in receipts} for i in range(2))
    assert len({r["group_id"] for r in receipts}) == 3
    staged = read_all(tansu.bootstrap, topics.staged_calls, timeout=10)
    chunks = read_all(tansu.bootstrap, topics.staged_routes, timeout=10)    # routes by reference
    assert chunks and all(s.value() for s in staged)
    assert len(staged) + len(chunks) + 6 == report["input_records"]


def test_a_scaled_down_frontier_demo_on_the_real_broker(kafka):
    """The frontier profile's route dims (40x22 int16 of 512 experts) through the whole system,
    deferred router replay, on short rollouts (the full profile is ~0.9 GB of routes a group)."""
    from stage.workload import FaultRates, profile
    workload = profile("frontier", groups=2, group_size=3, rollout_tokens=(600, 1_200),
                       prompt_tokens=(64, 128), turns=(3, 4), faults=FaultRates())
    report = run_demo(DemoOptions(workload=workload, profile="frontier", bootstrap_servers=kafka.bootstrap,
                                  route_mode="deferred", group_timeout_ms=5000, progress=False))
    failed = [c for c in report["checks"] if not c["passed"]]
    assert report["ok"] and not failed, failed
    assert report["rows"]["total"] == 6 and report["rows"]["placeholders"] == 0
    assert report["deferred_routes"]["failures"] == {} and report["deferred_routes"]["rows"] == 6
    # routes by reference: the fetcher read route chunks, no inline fragment, and the text says so
    fetch = report["deferred_routes"]
    assert fetch["chunks_fetched"] > 0 and fetch["fragments_fetched"] == 0
    from stage.demo.report import render
    assert f"0 inline fragments and {fetch['chunks_fetched']} route chunks fetched" in render(report)
