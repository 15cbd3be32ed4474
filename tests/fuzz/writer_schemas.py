"""Registry writer schemas of the input records, drawn from a seed: ours, varied the ways a
producer's schema may vary (logical types on our fields and on added ones, docs, aliases, orders,
custom properties, fields added anywhere, fields reordered), and sometimes in a way Avro does not
allow but fastavro's parser accepts (a ``fixed`` size that is not a count of bytes).

``draw(rng, name)`` returns a ``WriterSchema``: the registered text, whether the stage owes the
records it writes their values as ours (``compatible``) or a refusal of the schema, and
``encode(full_record)``, the bytes a producer with that schema writes (our fields' values, the
added fields' drawn from the seed). Logical types never change the bytes (Avro spec), so records
are written with the schema's Parsing Canonical Form.
"""

from __future__ import annotations

import copy
import io
import json
import random
from dataclasses import dataclass, field

from fastavro import parse_schema, schemaless_writer
from fastavro.schema import to_parsing_canonical_form

from stage.wire import schema_json

ADDED = "fz_"         # prefix of every field the writer adds (values drawn when writing)
# Logical types a writer may put on a primitive: Avro's own, one unknown name, and misplaced
# ones (Avro readers must ignore a logical type on the wrong base type).
LOGICAL = {
    "long": ["timestamp-millis", "timestamp-micros", "timestamp-nanos", "local-timestamp-millis",
             "local-timestamp-micros", "time-micros", "uuid", "epoch-ns"],
    "int": ["date", "time-millis", "timestamp-millis", "decimal"],
    "string": ["uuid", "date", "json"],
    "bytes": ["decimal", "uuid"],
    "double": ["timestamp-millis"],
    "float": ["decimal"],
    "boolean": ["date"],
}
# Writer types Avro promotes to ours (our type: the writer's): values still read as ours.
PROMOTIONS = {"long": "int", "string": "bytes"}   # (float for double: not exact)
ODD_SIZES = ("16", None, [1], True, False, -1, 2.5, "", {"n": 1})
PROPERTIES = ({"doc": "from a Java producer"}, {"connect.name": "x.y.Z"},
              {"avro.java.string": "String"}, {"java-class": "java.math.BigDecimal"},
              {"aliases": ["old_name"]}, {"order": "descending"}, {"order": "ignore"})


@dataclass
class WriterSchema:
    name: str                      # our record it writes (ReceiptEvent, StagedCall)
    doc: dict
    compatible: bool               # False: the stage must refuse the schema (odd fixed size)
    notes: list[str] = field(default_factory=list)
    rng: random.Random | None = None
    _writable: tuple | None = None   # (the doc as written, parsed, its named types), cached

    @property
    def text(self) -> str:
        return json.dumps(self.doc)

    def encode(self, record: dict) -> bytes:
        """The Avro body a producer holding this schema writes for ``record`` (every field of
        ours present, as a decode of ours returns it)."""
        if self._writable is None:
            writable = _writable(_plain(copy.deepcopy(self.doc)))
            parsed = parse_schema(json.loads(to_parsing_canonical_form(
                parse_schema(writable, named_schemas={}))), named_schemas={})
            self._writable = (writable, parsed, _named(writable))
        writable, parsed, named = self._writable
        out = io.BytesIO()
        schemaless_writer(out, parsed, _fill(writable, record, self.rng, named))
        return out.getvalue()


def draw(rng: random.Random, name: str) -> WriterSchema:
    doc = json.loads(schema_json(name))
    schema = WriterSchema(name, doc, True, rng=rng)
    odd = rng.random() < 0.2
    _Mutator(rng, schema, odd).record(doc, top=True)
    if odd and schema.compatible:      # no record drew the odd size: add it at the top
        doc["fields"].append(_Mutator(rng, schema, True).odd_fixed_field())
    schema.doc = _define_before_use(doc, _named(doc))
    return schema


def _define_before_use(node, named: dict, seen: set | None = None):
    """Fields reordered may put a shared type's definition after a use of it: define each
    named type at its first use in the new order, by name after that (as Avro requires)."""
    seen = set() if seen is None else seen
    if isinstance(node, str):
        short = node.rpartition(".")[2]
        if short in named and short not in seen:
            return _define_before_use(named[short], named, seen)
        return node
    if isinstance(node, list):
        return [_define_before_use(b, named, seen) for b in node]
    if node.get("type") in ("record", "enum", "fixed"):
        if node["name"] in seen:
            return f"rollout_reassembler.v1.{node['name']}"
        seen.add(node["name"])
    out = dict(node)
    for key in ("type", "items", "values"):
        if key in out and (not isinstance(out[key], str) or out[key].rpartition(".")[2] in named):
            out[key] = _define_before_use(out[key], named, seen)
    if "fields" in out:
        out["fields"] = [{**f, "type": _define_before_use(f["type"], named, seen)} for f in out["fields"]]
    return out


