"""What the stage takes from a registry writer schema: how its records are laid out in bytes,
nothing else. Every field is read as *our* schema types it (docs/schemas.md, Writer schemas).

A writer schema is reduced to its Parsing Canonical Form, the part that decides the encoding
(Avro: schemas with equal forms encode alike): its logical types, aliases, defaults, docs, field
orders and other properties are dropped before fastavro resolves it against ours. fastavro
alone among Avro readers converts by the *writer's* logical types (Java's reader converts by the
reader's): a ``timestamp-millis`` on ``prompt_idx`` decoded to a datetime that no row could be
encoded with, and a ``decimal`` on tensor bytes built a Decimal in time quadratic in their
length. Logical types are taken out before fastavro even parses the schema, because its parser
refuses some that Avro says a reader must ignore (a decimal whose scale exceeds its precision).
Our own schemas carry none (tests/wire/test_writer_schemas.py), so the result is our typing.
"""

from __future__ import annotations

import json
from typing import Any

from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form

from .errors import WireError
from .guard import check_decodable


def writer_encoding(schema_str: str, what: str) -> tuple[Any, str]:
    """(the parsed canonical form of a registry writer schema, that form's text). WireError
    when it cannot be used: not parseable, recursive, zero-width array items, a ``fixed`` size
    that is not a count of bytes, or anything else our walks cannot take (a refusal of the
    schema, never an outage: its records are dead letters)."""
    try:
        doc = without_logical_types(json.loads(schema_str))
        parsed = parse_schema(doc, named_schemas={})
    except Exception as e:  # noqa: BLE001 - JSON, fastavro's SchemaParseException, ...
        raise WireError(f"{what} is not a valid Avro schema: {str(e)[:300]}") from None
    try:
        check_decodable(parsed, what)
        canonical = to_parsing_canonical_form(parsed)
        return parse_schema(json.loads(canonical), named_schemas={}), canonical
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - fastavro's parser accepts more than Avro does
        raise WireError(f"{what} cannot be vetted: {type(e).__name__}: {str(e)[:200]}") from None


def without_logical_types(node: Any) -> Any:
    """The schema JSON ``node`` with ``logicalType`` taken off every type in it (fields' types,
    union branches, array items, map values; not default values, which are data)."""
    if isinstance(node, list):
        return [without_logical_types(branch) for branch in node]
    if not isinstance(node, dict):
        return node
    out = {k: v for k, v in node.items() if k != "logicalType"}
    kind = out.get("type")
    if isinstance(kind, (dict, list)):
        out["type"] = without_logical_types(kind)
    elif kind in ("record", "error") and isinstance(out.get("fields"), list):
        out["fields"] = [{**f, "type": without_logical_types(f["type"])}
                         if isinstance(f, dict) and "type" in f else f for f in out["fields"]]
    elif kind == "array" and "items" in out:
        out["items"] = without_logical_types(out["items"])
    elif kind == "map" and "values" in out:
        out["values"] = without_logical_types(out["values"])
    return out
