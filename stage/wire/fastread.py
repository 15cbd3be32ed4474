"""The fast path of ``AvroCodec.decode`` for an input record written with our own schema.

Decoding an input record took three passes (profiled in docs/performance.md, issue 31): the
decode budget's walk (``stage.wire.bounds``), fastavro's generic reader (a dict lookup and a type
dispatch per value, ~0.3 us each) and the ``int`` range check. ``FastReader`` is one generated
Python function per schema that reads the bytes once, building the record as fastavro would,
while doing the walk's checks with the walk's own costs: 2-3x cheaper than the three passes.

It is an optimisation only, never a second judge of the input: it returns the record only when
the bytes take the common path (each length and count within the input and the budget, every
union and enum index in range, each ``int`` within 32 bits, booleans 0 or 1, varints under 2^63,
valid UTF-8, no trailing bytes), and None for anything else, and the codec then decodes the
same bytes the careful way, which refuses them with its precise reason (or accepts them: a
negative block count, a negative union index). So whenever it returns a record, the careful
path accepts the bytes and returns an equal record (tests/wire/test_fastread.py checks both on
valid and mutated records). Schemas with maps or logical types get no fast reader.
"""

from __future__ import annotations

import struct
from typing import Any

from .bounds import _SLOT, DecodeBudget, _Generator as _CostModel
from .guard import PRIMITIVES, fixed_size, named_types

_MAX_INLINE_DEPTH = 12   # as the budget's walk: arrays and unions deeper get a function of their own
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1


class _Slow(Exception):
    """The bytes leave the common path: the careful decode decides."""


class _Unsupported(Exception):
    """The schema has a construct the fast path does not read (maps, logical types)."""


def _read_long(data, pos: int) -> tuple[int, int]:
    """Multi-byte zig-zag varint at ``pos``; _Slow at 2^63 and above (fastavro's C reader
    keeps 64 bits; whatever it makes of more is left to it)."""
    b = data[pos]
    pos += 1
    n, shift = b & 0x7F, 7
    while b & 0x80:
        if shift > 56:
            raise _Slow
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
    if n >> 63:
        raise _Slow
    return (n >> 1) ^ -(n & 1), pos


class FastReader:
    """The generated reader of ``parsed`` (our schema, fastavro-parsed), costed by ``budget``
    (the same schema's walk). ``build`` returns None for a schema it cannot read."""

    def __init__(self, parsed: Any, what: str, budget: DecodeBudget) -> None:
        self.what = what
        self._budget = budget
        gen = _Writer(named_types(parsed), budget, what)
        entry = gen.function(parsed, what)
        self.source = gen.source()
        namespace = dict(gen.consts)
        exec(compile(self.source, f"<fast reader of {what}>", "exec"), namespace)
        self._read = namespace[entry]

    @classmethod
    def build(cls, parsed: Any, what: str, budget: DecodeBudget | None) -> FastReader | None:
        if budget is None:
            return None
        try:
            return cls(parsed, what, budget)
        except (_Unsupported, RecursionError, SyntaxError):
            return None

    def read(self, data: bytes, start: int, size: int) -> dict | None:
        """The record ``data[start:size]`` holds, or None: decode it the careful way."""
        acc = [self._budget._cost + 2 * size, self._budget.limit(size)]
        if acc[0] > acc[1]:
            return None
        try:
            record, pos = self._read(data, start, size, acc)
        except (_Slow, IndexError, UnicodeDecodeError, struct.error):
            return None
        return record if pos == size else None


