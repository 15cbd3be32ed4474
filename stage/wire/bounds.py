"""The decode budget: what the encoded bytes of a record may cost once decoded, checked on the
bytes before fastavro materializes anything.

fastavro builds every array item and map entry as Python objects, and small items inflate: a
2-byte empty ``GroupLabel`` decodes to a ~200-byte dict (measured: a 2 MiB receipt of 1,048,576
empty labels took 201 MB before the decoder could refuse it). ``DecodeBudget.check`` walks the
bytes with the writer schema, building nothing, and refuses the record as soon as

* a string or bytes length, an array or map block count, or a union index cannot be what the
  remaining input holds (a count needs at least ``count x`` its item's smallest encoding), or
* the objects the decode would build (each block's count x its item's object size, plus the
  root record's own) exceed ``ratio x len(data) + slack``.

Object sizes are CPython's (``sys.getsizeof`` of what fastavro builds), rounded up: a string
costs its header plus its text, at most its UTF-8 length; a number its boxed size; a record its
dict. The text of strings and bytes, with one transient copy while it is read, is at most twice
the input, counted once for the record.

The walk is generated Python source (the schema's names appear only escaped, in comments;
every number in it is an int the generator computed), the whole schema inlined into one function (a varint is
skipped, not decoded; only unions and arrays nested deeper than Python's block limit allows move
into functions of their own): ~4x cheaper than a walk of nested closures, and a fraction of the
decode it protects (``python -m stage.bench.wire``). Each function has the signature
``(data, pos, end, acc) -> pos``, with ``acc = [cost so far, limit]``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .errors import WireError
from .guard import PRIMITIVES, fixed_size, named_types

# The default budget of an input record: 16x its bytes + 64 KiB keeps the decoded objects of
# any input record under ~20x its size (tests/wire/test_bounds.py measures it with tracemalloc)
# while the largest legitimate ratio, a receipt's manifest of 64-hex digests, is ~8x.
BUDGET_RATIO = 16
BUDGET_SLACK = 64 * 1024
MAX_SCHEMA_NODES = 20_000   # a registry schema whose walk would be larger is refused
_MAX_INLINE_DEPTH = 12       # unions and arrays nested deeper move to a function of their
                             # own (Python's compiler allows 20 nested blocks)

_NUMBER = 36          # a boxed int of up to 64 bits (small ints are shared, costed anyway)
_FLOAT = 24
_STR = 80             # a str header of any kind (ASCII, latin-1, UCS-2, UCS-4); text is extra
_BYTES = 40
_LOGICAL = 128        # a logical type's object (datetime, Decimal, UUID) on top of its base
_LIST = 64
_SLOT = 18            # a list slot with its over-allocation, doubled for the copy on growth
_ENTRY = 112          # a dict entry with its index and a resize's transient second table
_DEFAULTED = 128      # a field the reader's schema adds with its default (resolution)
_FIXED_COSTS = {"null": 0, "boolean": 0, "int": _NUMBER, "long": _NUMBER, "float": _FLOAT,
                "double": _FLOAT}
_WIDTHS = {"boolean": 1, "float": 4, "double": 8}


def _dict_cost(fields: int) -> int:
    """Size of a dict of ``fields`` string keys built by insertion, as fastavro builds one."""
    d: dict = {}
    for i in range(fields):
        d[f"f{i}"] = None
    return sys.getsizeof(d)


def read_long(data, pos: int) -> tuple[int, int]:
    """Zig-zag varint at ``pos``: (value, position after). IndexError past the end."""
    b = data[pos]
    pos += 1
    n, shift = b & 0x7F, 7
    while b & 0x80:
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
    return (n >> 1) ^ -(n & 1), pos


def _bad_length(kind: str, n: int, left: int, path: str):
    raise WireError(f"{kind} length {n}, {left} bytes are left", field=path)


def _bad_count(count: int, least: int, left: int, path: str):
    raise WireError(f"a block claims {count} items of at least {least} bytes; {left} bytes "
                    "are left", field=path)


def _bad_union(index: int, branches: int, path: str):
    raise WireError(f"union index {index} of {branches} branches", field=path)


def _over(items: int, limit: int, ratio: float, slack: int, path: str):
    raise WireError(f"{items} items would decode to more than {limit} bytes of objects "
                    f"({ratio}x the record's bytes + {slack}); refused before decoding",
                    field=path)


class DecodeBudget:
    """The compiled walk of one writer schema (``parsed``, from fastavro's ``parse_schema``).

    ``reader``: our schema when the writer's differs, so that the fields the reader adds with
    their default are costed too. ``what`` names the record in errors (``ReceiptEvent``)."""

    def __init__(self, parsed: Any, what: str, *, reader: Any = None,
                 ratio: float = BUDGET_RATIO, slack: int = BUDGET_SLACK) -> None:
        self.what = what
        self.ratio = ratio
        self.slack = slack
        gen = _Generator(named_types(parsed), _record_fields(reader) if reader is not None else {},
                         ratio, slack, what)
        try:
            entry, self._cost, _ = gen.function(parsed, what)
            namespace = gen.compile()
        except WireError:
            raise
        except (RecursionError, SyntaxError, MemoryError):
            raise WireError(f"{what}: the schema is too deeply nested to vet") from None
        except (KeyError, TypeError, ValueError) as e:   # fastavro parsed something we cannot walk
            raise WireError(f"{what}: the schema cannot be walked: {type(e).__name__}: {e}") from None
        self._scan = namespace[entry]
        self.source = gen.source()   # kept for reading: what the walk does, field by field

    def limit(self, size: int) -> int:
        return int(self.ratio * size) + self.slack

    def check(self, data, start: int, size: int) -> int:
        """The estimated bytes of the record's decoded objects; WireError unless
        ``data[start:size]`` can be a record of the schema that fits the budget."""
        acc = [self._cost + 2 * size, self.limit(size)]
        if acc[0] > acc[1]:
            raise WireError(f"{self.what}: a record of {size} bytes cannot decode within "
                            f"{self.ratio}x its size + {self.slack} bytes")
        try:
            end = self._scan(data, start, size, acc)
        except IndexError:
            raise WireError(f"cannot decode {self.what}: the input ends inside a field "
                            f"({size} bytes)") from None
        if end > size:
            raise WireError(f"cannot decode {self.what}: a field runs {end - size} bytes past "
                            f"the end of the {size}-byte input")
        return acc[0]


class _Generator:
    """Writes the walk's source: ``function`` per function, ``_emit`` per node inline."""

    def __init__(self, named: Mapping[str, Any], reader_fields: Mapping[str, tuple[str, ...]],
                 ratio: float, slack: int, what: str) -> None:
        self.named = named
        self.reader_fields = reader_fields
        self.consts: dict[str, Any] = {"read_long": read_long, "_bad_length": _bad_length,
                                       "_bad_count": _bad_count, "_bad_union": _bad_union,
                                       "_over": _over, "RATIO": ratio, "SLACK": slack}
        self.functions: list[list[str]] = []
        self.nodes = 0
        self.what = what

    def source(self) -> str:
        return "\n\n".join("\n".join(lines) for lines in self.functions)

    def compile(self) -> dict[str, Any]:
        namespace = dict(self.consts)
        exec(compile(self.source(), f"<decode budget of {self.what}>", "exec"), namespace)
        return namespace

    def const(self, value: Any) -> str:
        name = f"K{len(self.consts)}"
        self.consts[name] = value
        return name

    def function(self, node: Any, path: str) -> tuple[str, int, int]:
        """A function walking ``node``: (its name, the node's fixed cost, smallest encoding)."""
        name = f"walk_{len(self.functions)}"
        lines = [f"def {name}(data, pos, end, acc):", f"    # {_comment(path)}"]
        self.functions.append(lines)
        body: list[str] = []
        cost, least = self._emit(node, path, body, 1)
        lines.extend(body)
        lines.append("    return pos")
        return name, cost, least

    def _emit(self, node: Any, path: str, out: list[str], indent: int) -> tuple[int, int]:
        """Append code advancing ``pos`` past ``node``; return its (fixed cost, least bytes)."""
        self.nodes += 1
        if self.nodes > MAX_SCHEMA_NODES:
            raise WireError(f"{self.what}: the schema's walk exceeds {MAX_SCHEMA_NODES} nodes")
        pad = "    " * indent
        if isinstance(node, str) and node not in PRIMITIVES:
            node = self.named[node]
        if isinstance(node, str):
            return self._primitive(node, path, out, pad)
        if isinstance(node, list) or (isinstance(node, dict) and node["type"] in ("array", "map")):
            if indent > _MAX_INLINE_DEPTH:   # a function of its own, with fresh blocks
                name, cost, least = self.function(node, path)
                out.append(f"{pad}pos = {name}(data, pos, end, acc)")
                return cost, least
        if isinstance(node, list):
            return self._union(node, path, out, indent)
        kind = node["type"]
        if kind in ("record", "error"):
            return self._record(node, path, out, indent)
        if kind == "enum":
            out += _skip_varint(pad)
            return 0, 1
        if kind == "fixed":
            size = fixed_size(node, self.what)
            _advance(out, pad, size)
            return _BYTES + size, size
        if kind in ("array", "map"):
            return self._container(node, path, out, indent)
        cost, least = self._emit(kind, path, out, indent)   # {"type": "long", ...}
        return cost + (_LOGICAL if "logicalType" in node else 0), least

    def _primitive(self, kind: str, path: str, out: list[str], pad: str) -> tuple[int, int]:
        if kind in ("int", "long"):
            out += _skip_varint(pad)
        elif kind in _WIDTHS:
            _advance(out, pad, _WIDTHS[kind])
        elif kind in ("string", "bytes"):
            # A one-byte length (0..63) needs no check here: running past the end fails at the
            # next read or at the end of the walk.
            out += [f"{pad}n = data[pos]",
                    f"{pad}if n < 128 and not n & 1:",
                    f"{pad}    pos += 1 + (n >> 1)",
                    f"{pad}else:",
                    f"{pad}    n, pos = read_long(data, pos)",
                    f"{pad}    if n < 0 or n > end - pos:",
                    f"{pad}        _bad_length({kind!r}, n, end - pos, {self.const(path)})",
                    f"{pad}    pos += n"]
            return (_STR if kind == "string" else _BYTES), 1
        return _FIXED_COSTS[kind], _WIDTHS.get(kind, 0 if kind == "null" else 1)

    def _record(self, node: dict, path: str, out: list[str], indent: int) -> tuple[int, int]:
        names = [f["name"] for f in node["fields"]]
        added = [n for n in self.reader_fields.get(_short(node["name"]), ()) if n not in names]
        cost = _dict_cost(len(names) + len(added)) + len(added) * _DEFAULTED
        least = 0
        for f in node["fields"]:
            out.append(f"{'    ' * indent}# {_comment('.' + f['name'])}")
            c, n = self._emit(f["type"], f"{path}.{f['name']}", out, indent)
            cost, least = cost + c, least + n
        return cost, least

    def _union(self, branches: list, path: str, out: list[str], indent: int) -> tuple[int, int]:
        pad = "    " * indent
        var = f"u{indent}"
        out += _read_varint(var, pad)
        out += [f"{pad}if {var} < 0:", f"{pad}    {var} += {len(branches)}"]
        cost = 0
        for i, branch in enumerate(branches):
            out.append(f"{pad}{'if' if i == 0 else 'elif'} {var} == {i}:")
            body: list[str] = []
            c, _ = self._emit(branch, path, body, indent + 1)
            out += body or [f"{pad}    pass"]
            cost = max(cost, c)   # the largest branch is counted, whichever the bytes take
        out += [f"{pad}else:", f"{pad}    _bad_union({var}, {len(branches)}, {self.const(path)})"]
        return cost, 1

    def _container(self, node: dict, path: str, out: list[str], indent: int) -> tuple[int, int]:
        pad, inner = "    " * indent, "    " * (indent + 2)
        count, seen = f"c{indent}", f"s{indent}"
        body: list[str] = []
        if node["type"] == "map":   # an entry: its key string, its dict entry
            key_cost, _ = self._primitive("string", f"{path}[key]", body, inner)
            c, least = self._emit(node["values"], f"{path}[]", body, indent + 2)
            item_cost, least = key_cost + c + _ENTRY, least + 1
        else:
            c, least = self._emit(node["items"], f"{path}[]", body, indent + 2)
            item_cost = c + _SLOT
        least = max(least, 1)   # check_decodable refuses zero-width items in writer schemas
        where = self.const(path)
        out += [f"{pad}{seen} = 0", f"{pad}while True:"]
        out += _read_varint(count, pad + "    ")
        out += [f"{pad}    if {count} == 0:",
                f"{pad}        break",
                f"{pad}    if {count} < 0:   # then the block's byte size",
                f"{pad}        {count} = -{count}"]
        out += _skip_varint(pad + "        ")
        out += [f"{pad}    if {count} * {least} > end - pos:",
                f"{pad}        _bad_count({count}, {least}, end - pos, {where})",
                f"{pad}    {seen} += {count}",
                f"{pad}    acc[0] += {count} * {item_cost}",
                f"{pad}    if acc[0] > acc[1]:",
                f"{pad}        _over({seen}, acc[1], RATIO, SLACK, {where})",
                f"{pad}    for _ in range({count}):"]
        out += body
        return _LIST, 1


def _advance(out: list[str], pad: str, width: int) -> None:
    """``pos += width``, merged into the statement before when that one is a ``pos += k`` of
    the same block (the last byte of a varint, fixed-width fields in a row)."""
    prefix = f"{pad}pos += "
    for i in range(len(out) - 1, -1, -1):
        line = out[i]
        if line.lstrip().startswith("#"):
            continue
        if line.startswith(prefix) and line[len(prefix):].isdigit():
            out[i] = f"{prefix}{int(line[len(prefix):]) + width}"
            return
        break
    out.append(f"{prefix}{width}")


def _skip_varint(pad: str) -> list[str]:
    return [f"{pad}while data[pos] > 127:", f"{pad}    pos += 1", f"{pad}pos += 1"]


def _read_varint(var: str, pad: str) -> list[str]:
    """``var`` = the zig-zag varint at ``pos``; the one-byte case inline."""
    return [f"{pad}{var} = data[pos]",
            f"{pad}if {var} < 128:",
            f"{pad}    pos += 1",
            f"{pad}    {var} = ({var} >> 1) ^ -({var} & 1)",
            f"{pad}else:",
            f"{pad}    {var}, pos = read_long(data, pos)"]


def _comment(text: str) -> str:
    """Schema text (a registry writer's names are anything fastavro accepts, newlines
    included) made safe for a comment of the generated source: escaped, on one line."""
    return ascii(text)[1:-1]


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _record_fields(parsed: Any) -> Mapping[str, tuple[str, ...]]:
    """Record name (without namespace) -> its field names, for every record of ``parsed``."""
    out: dict[str, tuple[str, ...]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for branch in node:
                walk(branch)
        elif isinstance(node, dict):
            kind = node.get("type")
            if kind in ("record", "error"):
                out[_short(node["name"])] = tuple(f["name"] for f in node["fields"])
                for f in node["fields"]:
                    walk(f["type"])
            elif kind == "array":
                walk(node["items"])
            elif kind == "map":
                walk(node["values"])
    walk(parsed)
    for named in named_types(parsed).values():
        walk(named)
    return out
