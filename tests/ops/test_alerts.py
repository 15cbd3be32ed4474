"""The alert rules, run by Prometheus's own promtool (`make promtool`): `promtool check rules`,
the unit tests in ops/prometheus/tests/ (every alert fires in one case and stays silent in
another), the stage exporting at 0 every labelled series an alert reads, and the chart's
PrometheusRule: the same rules, narrowed to the job its ServiceMonitor gives the targets."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from tests.ops.support import CHART, OPS, one, render, run, tool

PROMETHEUS = OPS / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
CHART_ALERTS = CHART / "files" / "alerts.yml"
UNIT_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
JOB = "rollout-reassembler"
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}


def promtool() -> Path:
    return tool("promtool", "promtool")


def rules(path: Path = ALERTS) -> list[dict]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def parse(exprs: list[str]) -> list[dict]:
    """Prometheus's PromQL parser (promql-check): metrics and every selector's matchers."""
    result = run([tool("promql-check", "ops-tools")], input=json.dumps(exprs))
    assert result.returncode == 0, result.stderr
    parsed = json.loads(result.stdout)
    assert not [p["error"] for p in parsed if p.get("error")]
    return parsed


def equality_matchers(selector: dict) -> dict[str, str]:
    return {name: value for name, op, value in selector["matchers"] if op == "=" and name != "__name__"}


# -- the rules and their promtool unit tests ----------------------------------------------------
def test_promtool_checks_the_rules():
    result = run([promtool(), "check", "rules", ALERTS])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass():
    assert UNIT_TESTS
    result = run([promtool(), "test", "rules", *UNIT_TESTS], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(UNIT_TESTS), result.stdout


def test_promtool_unit_tests_catch_a_wrong_threshold(tmp_path):
    """The unit tests can fail: the end-to-end rule with its old absolute 30 s threshold fires
    on 2% of groups closing at the default deadline."""
    source = yaml.safe_load(ALERTS.read_text())
    for rule in source["groups"][0]["rules"]:
        if rule["alert"] == "RolloutReassemblerEndToEndSlow":
            rule["expr"] = rule["expr"].split(" > on (job)")[0] + " > 30"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(source))
    (tmp_path / "tests").mkdir()
    test = tmp_path / "tests" / "end_to_end.yml"
    test.write_text((PROMETHEUS / "tests" / "end_to_end.yml").read_text())
    result = run([promtool(), "test", "rules", test])
    assert result.returncode != 0
    assert "2% of groups closing at the default 60 s deadline does not fire" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    cases: dict[str, dict[str, int]] = defaultdict(lambda: {"fires": 0, "silent": 0})
    for path in UNIT_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../alerts.yml"], path.name
        for test in doc["tests"]:
            assert test.get("name"), path.name
            for case in test.get("alert_rule_test", []):
                cases[case["alertname"]]["fires" if case.get("exp_alerts") else "silent"] += 1
    names = {rule["alert"] for rule in rules()}
    # promtool passes a silent case of an alert that does not exist: names must be real
    assert set(cases) <= names, set(cases) - names
    missing = {name: cases[name] for name in names if not (cases[name]["fires"] and cases[name]["silent"])}
    assert missing == {}


def test_histogram_unit_tests_use_the_stage_buckets():
    """A quantile depends on the bucket layout: the tests must use the stage's own."""
    from stage.observability.metrics import SECONDS_BUCKETS
    wanted = sorted([*map(float, SECONDS_BUCKETS), float("inf")])
    doc = yaml.safe_load((PROMETHEUS / "tests" / "end_to_end.yml").read_text())
    for test in doc["tests"]:
        les = [float(s["series"].split('le="')[1].split('"')[0]) for s in test["input_series"] if "_bucket{" in s["series"]]
        assert sorted(les) == wanted, test["name"]


def test_every_selector_names_the_job():
    """The chart narrows job="rollout-reassembler" to its release: a selector without it would
    read every job's series."""
    for rule, info in zip(rules(), parse([r["expr"] for r in rules()])):
        assert info["selectors"], rule["alert"]
        for selector in info["selectors"]:
            assert equality_matchers(selector).get("job") == JOB, (rule["alert"], selector)


def test_compose_prometheus_scrapes_the_job_the_rules_name(tmp_path):
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert [job["job_name"] for job in config["scrape_configs"]] == [JOB]
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    # promtool check config, with the rule file where this checkout has it
    config["rule_files"] = [str(ALERTS)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = run([promtool(), "check", "config", tmp_path / "prometheus.yml"])
    assert result.returncode == 0, result.stdout + result.stderr


# -- the series the alerts read exist from the start ---------------------------------------------
def test_alerted_series_exist_at_zero_before_the_first_event():
    """increase() of a series that appears at 1 is nothing: every labelled counter an alert reads
    has all its labels in INITIAL_LABELS, and every label value an alert selects is exported
    at 0 by a freshly configured stage."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from stage.observability.metrics import COUNTERS, INITIAL_LABELS, PREFIX, PrometheusSink
    from stage.config.model import StageConfig
    sink = PrometheusSink()
    sink.configure(StageConfig())
    samples: dict[str, list[dict]] = defaultdict(list)
    for family in text_string_to_metric_families(generate_latest(sink.registry).decode()):
        for sample in family.samples:
            samples[sample.name].append(sample.labels)
    counters = {PREFIX + name + "_total": (key, labels) for key, (name, _, labels) in COUNTERS.items()}
    checked = 0
    for rule, info in zip(rules(), parse([r["expr"] for r in rules()])):
        for selector in info["selectors"]:
            if selector["metric"] in counters:
                key, labels = counters[selector["metric"]]
                if labels:
                    assert set(INITIAL_LABELS.get(key, {})) == set(labels), (rule["alert"], key)
            wanted = {k: v for k, v in equality_matchers(selector).items() if k not in TARGET_LABELS}
            if wanted:
                assert any(wanted.items() <= labels.items() for labels in samples[selector["metric"]]), \
                    f"{rule['alert']}: no {selector['metric']}{wanted} series at start"
                checked += 1
    assert checked  # groups_published{outcome="dropped"}, rows_published{valid="false"}, ...


# -- the chart's PrometheusRule ------------------------------------------------------------------
def test_chart_rules_file_is_the_ops_rules_file():
    assert CHART_ALERTS.read_bytes() == ALERTS.read_bytes(), \
        f"copy {ALERTS.relative_to(OPS.parent)} to {CHART_ALERTS.relative_to(OPS.parent)}"


def scrape_job(docs: list[dict]) -> str:
    """The job label Prometheus Operator gives the ServiceMonitor's targets: the value of the
    Service label named by spec.jobLabel, else the Service's name."""
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    if "jobLabel" in monitor["spec"]:
        return service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    return service["metadata"]["name"]


ALERTING = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}


