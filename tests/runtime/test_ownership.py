"""One writer per mutable field, read from the code: the state shared between the steps (each
``PartitionState``, the Kafka clients) and the steps' own fields are written from outside their
object only where the table in stage/runtime/state/partition.py (and ``WRITERS`` here) says,
each by one module; a step's queues, halts and holds are written by its own methods only. A
second writer fails here, not in production. No step is wired to another by a lambda either."""

import ast
import dataclasses
from pathlib import Path

from stage.runtime.kafka.clients import Clients
from stage.runtime.state.partition import PartitionState

RUNTIME = Path(__file__).resolve().parents[2] / "stage" / "runtime"
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "clear", "update", "add", "discard",
            "remove", "setdefault", "sort"}

STEPS = {"intake", "loads", "deadlines", "finalization", "publication", "flight", "assignment",
         "backpressure", "pauses", "resolver"}
SHARED = {f.name for f in dataclasses.fields(PartitionState)} | {f.name for f in dataclasses.fields(Clients)}
# field -> the one module that writes it from outside its object
WRITERS = {
    "epoch": "steps/loads.py",
    "load": "steps/loads.py",
    "buffer": "steps/loads.py",
    "dead_letter_marks": "steps/loads.py",
    "committed": "steps/publication.py",
    "consumer": "loop.py",
    "admin": "loop.py",
    "queries": "loop.py",
    "probe": "loop.py",
    "start_offsets": "loop.py",
    "partition_count": "loop.py",
}


def _shared(target: ast.Attribute) -> bool:
    """A field of the shared state, or of a step reached from outside it (``self.intake.x``)."""
    owner = target.value
    return target.attr in SHARED or (isinstance(owner, ast.Attribute) and owner.attr in STEPS)


def _outside_writes():
    """(module, field) for every write of a shared field from outside its object."""
    found = []
    for path in sorted(RUNTIME.rglob("*.py")):
        module = str(path.relative_to(RUNTIME))
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for target in getattr(node, "targets", None) or [node.target]:
                    targets += target.elts if isinstance(target, ast.Tuple) else [target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS):
                targets.append(node.func.value)
            for target in targets:
                if isinstance(target, ast.Subscript):
                    target = target.value
                if (isinstance(target, ast.Attribute) and _shared(target)
                        and not (isinstance(target.value, ast.Name) and target.value.id == "self")):
                    found.append((module, target.attr))
    return found


def test_every_field_written_from_outside_its_object_has_one_writer():
    writers: dict[str, set[str]] = {}
    for module, attr in _outside_writes():
        writers.setdefault(attr, set()).add(module)
    assert {attr: sorted(mods) for attr, mods in writers.items()} == {
        attr: [module] for attr, module in WRITERS.items() if attr in writers}
    assert set(writers) <= set(WRITERS), sorted(set(writers) - set(WRITERS))


def test_the_steps_are_not_wired_with_lambdas():
    offenders = []
    for path in sorted((RUNTIME / "steps").glob("*.py")) + [RUNTIME / "loop.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Lambda):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []
