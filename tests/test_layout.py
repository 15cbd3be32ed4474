"""The package layout the docs describe (docs/design.md, Code layout), read from the imports:
no package imports one that imports it back, the verification and buffering core imports no
Kafka client, the top level holds only entry points, and the runtime keeps no step mixins."""

import ast
from pathlib import Path

STAGE = Path(__file__).resolve().parents[1] / "stage"
KAFKA_FREE = ("contract", "buffer", "finalize", "routes", "decode")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in STAGE.rglob("*.py"):
        package = path.relative_to(STAGE).parts[0].removesuffix(".py")
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "stage" and len(parts) > 1 and parts[1] != package:
                graph.setdefault(package, set()).add(parts[1])
    return graph


def test_no_package_imports_one_that_imports_it_back():
    graph = _package_graph()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert [p for p in sorted(graph) if p in reaches(p)] == []


def test_the_verification_core_imports_no_kafka_client():
    offenders = [str(path.relative_to(STAGE)) for package in KAFKA_FREE
                 for path in (STAGE / package).rglob("*.py")
                 if any(name.split(".")[0] == "confluent_kafka" for name in _imports(path))]
    assert offenders == []


def test_the_top_level_holds_only_entry_points_and_packages():
    loose = sorted(p.name for p in STAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"]


def test_runtime_steps_are_collaborators_not_mixins_of_the_runtime():
    tree = ast.parse((STAGE / "runtime" / "loop.py").read_text())
    [runtime] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StageRuntime"]
    assert runtime.bases == []
