"""Two schema walks fastavro does not do for us.

``check_decodable``: fastavro's C reader trusts the writer schema. A recursive schema lets
input nest as deep as it is long (measured: a 100 kB record segfaults the interpreter), and an
array whose items encode in zero bytes (``null``, an empty record) lets a one-byte block count
claim 2^60 items that the reader then loops over and allocates. fastavro's parser also takes
any JSON value as a ``fixed`` size (``"16"``, ``null``, ``[1]``). Our schemas have none of
these; a writer schema fetched from a registry is checked before it is ever used to read bytes.

``find_error``: fastavro's validator names the enclosing *named type*
(``PackedTensor.shape``), not the path, and prints the whole datum (megabytes of bytes). This
walk is only run after fastavro rejected a record, to say exactly where and why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .errors import WireError

PRIMITIVES = frozenset(("null", "boolean", "int", "long", "float", "double", "bytes", "string"))
_MIN_BYTES = {"null": 0, "boolean": 1, "int": 1, "long": 1, "float": 4, "double": 8,
              "bytes": 1, "string": 1}
_INT_RANGE = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}


def named_types(parsed: Any) -> Mapping[str, Any]:
    return parsed.get("__named_schemas", {}) if isinstance(parsed, dict) else {}


def check_decodable(parsed: Any, what: str) -> None:
    """Raise WireError if ``parsed`` is recursive, has an array of zero-width items or a
    ``fixed`` whose size is not a count of bytes."""
    _min_bytes(parsed, named_types(parsed), (), {}, what)


def fixed_size(node: Mapping[str, Any], what: str) -> int:
    """The byte count of a ``fixed`` node. fastavro's parser takes any JSON value for ``size``
    (``"16"``, ``null``, ``[1]``, ``true``); Avro allows a non-negative integer only."""
    size = node.get("size")
    if type(size) is not int or size < 0:
        raise WireError(f"{what}: fixed {node.get('name')!r} size {size!r} is not a count of "
                        "bytes (a non-negative integer)")
    return size


def _min_bytes(node: Any, named: Mapping[str, Any], stack: tuple, memo: dict, what: str) -> int:
    if isinstance(node, str):
        if node in PRIMITIVES:
            return _MIN_BYTES[node]
        if node in stack:
            raise WireError(f"{what}: recursive type {node} is not accepted (unbounded nesting)")
        if node not in memo:
            memo[node] = _min_bytes(named[node], named, stack, memo, what)
        return memo[node]
    if isinstance(node, list):  # union: the branch index is at least one byte
        for branch in node:
            _min_bytes(branch, named, stack, memo, what)
        return 1
    kind = node["type"]
    if kind in ("record", "error"):
        name = node["name"]
        if name in stack:
            raise WireError(f"{what}: recursive type {name} is not accepted (unbounded nesting)")
        size = sum(_min_bytes(f["type"], named, stack + (name,), memo, what) for f in node["fields"])
        memo[name] = size
        return size
    if kind == "enum":
        return 1
    if kind == "fixed":
        return fixed_size(node, what)
    if kind == "array":
        if _min_bytes(node["items"], named, stack, memo, what) == 0:
            raise WireError(f"{what}: array items encode in zero bytes, so a block count alone "
                            "could make a reader loop and allocate without bound")
        return 1
    if kind == "map":  # every entry carries a key string (>= 1 byte)
        _min_bytes(node["values"], named, stack, memo, what)
        return 1
    return _min_bytes(kind, named, stack, memo, what)  # {"type": "long", ...} wrappers


def _describe(datum: Any) -> str:
    text = repr(datum)
    return f"{type(datum).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def find_error(schema: Any, datum: Any, path: str, named: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first violation of ``schema`` in ``datum`` as ``(path, reason)``, or None."""
    node = named.get(schema, schema) if isinstance(schema, str) else schema
    if isinstance(node, list):
        return _union_error(node, datum, path, named)
    kind = node if isinstance(node, str) else node["type"]
    if kind in PRIMITIVES:
        return None if _primitive_ok(kind, datum) else (path, f"expected {kind}, got {_describe(datum)}")
    if kind in ("record", "error"):
        if not isinstance(datum, Mapping):
            return path, f"expected a {node['name']} record (dict), got {_describe(datum)}"
        fields = {f["name"]: f for f in node["fields"]}
        for key in datum:
            if key not in fields:
                return f"{path}.{key}", f"not a field of {node['name']}"
        for name, f in fields.items():
            if name not in datum:
                if "default" not in f:
                    return f"{path}.{name}", "missing (the field has no default)"
                continue
            err = find_error(f["type"], datum[name], f"{path}.{name}", named)
            if err:
                return err
        return None
    if kind == "enum":
        if isinstance(datum, str) and datum in node["symbols"]:
            return None
        return path, f"{_describe(datum)} is not a symbol of {node['name']} {node['symbols']}"
    if kind == "fixed":
        ok = isinstance(datum, (bytes, bytearray)) and len(datum) == node["size"]
        return None if ok else (path, f"expected {node['size']} fixed bytes, got {_describe(datum)}")
    if kind == "array":
        if not isinstance(datum, (list, tuple)):
            return path, f"expected an array (list), got {_describe(datum)}"
        for i, item in enumerate(datum):
            err = find_error(node["items"], item, f"{path}[{i}]", named)
            if err:
                return err
        return None
    if kind == "map":
        if not isinstance(datum, Mapping):
            return path, f"expected a map (dict), got {_describe(datum)}"
        for key, value in datum.items():
            if not isinstance(key, str):
                return path, f"map key {_describe(key)} is not a string"
            err = find_error(node["values"], value, f"{path}[{key!r}]", named)
            if err:
                return err
        return None
    return find_error(kind, datum, path, named)