class _Mutator:
    def __init__(self, rng: random.Random, schema: WriterSchema, odd: bool) -> None:
        self.rng, self.schema, self.odd = rng, schema, odd
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}_{self.rng.randrange(1 << 20):05x}"

    def record(self, node: dict, top: bool = False) -> None:
        rng = self.rng
        for f in node["fields"]:
            f["type"] = self.type_of(f["type"], f["name"])
            if rng.random() < 0.1:
                f.update(rng.choice(PROPERTIES))
        # The top record gains a field nine times in ten: its canonical form then differs from
        # ours and the writer is resolved against ours (the path a writer schema can hurt).
        added = rng.choice((0, 0, 1, 1, 2, 3)) if not top else rng.choice((0, 1, 1, 1, 1, 2, 2, 2, 3, 3))
        for _ in range(added):
            node["fields"].insert(rng.randint(0, len(node["fields"])), self.added_field())
        if rng.random() < 0.3:
            rng.shuffle(node["fields"])
            self.schema.notes.append(f"{node['name']}: fields reordered")
        if rng.random() < 0.2:
            node.update(rng.choice(PROPERTIES[:4]))

    def type_of(self, node, where: str):
        """``node`` with a logical type on it (or inside it) now and then."""
        rng = self.rng
        if isinstance(node, str):
            if node in PROMOTIONS and rng.random() < 0.08:   # an older, narrower writer type
                self.schema.notes.append(f"{where}: {PROMOTIONS[node]} for our {node}")
                node = PROMOTIONS[node]
            if node in LOGICAL and rng.random() < 0.25:
                return self.logical(node, where)
            return node
        if isinstance(node, list):
            return [self.type_of(b, where) for b in node]
        kind = node["type"]
        if kind == "record":
            self.record(node)
        elif kind == "array":
            node["items"] = self.type_of(node["items"], f"{where}[]")
        elif kind == "map":
            node["values"] = self.type_of(node["values"], f"{where}[]")
        return node

    def logical(self, base: str, where: str) -> dict:
        logical = self.rng.choice(LOGICAL[base])
        node = {"type": base, "logicalType": logical}
        if logical == "decimal":
            node.update(precision=self.rng.choice((1, 9, 38, 4096)), scale=self.rng.choice((0, 2, 40)))
        self.schema.notes.append(f"{where}: {base} as {logical}")
        return node

    # -- fields a newer producer adds ---------------------------------------------------
    def added_field(self) -> dict:
        name = self.fresh(ADDED)
        kind = self.added_type(depth=0)
        if self.odd and self.schema.compatible and self.rng.random() < 0.5:
            return self.odd_fixed_field()
        f = {"name": name, "type": kind}
        if isinstance(kind, list) and kind[0] == "null" and self.rng.random() < 0.7:
            f["default"] = None
        self.schema.notes.append(f"added {name}")
        return f

    def odd_fixed_field(self) -> dict:
        size = self.rng.choice(ODD_SIZES)
        self.schema.compatible = False
        fixed = {"type": "fixed", "name": self.fresh("FzOdd"), "size": size}
        where = self.rng.choice(("field", "union", "array", "map"))
        self.schema.notes.append(f"fixed size {size!r} ({where})")
        kind = {"field": fixed, "union": ["null", fixed], "array": {"type": "array", "items": fixed},
                "map": {"type": "map", "values": fixed}}[where]
        return {"name": self.fresh(ADDED), "type": kind}

    def added_type(self, depth: int):
        rng = self.rng
        roll = rng.random()
        if roll < 0.35 or depth >= 2:
            base = rng.choice(sorted(LOGICAL))
            return self.logical(base, "added") if rng.random() < 0.5 else base
        if roll < 0.5:
            size = rng.choice((0, 1, 12, 16))
            node = {"type": "fixed", "name": self.fresh("FzFixed"), "size": size}
            if size == 12 and rng.random() < 0.5:
                node["logicalType"] = "duration"
            elif size and rng.random() < 0.3:
                node.update(logicalType="decimal", precision=2 * size, scale=1)
            return node
        if roll < 0.6:
            return {"type": "enum", "name": self.fresh("FzEnum"), "symbols": ["A", "B", "C"]}
        if roll < 0.7:
            return {"type": "array", "items": self.nonzero_type(depth + 1)}
        if roll < 0.8:
            return {"type": "map", "values": self.added_type(depth + 1)}
        if roll < 0.9:
            return {"type": "record", "name": self.fresh("FzRecord"),
                    "fields": [{"name": self.fresh(ADDED), "type": self.added_type(depth + 1)}
                               for _ in range(rng.randint(1, 3))]}
        while True:   # a union holds no union and one null
            inner = self.added_type(depth + 1)
            if not isinstance(inner, list) and inner != "null":
                return ["null", inner]

    def nonzero_type(self, depth: int):
        """An array item type that encodes in at least one byte (zero-width items are refused
        as unbounded, a case of its own: tests/wire/test_codec.py)."""
        while True:
            kind = self.added_type(depth)
            if not _zero_width(kind):
                return kind