class _Writer:
    """Writes the reader's source; each ``_emit`` appends code that leaves a node's value in a
    fresh local and returns that local's name (or a constant expression)."""

    def __init__(self, named, budget: DecodeBudget, what: str) -> None:
        self.named = named
        self.what = what
        # The budget's generator, used for its cost arithmetic only: the items of each array
        # are charged exactly as the walk charges them.
        self.costs = _CostModel(named, {}, budget.ratio, budget.slack, what)
        self.consts: dict[str, Any] = {"_Slow": _Slow, "read_long": _read_long,
                                       "F32": struct.Struct("<f").unpack_from,
                                       "F64": struct.Struct("<d").unpack_from}
        self.functions: list[list[str]] = []
        self.vars = 0

    def source(self) -> str:
        return "\n\n".join("\n".join(lines) for lines in self.functions)

    def const(self, value: Any) -> str:
        name = f"K{len(self.consts)}"
        self.consts[name] = value
        return name

    def var(self) -> str:
        self.vars += 1
        return f"v{self.vars}"

    def function(self, node: Any, path: str) -> str:
        name = f"read_{len(self.functions)}"
        lines = [f"def {name}(data, pos, end, acc):"]
        self.functions.append(lines)
        body: list[str] = []
        value = self._emit(node, path, body, 1)
        lines.extend(body)
        lines.append(f"    return {value}, pos")
        return name

    def _emit(self, node: Any, path: str, out: list[str], indent: int) -> str:
        pad = "    " * indent
        if isinstance(node, str) and node not in PRIMITIVES:
            node = self.named[node]
        if isinstance(node, str):
            return self._primitive(node, out, pad)
        if isinstance(node, list) or node["type"] == "array":
            if indent > _MAX_INLINE_DEPTH:
                name, value = self.function(node, path), self.var()
                out.append(f"{pad}{value}, pos = {name}(data, pos, end, acc)")
                return value
        if isinstance(node, list):
            return self._union(node, path, out, indent)
        if "logicalType" in node:
            raise _Unsupported(node["logicalType"])
        kind = node["type"]
        if kind in ("record", "error"):
            value = self.var()
            fields = [(f["name"], self._emit(f["type"], f"{path}.{f['name']}", out, indent))
                      for f in node["fields"]]
            out.append(f"{pad}{value} = {{{', '.join(f'{ascii(k)}: {v}' for k, v in fields)}}}")
            return value
        if kind == "enum":
            value, symbols = self.var(), tuple(node["symbols"])
            out += _varint(value, pad)
            out += [f"{pad}if not 0 <= {value} < {len(symbols)}:", f"{pad}    raise _Slow",
                    f"{pad}{value} = {self.const(symbols)}[{value}]"]
            return value
        if kind == "fixed":
            value, width = self.var(), fixed_size(node, self.what)
            out += [f"{pad}{value} = data[pos:pos + {width}]", f"{pad}pos += {width}"]
            return value
        if kind == "array":
            return self._array(node, path, out, indent)
        if kind in PRIMITIVES:   # {"type": "long"}
            return self._primitive(kind, out, pad)
        raise _Unsupported(kind)   # map

    def _primitive(self, kind: str, out: list[str], pad: str) -> str:
        if kind == "null":
            return "None"
        value = self.var()
        if kind in ("int", "long"):
            out += _varint(value, pad, check_int=kind == "int")
        elif kind == "boolean":
            out += [f"{pad}{value} = data[pos]", f"{pad}pos += 1",
                    f"{pad}if {value} > 1:", f"{pad}    raise _Slow",
                    f"{pad}{value} = {value} == 1"]
        elif kind in ("float", "double"):
            width = 4 if kind == "float" else 8
            out += [f"{pad}{value} = {'F32' if width == 4 else 'F64'}(data, pos)[0]",
                    f"{pad}pos += {width}"]
        else:   # string, bytes: a one-byte length running past the end ends the read later
            out += [f"{pad}n = data[pos]",
                    f"{pad}if n < 128 and not n & 1:",
                    f"{pad}    pos += 1",
                    f"{pad}    n >>= 1",
                    f"{pad}else:",
                    f"{pad}    n, pos = read_long(data, pos)",
                    f"{pad}    if n < 0 or n > end - pos:",
                    f"{pad}        raise _Slow",
                    f"{pad}{value} = data[pos:pos + n]{'.decode()' if kind == 'string' else ''}",
                    f"{pad}pos += n"]
        return value

    def _union(self, branches: list, path: str, out: list[str], indent: int) -> str:
        pad = "    " * indent
        index, value = f"u{indent}", self.var()
        out += _varint(index, pad)
        for i, branch in enumerate(branches):
            out.append(f"{pad}{'if' if i == 0 else 'elif'} {index} == {i}:")
            body: list[str] = []
            got = self._emit(branch, path, body, indent + 1)
            out += body + [f"{pad}    {value} = {got}"]
        out += [f"{pad}else:", f"{pad}    raise _Slow"]
        return value

    def _array(self, node: dict, path: str, out: list[str], indent: int) -> str:
        pad = "    " * indent
        value, count = self.var(), f"c{indent}"
        item_cost, least = self.costs._emit(node["items"], f"{path}[]", [], indent + 2)
        item_cost, least = item_cost + _SLOT, max(least, 1)
        body: list[str] = []
        item = self._emit(node["items"], f"{path}[]", body, indent + 2)
        out += [f"{pad}{value} = []", f"{pad}while True:"]
        out += _varint(count, pad + "    ")
        out += [f"{pad}    if {count} == 0:",
                f"{pad}        break",
                f"{pad}    if {count} < 0 or {count} * {least} > end - pos:",
                f"{pad}        raise _Slow",
                f"{pad}    acc[0] += {count} * {item_cost}",
                f"{pad}    if acc[0] > acc[1]:",
                f"{pad}        raise _Slow",
                f"{pad}    for _ in range({count}):"]
        out += body + [f"{pad}        {value}.append({item})"]
        return value


def _varint(var: str, pad: str, *, check_int: bool = False) -> list[str]:
    """``var`` = the zig-zag varint at ``pos``, the one-byte case inline; with ``check_int``,
    _Slow unless it fits 32 bits (fastavro reads any varint into an ``int`` field)."""
    lines = [f"{pad}{var} = data[pos]",
             f"{pad}if {var} < 128:",
             f"{pad}    pos += 1",
             f"{pad}    {var} = ({var} >> 1) ^ -({var} & 1)",
             f"{pad}else:",
             f"{pad}    {var}, pos = read_long(data, pos)"]
    if check_int:
        lines += [f"{pad}    if not {_INT_MIN} <= {var} <= {_INT_MAX}:", f"{pad}        raise _Slow"]
    return lines
