"""The docs a stranger reads agree with the code: every alert rule and every exit code the stage
can return is explained in docs/operations.md, and every local link of the README and docs/
points at a file (and heading) that exists."""

import re
from pathlib import Path

import yaml

from stage.runtime import exits

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()


def test_every_alert_is_explained_in_the_operations_doc():
    rules = yaml.safe_load((ROOT / "ops" / "prometheus" / "alerts.yml").read_text())
    names = [rule["alert"] for group in rules["groups"] for rule in group["rules"]]
    assert names and [n for n in names if f"`{n}`" not in OPERATIONS] == []


def test_every_exit_code_is_in_the_operations_table():
    codes = {name: value for name, value in vars(exits).items() if name.startswith("EXIT_")}
    table = re.search(r"## Exit codes and start-up checks\n(.*?)\n## ", OPERATIONS, re.S).group(1)
    rows = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert set(codes.values()) <= rows, sorted(set(codes.values()) - rows)


def _anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_local_links_point_at_files_and_headings_that_exist():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.name}: {target}")
            elif anchor and file.suffix == ".md":
                anchors = {_anchor(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
                if anchor not in anchors:
                    broken.append(f"{doc.name}: {target} (no such heading)")
    assert broken == []