def _zero_width(node) -> bool:
    if isinstance(node, str):
        return node == "null"
    if isinstance(node, list):
        return False
    if node["type"] == "fixed":
        return node["size"] == 0
    if node["type"] == "record":
        return all(_zero_width(f["type"]) for f in node["fields"])
    return False


# -- writing records with a drawn schema -------------------------------------------------

def _writable(node):
    """The schema with every odd fixed size made a count (the records of a refused schema must
    still be writable bytes)."""
    if isinstance(node, list):
        return [_writable(b) for b in node]
    if isinstance(node, dict):
        if node.get("type") == "fixed" and (type(node["size"]) is not int or node["size"] < 0):
            node["size"] = 4
        for key in ("type", "items", "values"):
            if key in node and not isinstance(node[key], str):
                node[key] = _writable(node[key])
        for f in node.get("fields", ()):
            f["type"] = _writable(f["type"])
    return node


def _plain(node):
    """Every logical type taken off (a crude walk of its own, not the stage's: no default in
    these schemas holds a dict). fastavro's parser refuses some logical types Avro tells a
    reader to ignore, and the bytes do not depend on them."""
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items() if k not in ("logicalType", "precision", "scale")}
    return node


def _named(doc) -> dict:
    out = {}

    def walk(node):
        if isinstance(node, list):
            for b in node:
                walk(b)
        elif isinstance(node, dict):
            if node.get("type") in ("record", "enum", "fixed"):
                out[node["name"]] = node
            for key in ("type", "items", "values"):
                if key in node and not isinstance(node[key], str):
                    walk(node[key])
            for f in node.get("fields", ()):
                walk(f["type"])
    walk(doc)
    return out


def _resolve(node, named: dict):
    if isinstance(node, str) and node not in _PRIMITIVES:
        return named[node.rpartition(".")[2]]
    if isinstance(node, dict) and not isinstance(node["type"], str):
        return _resolve(node["type"], named)
    if isinstance(node, dict) and node["type"] in _PRIMITIVES:
        return node["type"]
    return node


_PRIMITIVES = frozenset(("null", "boolean", "int", "long", "float", "double", "bytes", "string"))


def _fill(node, value, rng: random.Random, named: dict):
    """``value`` (a record of ours) with the added fields' values drawn, recursively."""
    node = _resolve(node, named)
    if isinstance(node, list):
        if isinstance(value, dict):
            records = [b for b in (_resolve(x, named) for x in node)
                       if isinstance(b, dict) and b["type"] == "record"]
            return _fill(records[0], value, rng, named)
        return value
    if isinstance(node, dict) and node["type"] == "record":
        out = {}
        for f in node["fields"]:
            if f["name"].startswith(ADDED):
                out[f["name"]] = _draw_value(f["type"], rng, named)
            else:
                out[f["name"]] = _fill(f["type"], value[f["name"]], rng, named)
        return out
    if isinstance(node, dict) and node["type"] == "array":
        return [_fill(node["items"], v, rng, named) for v in value]
    if isinstance(node, dict) and node["type"] == "map":
        return {k: _fill(node["values"], v, rng, named) for k, v in value.items()}
    if node == "bytes" and isinstance(value, str):   # a string of ours written as bytes
        return value.encode()
    return value


def _draw_value(node, rng: random.Random, named: dict):
    node = _resolve(node, named)
    if isinstance(node, list):
        return _draw_value(rng.choice(node), rng, named)
    if isinstance(node, str):
        return {"null": None, "boolean": rng.random() < 0.5,
                "int": rng.randint(-(2**31), 2**31 - 1), "long": rng.randint(-(2**63), 2**63 - 1),
                "float": rng.uniform(-1e6, 1e6), "double": rng.uniform(-1e12, 1e12),
                "bytes": rng.randbytes(rng.randint(0, 24)),
                "string": "".join(rng.choice("abcé✓-0") for _ in range(rng.randint(0, 12)))}[node]
    kind = node["type"]
    if kind == "fixed":
        return rng.randbytes(node["size"])
    if kind == "enum":
        return rng.choice(node["symbols"])
    if kind == "array":
        return [_draw_value(node["items"], rng, named) for _ in range(rng.randint(0, 3))]
    if kind == "map":
        return {f"k{i}": _draw_value(node["values"], rng, named) for i in range(rng.randint(0, 3))}
    return {f["name"]: _draw_value(f["type"], rng, named) for f in node["fields"]}
