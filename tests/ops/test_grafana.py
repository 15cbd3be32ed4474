"""The Grafana dashboard and the Prometheus alert rules: every PromQL metric name is one the stage
registers (a real PrometheusSink's registry), labels are the metrics' own, expressions parse with
Prometheus's PromQL parser (`make ops-tools`), and the dashboard covers what operators need."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.ops.support import DASHBOARD, OPS, run, tool

RANGE_VARIABLES = ("$__rate_interval", "$__interval", "$__range")
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
            "bool", "offset", "inf", "nan"}


# -- what the stage registers ------------------------------------------------------------------
def registered() -> dict[str, set[str]]:
    """Every series name the stage's registry can expose, configured as at start -> its label
    names (the stage's own metrics' label names; the collectors' from their samples)."""
    from stage.observability import PrometheusSink
    from stage.config.model import StageConfig
    sink = PrometheusSink()
    sink.configure(StageConfig())
    labels = {}
    for metric in [*sink.counters.values(), *sink.gauges.values(), *sink.histograms.values(),
                   *sink.config.values(), sink.lag, sink.group_metrics]:
        labels[metric._name] = set(metric._labelnames)
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
                "histogram": ("_bucket", "_count", "_sum", "_created"),
                "summary": ("", "_count", "_sum", "_created")}
    names: dict[str, set[str]] = {}
    for family in sink.registry.collect():
        sampled = set().union(*(s.labels.keys() for s in family.samples))
        for suffix in suffixes[family.type]:
            extra = {"le"} if suffix == "_bucket" else ({"quantile"} if family.type == "summary" and not suffix else set())
            names[family.name + suffix] = labels.get(family.name, sampled) | extra
    assert names, "the sink registered nothing"
    return names


# -- reading PromQL ----------------------------------------------------------------------------
def grafana_to_promql(expr: str) -> str:
    """Grafana's variables replaced the way Grafana interpolates them before querying."""
    for variable in RANGE_VARIABLES:
        expr = expr.replace(variable, "5m")
    expr = re.sub(r"\$\{?(\w+)\}?", lambda m: ".*" if m.group(1) != "__name__" else "x", expr)
    return expr


def names_in(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) of a PromQL expression, without a parser: strings, ranges and
    durations dropped; identifiers before '(' are functions; identifiers in braces or in a
    by/without/on/ignoring/group_x list are labels."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\[[^\]]*\]", "", text)
    labels: set[str] = set()
    for body in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", body))
    text = re.sub(r"\{[^}]*\}", " ", text)
    for body in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        labels |= {x.strip() for x in body.split(",") if x.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b", " ", text)
    metrics = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", text):
        word = match.group(0)
        if text[match.end():].lstrip().startswith("(") or word.lower() in KEYWORDS:
            continue
        metrics.add(word)
    return metrics, labels


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows keep theirs inside
    return out


def panel_exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p.get("targets", [])]


def variable_selectors() -> list[str]:
    """The series selectors inside the query variables' label_values(...)."""
    exprs = []
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            assert match, f"variable {variable['name']}: {query}"
            exprs.append(match.group(1))
    return exprs


def dashboard_exprs() -> list[str]:
    return panel_exprs() + variable_selectors()


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load((OPS / "prometheus" / "alerts.yml").read_text())["groups"]
            for rule in group["rules"]]


def check_names(exprs: list[str], allowed_extra: set[str] = frozenset(), *, queries: bool = True) -> None:
    known = registered()
    problems = []
    for expr in exprs:
        metrics, labels = names_in(grafana_to_promql(expr))
        assert metrics, f"no metric in {expr!r}"
        for metric in metrics - allowed_extra:
            if metric not in known:
                problems.append(f"{metric} (in {expr!r}) is not registered by the stage")
                continue
        allowed = set().union(*(known.get(m, set()) for m in metrics)) | TARGET_LABELS
        for label in labels - allowed:
            problems.append(f"label {label} (in {expr!r}) is on none of {sorted(metrics)}")
        for metric in metrics if queries else ():
            if metric.endswith(("_total", "_bucket", "_sum", "_count")):
                assert re.search(rf"\b(?:rate|increase|irate)\(\s*{metric}\b", expr), \
                    f"{metric} is a counter series: use rate()/increase() in {expr!r}"
    assert problems == []


