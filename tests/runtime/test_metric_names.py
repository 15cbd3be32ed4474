"""Every metric name the stage uses is declared (stage.observability.metrics): the sink drops a
name it does not know, so a misspelt one would vanish from /metrics without a sound. Read from
the code: each ``stats.inc`` / ``set`` / ``observe`` / ``count`` / ``total`` with a literal name,
and the runtime's derived gauges (stage.runtime.gauges)."""

import ast
import dataclasses
from pathlib import Path

from stage.observability.metrics import COUNTERS, GAUGES, HISTOGRAMS
from stage.runtime.gauges import Gauges
from stage.runtime.state.memory import Holdings

STAGE = Path(__file__).resolve().parents[2] / "stage"
DECLARED = {"inc": COUNTERS, "count": COUNTERS, "total": COUNTERS, "set": GAUGES, "observe": HISTOGRAMS}


def _uses():
    """(file:line, method, name) of every stats call with a literal metric name."""
    for path in sorted(STAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in DECLARED and node.args):
                continue
            receiver = node.func.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            first = node.args[0]
            if name == "stats" and isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield f"{path.relative_to(STAGE)}:{node.lineno}", node.func.attr, first.value


def test_every_metric_name_the_stage_uses_is_declared():
    uses = list(_uses())
    assert len(uses) > 30          # the scan sees the stage's calls
    unknown = [(where, method, name) for where, method, name in uses if name not in DECLARED[method]]
    assert unknown == []


def test_the_derived_gauges_are_the_declared_ones():
    zero = {f.name: 0 for f in dataclasses.fields(Gauges) if f.name != "held"}
    names = set(Gauges(held=Holdings(), **zero).values())
    assert names == set(GAUGES)
