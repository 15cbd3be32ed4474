"""The Avro wire contract: ``schemas/*.avsc``, loaded and parsed once.

Named types are shared across files (PackedTensor in four records, GroupOutcome defined by
GroupSummary and used by LedgerEntry), so files are parsed in dependency order into one
fastavro ``named_schemas`` table; the order is derived from what each file defines and uses,
so a new file needs no edit here. ``schema_json`` inlines every referenced named type at its
first use: a Schema Registry gets one self-contained schema per subject, no references.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastavro import parse_schema

from .errors import WireError
from .guard import PRIMITIVES, check_decodable

SCHEMAS_DIR_ENV = "ROLLOUT_REASSEMBLER_SCHEMAS_DIR"


def schemas_dir() -> Path:
    """``$ROLLOUT_REASSEMBLER_SCHEMAS_DIR``, else the package's copy (``stage/wire/avsc``: a
    link to the top-level ``schemas/`` in the repository, real files in a built wheel)."""
    override = os.environ.get(SCHEMAS_DIR_ENV)
    return Path(override) if override else Path(__file__).resolve().parent / "avsc"


@dataclass(frozen=True)
class _Contract:
    parsed: dict[str, dict]  # record name -> fastavro parsed schema
    texts: dict[str, str]  # record name -> self-contained JSON for registration


def schema(name: str) -> dict:
    """Parsed fastavro schema of a top-level record, e.g. ``schema("StagedCall")``."""
    return _lookup(name).parsed[name]


def schema_json(name: str) -> str:
    """Self-contained JSON text of a record (referenced named types inlined once)."""
    return _lookup(name).texts[name]


def schema_names() -> tuple[str, ...]:
    """Every top-level record of the contract, in dependency order."""
    return tuple(_load(str(schemas_dir())).parsed)


def _lookup(name: str) -> _Contract:
    contract = _load(str(schemas_dir()))
    if name not in contract.parsed:
        raise KeyError(f"no schema {name!r}; known: {sorted(contract.parsed)}")
    return contract


def _fullname(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _walk(node: Any, ns: str | None, on_def, on_ref) -> None:
    """Visit named definitions and references in Avro parse order (depth-first, in order)."""
    if isinstance(node, str):
        if node not in PRIMITIVES:
            on_ref(_fullname(node, ns))
    elif isinstance(node, list):
        for branch in node:
            _walk(branch, ns, on_def, on_ref)
    elif isinstance(node, dict):
        kind = node.get("type")
        if kind in ("record", "error", "enum", "fixed"):
            full = _fullname(node["name"], node.get("namespace", ns))
            inner_ns = full.rpartition(".")[0] or None
            on_def(full, node, inner_ns)
            for field in node.get("fields", ()):
                _walk(field["type"], inner_ns, on_def, on_ref)
        elif kind == "array":
            _walk(node["items"], ns, on_def, on_ref)
        elif kind == "map":
            _walk(node["values"], ns, on_def, on_ref)
        else:
            _walk(kind, ns, on_def, on_ref)


@functools.cache
def _load(directory: str) -> _Contract:
    files = sorted(Path(directory).glob("*.avsc"))
    if not files:
        raise WireError(f"no *.avsc schemas in {directory} (set {SCHEMAS_DIR_ENV})")
    docs: dict[str, Any] = {}
    for path in files:
        try:
            docs[path.stem] = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise WireError(f"{path.name}: invalid JSON: {e}") from None

    # Who defines which named type (with the namespace it is defined under), who uses what.
    definitions: dict[str, tuple[str, dict, str | None]] = {}
    uses: dict[str, set[str]] = {}
    for stem, doc in docs.items():
        own: set[str] = set()
        refs: set[str] = set()

        def on_def(full, node, inner_ns, stem=stem, own=own):
            if full in definitions:
                raise WireError(f"{stem}.avsc redefines {full} (already in {definitions[full][0]})")
            definitions[full] = (stem, node, full.rpartition(".")[0] or None)
            own.add(full)

        _walk(doc, None, on_def, refs.add)
        uses[stem] = refs - own
    order = _dependency_order(uses, definitions)

    # Parsing the files together in dependency order checks them as a set (and names the
    # file at fault); each record is then re-parsed from its self-contained text, so the
    # schema we read and write with is exactly the one a registry is given.
    named: dict[str, Any] = {}
    parsed: dict[str, dict] = {}
    texts: dict[str, str] = {}
    for stem in order:
        try:
            parse_schema(docs[stem], named_schemas=named)
            texts[stem] = json.dumps(_inline(docs[stem], definitions), separators=(",", ":"))
            parsed[stem] = parse_schema(json.loads(texts[stem]), named_schemas={})
        except Exception as e:  # fastavro raises several types for a bad schema
            raise WireError(f"{stem}.avsc: {e}") from None
        check_decodable(parsed[stem], f"{stem}.avsc")
    return _Contract(parsed, texts)


def _dependency_order(uses: dict[str, set[str]], definitions: dict) -> list[str]:
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(stem: str, chain: tuple[str, ...]) -> None:
        if state.get(stem) == "done":
            return
        if state.get(stem) == "active":
            raise WireError(f"schema files depend on each other in a cycle: {' -> '.join(chain)}")
        state[stem] = "active"
        for ref in sorted(uses[stem]):
            if ref not in definitions:
                raise WireError(f"{stem}.avsc uses {ref}, which no schema file defines")
            visit(definitions[ref][0], chain + (definitions[ref][0],))
        state[stem] = "done"
        order.append(stem)

    for stem in sorted(uses):
        visit(stem, (stem,))
    return order


def _inline(doc: Any, definitions: dict) -> Any:
    """Copy of ``doc`` with each external named type's definition at its first use."""
    seen: set[str] = set()

    def expand(node: Any, ns: str | None) -> Any:
        if isinstance(node, str):
            full = _fullname(node, ns)
            if node in PRIMITIVES or full in seen:
                return node
            _, definition, def_ns = definitions[full]
            node = copy.deepcopy(definition)
            if def_ns and "." not in node["name"]:
                node["namespace"] = def_ns  # keep its full name under any enclosing namespace
            return expand(node, def_ns)
        if isinstance(node, list):
            return [expand(b, ns) for b in node]
        if not isinstance(node, dict):
            return node
        node = dict(node)
        kind = node.get("type")
        if kind in ("record", "error", "enum", "fixed"):
            full = _fullname(node["name"], node.get("namespace", ns))
            if full in seen:   # defined inside a type inlined earlier (TensorDType in PackedTensor)
                return full
            seen.add(full)
            inner = full.rpartition(".")[0] or None
            if "fields" in node:
                node["fields"] = [{**f, "type": expand(f["type"], inner)} for f in node["fields"]]
        elif kind == "array":
            node["items"] = expand(node["items"], ns)
        elif kind == "map":
            node["values"] = expand(node["values"], ns)
        else:
            node["type"] = expand(kind, ns)
        return node

    return expand(doc, None)
