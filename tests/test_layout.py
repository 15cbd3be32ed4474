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


def test_the_code_layout_names_every_package_and_runtime_module():
    text = (STAGE.parent / "docs" / "design.md").read_text()
    layout = text.split("## Code layout", 1)[1].split("\n## ", 1)[0]
    packages = sorted(p.name for p in STAGE.iterdir() if (p / "__init__.py").exists())
    missing = [f"stage/{p}" for p in packages if f"stage/{p}" not in layout]
    runtime = STAGE / "runtime"
    for path in sorted(runtime.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        folder = path.parent.relative_to(runtime)
        if f"`{path.name}`" not in layout or (str(folder) != "." and f"`{folder}/`" not in layout):
            missing.append(str(path.relative_to(STAGE)))
    assert missing == []


def test_imports_run_with_the_data_decode_imports_nothing_downstream():
    graph = _package_graph()
    assert graph.get("decode", set()) & {"finalize", "publish", "runtime"} == set()
    assert graph.get("staging", set()) & {"decode", "finalize", "publish", "runtime"} == set()