@pytest.mark.parametrize("release, namespace", [(JOB, "stage"), ("rr", "ml")])
def test_prometheus_rule_selects_the_service_monitor_job(release, namespace):
    docs = render(ALERTING, release=release, namespace=namespace)
    job = scrape_job(docs)
    if release == JOB:  # the default release name: the same job as docker compose's
        assert job == JOB
    assert one(docs, "ServiceMonitor")["spec"]["namespaceSelector"]["matchNames"] == [namespace]
    rendered = [r for group in one(docs, "PrometheusRule")["spec"]["groups"] for r in group["rules"]]
    selector = f'job="{job}", namespace="{namespace}"'
    assert rendered == [{**rule, "expr": rule["expr"].replace(f'job="{JOB}"', selector)} for rule in rules()]
    for rule, info in zip(rendered, parse([r["expr"] for r in rendered])):
        for sel in info["selectors"]:
            matchers = equality_matchers(sel)
            assert (matchers["job"], matchers["namespace"]) == (job, namespace), (rule["alert"], sel)


def test_prometheus_rule_fires_for_its_own_targets_only(tmp_path):
    """promtool on the rendered rules: series labelled as the ServiceMonitor labels them fire;
    the same job name in another namespace (another release) does not."""
    docs = render(ALERTING, release="rr", namespace="ml")
    job = scrape_job(docs)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": one(docs, "PrometheusRule")["spec"]["groups"]}))
    ours = f'job="{job}", namespace="ml", instance="10.0.0.5:9400", pod="{job}-0", service="{job}", endpoint="metrics"'
    theirs = f'job="{job}", namespace="other", instance="10.0.1.5:9400"'
    test = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "name": "rendered rules", "interval": "1m",
        "input_series": [
            {"series": f"up{{{ours}}}", "values": "1x5 0x20"},
            {"series": f"up{{{theirs}}}", "values": "0x25"},
            {"series": f'rollout_reassembler_dead_letters_total{{{ours}, topic="rollouts.receipts"}}', "values": "0x5 1x20"},
            {"series": f'rollout_reassembler_dead_letters_total{{{theirs}, topic="rollouts.receipts"}}', "values": "0x5 3x20"},
        ],
        "alert_rule_test": [
            {"eval_time": "12m", "alertname": "RolloutReassemblerDown", "exp_alerts": [{
                "exp_labels": {"severity": "critical", **dict(kv.split("=", 1) for kv in ours.replace('"', "").split(", "))},
                "exp_annotations": {"summary": "10.0.0.5:9400: /metrics unreachable for 5 minutes"}}]},
            {"eval_time": "8m", "alertname": "RolloutReassemblerDeadLetters", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "topic": "rollouts.receipts"},
                "exp_annotations": {"summary": "1 records from rollouts.receipts dead-lettered in 15 minutes "
                                               "(a producer writes bad records)"}}]},
            {"eval_time": "12m", "alertname": "RolloutReassemblerAbsent", "exp_alerts": []},
        ]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    result = run([promtool(), "test", "rules", tmp_path / "test.yml"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_rule_leaves_out_disabled_alerts_and_absent_when_scaled_to_zero():
    def alerts(values):
        return [r["alert"] for g in one(render(values), "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    everything = [rule["alert"] for rule in rules()]
    assert alerts(ALERTING) == everything
    disabled = {**ALERTING, "prometheusRule": {"enabled": True, "disabledAlerts": ["RolloutReassemblerRebalanceStorm"]}}
    assert alerts(disabled) == [a for a in everything if a != "RolloutReassemblerRebalanceStorm"]
    keda = {**ALERTING, "keda": {"enabled": True, "minReplicaCount": 0}}
    assert alerts(keda) == [a for a in everything if a != "RolloutReassemblerAbsent"]
    assert alerts({**keda, "keda": {"enabled": True, "minReplicaCount": 1}}) == everything
    custom = one(render({"prometheusRule": {"enabled": True, "job": "kubernetes-pods", "labels": {"release": "prom"}}}),
                 "PrometheusRule")
    assert custom["metadata"]["labels"]["release"] == "prom"
    exprs = [r["expr"] for g in custom["spec"]["groups"] for r in g["rules"]]
    assert 'up{job="kubernetes-pods", namespace="stage"} == 0' in exprs
    assert not [d for d in render() if d.get("kind") == "PrometheusRule"]
