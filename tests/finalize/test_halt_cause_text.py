"""The halt causes are one list (stage.finalize.failures.HALT_CAUSES); every text an operator
reads about them says that list: the table in docs/design.md (names and actions, in order), and
the README, the guarantees, the operations guide and the PartitionHalted alert (Prometheus
rules and the chart's copy), which name the causes in the same words."""

import re
from pathlib import Path

import yaml

from stage.finalize.failures import HALT_CAUSES

ROOT = Path(__file__).resolve().parents[2]
LIST = "halt causes: " + ", ".join(cause.name for cause in HALT_CAUSES)
NAMING = ["README.md", "docs/guarantees.md", "docs/operations.md", "docs/design.md"]
ALERTS = ["ops/prometheus/alerts.yml", "helm/rollout-reassembler/files/alerts.yml"]


def _plain(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_the_design_table_is_the_list_with_its_actions():
    text = (ROOT / "docs/design.md").read_text()
    section = text.split("## When a partition halts", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if re.match(r"\| `[a-z_]+` \|", line)]
    assert [row[0].strip().strip("`") for row in rows] == [cause.name for cause in HALT_CAUSES]
    assert [_plain(row[2]) for row in rows] == [_plain(cause.action) for cause in HALT_CAUSES]


def test_every_text_that_names_the_causes_names_the_list():
    for path in NAMING + ALERTS:
        assert LIST in _plain((ROOT / path).read_text()), path


def test_the_alert_that_fires_on_a_halt_names_the_list():
    for path in ALERTS:
        rules = [rule for group in yaml.safe_load((ROOT / path).read_text())["groups"] for rule in group["rules"]]
        [halted] = [rule for rule in rules if rule.get("alert") == "RolloutReassemblerPartitionHalted"]
        assert LIST in halted["annotations"]["summary"], path