def _primitive_ok(kind: str, datum: Any) -> bool:
    if kind == "null":
        return datum is None
    if kind == "boolean":
        return isinstance(datum, bool)
    if kind in _INT_RANGE:
        lo, hi = _INT_RANGE[kind]
        return isinstance(datum, int) and not isinstance(datum, bool) and lo <= datum <= hi
    if kind in ("float", "double"):
        return isinstance(datum, (int, float)) and not isinstance(datum, bool)
    if kind == "bytes":
        return isinstance(datum, (bytes, bytearray))
    return isinstance(datum, str)


def _union_error(branches: list, datum: Any, path: str, named: Mapping[str, Any]) -> tuple[str, str] | None:
    errors = []
    for branch in branches:
        err = find_error(branch, datum, path, named)
        if err is None:
            return None
        errors.append((branch, err))
    # A dict was meant for the record branch: its inner error is the useful one.
    if isinstance(datum, Mapping):
        for branch, err in errors:
            node = named.get(branch, branch) if isinstance(branch, str) else branch
            if isinstance(node, dict) and node.get("type") in ("record", "error"):
                return err
    names = [b if isinstance(b, str) else b.get("name", b.get("type")) for b in branches]
    return path, f"{_describe(datum)} matches no branch of {names}"


def int_range_checker(parsed: Any) -> Callable[[Any], tuple[str, int] | None]:
    """Checker of a *decoded* record's 32-bit ``int`` fields: the only values fastavro's
    reader can produce outside the schema (it decodes any varint into them). Returns the
    failing sub-path and value, or None. It walks only the parts of the schema that contain
    an ``int``: ~10x cheaper than a full validation of a 32-call receipt."""
    return _int_check(parsed, named_types(parsed)) or (lambda record: None)


def _int_leaf(v: int) -> tuple[str, int] | None:
    return None if -(2**31) <= v < 2**31 else ("", v)


def _int_check(node: Any, named: Mapping[str, Any]) -> Callable[[Any], tuple[str, int] | None] | None:
    if isinstance(node, str):
        if node == "int":
            return _int_leaf
        return None if node in PRIMITIVES else _int_check(named[node], named)
    if isinstance(node, list):
        has_int = "int" in node and "long" not in node  # a long branch may hold any value
        records = [c for b in node if b != "int" and (c := _int_check(b, named)) is not None]
        if not has_int and not records:
            return None

        def union(v):
            if has_int and type(v) is int:
                return _int_leaf(v)
            if isinstance(v, dict):
                for check in records:
                    if (r := check(v)) is not None:
                        return r
            return None
        return union
    kind = node["type"]
    if kind in ("record", "error"):
        subs = [(f["name"], c) for f in node["fields"] if (c := _int_check(f["type"], named))]
        if not subs:
            return None

        def record(v):
            for name, check in subs:
                if name in v and (r := check(v[name])) is not None:
                    return f".{name}{r[0]}", r[1]
            return None
        return record
    if kind in ("array", "map"):
        inner = _int_check(node["items" if kind == "array" else "values"], named)
        if inner is None:
            return None

        def container(v):
            for key, item in (enumerate(v) if kind == "array" else v.items()):
                if (r := inner(item)) is not None:
                    return f"[{key!r}]{r[0]}", r[1]
            return None
        return container
    if kind in ("enum", "fixed"):
        return None
    return _int_check(kind, named)