# -- the dashboard -----------------------------------------------------------------------------
def test_every_dashboard_metric_is_registered_by_the_stage():
    check_names(panel_exprs())
    check_names(variable_selectors(), queries=False)


def test_name_check_catches_unknown_metrics_and_labels():
    with pytest.raises(AssertionError):
        check_names(['sum(rate(rollout_reassembler_records_consumd_total[5m]))'])
    with pytest.raises(AssertionError):
        check_names(['sum by (partition) (rate(rollout_reassembler_records_consumed_total[5m]))'])
    with pytest.raises(AssertionError):
        check_names(['rollout_reassembler_transactions_committed_total'])
    check_names(['sum by (topic) (rate(rollout_reassembler_records_consumed_total{job=~"$job"}[$__rate_interval]))'])


def test_dashboard_expressions_parse_with_prometheus():
    checker = tool("promql-check", "ops-tools")
    exprs = [grafana_to_promql(e) for e in dashboard_exprs()] + [r["expr"] for r in alert_rules()]
    result = run([checker], input=json.dumps(exprs))
    assert result.returncode == 0, result.stderr
    parsed = json.loads(result.stdout)
    errors = [f"{e!r}: {p['error']}" for e, p in zip(exprs, parsed) if p.get("error")]
    assert errors == []
    known = registered()
    for expr, info in zip(exprs, parsed):
        for metric in info["metrics"]:
            assert metric in known or metric == "up", f"{metric} in {expr!r}"
        # the parser's view agrees with the lightweight reader used above
        assert set(info["metrics"]) == names_in(expr)[0], expr
    # and the checker reports errors
    bad = json.loads(run([checker], input=json.dumps(["sum(rate(x[5m])"])).stdout)
    assert bad[0]["error"]


def test_dashboard_covers_the_operational_signals():
    exprs = dashboard_exprs()
    text = "\n".join(exprs)
    p = "rollout_reassembler_"
    for needle in (f"{p}records_consumed_total", f"{p}dead_letters_total", f"{p}consumer_lag",
                   f"{p}open_groups", f"{p}buffered_bytes", f"{p}paused_partitions", f"{p}inflight_groups",
                   f"{p}transactions_committed_total", f"{p}transactions_aborted_total",
                   # memory against the pod limit and the buffer cap; CPU, fds, GC, restarts, build
                   "process_resident_memory_bytes", f"{p}memory_limit_bytes", f"{p}config_max_buffered_bytes",
                   "process_cpu_seconds_total", "process_open_fds", "python_gc_collections_total",
                   "process_start_time_seconds", f"{p}build_info", f"{p}config_group_timeout_seconds"):
        assert needle in text, needle
    for metric, label in (("groups_published_total", "outcome"), ("rows_published_total", "valid"),
                          ("rejections_total", "bucket"), ("rebalances_total", "kind")):
        assert any(p + metric in e and re.search(rf"by \([^)]*\b{label}\b", e) for e in exprs), (metric, label)
    for histogram in ("end_to_end_seconds", "finalize_seconds", "publish_seconds", "group_fill_seconds"):
        for q in ("0.5", "0.99"):
            pattern = rf"histogram_quantile\({q}, sum by \(le\) \(rate\({p}{histogram}_bucket\{{[^}}]*\}}\[\$__rate_interval\]\)\)\)"
            assert any(re.fullmatch(pattern, e) for e in exprs), (histogram, q)


def test_dashboard_structure():
    board = dashboard()
    assert board["uid"] == "rollout-reassembler" and board["title"]
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    all_panels = panels()
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    occupied = set()
    for panel in all_panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"])
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    used = set(re.findall(r"\$(\w+)", json.dumps([t["expr"] for p in all_panels for t in p.get("targets", [])])))
    assert used - {"__rate_interval"} <= set(variables), used


def test_grafana_provisioning_files():
    provisioning = OPS / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    providers = yaml.safe_load((provisioning / "dashboards" / "rollout-reassembler.yml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


# -- alert rules ---------------------------------------------------------------------------------
def test_alert_rules_use_registered_metrics():
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
    check_names([r["expr"] for r in rules], allowed_extra={"up"})
