"""rollout-reassembler: verified canonical GRPO rows from staged model calls.

The package root holds the version and ``lazy_exports`` (PEP 562), with which the packages whose
modules need torch (client, finalize, publish, routes, wire) list their public names by
submodule: a submodule is imported on first use of one of its names, so a command that needs a
light module (the settings model, the Avro codecs) does not pay the 1-2 s and ~300 MB of
importing torch. ``rollout-reassembler --help``, ``topics``, ``inspect`` and ``dead-letters``
never import it (tests/test_cli_imports.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

__version__ = "0.1.0"


def lazy_exports(package: str, namespace: dict, table: Mapping[str, tuple[str, ...]],
                 aliases: Mapping[str, str] | None = None):
    """``(__getattr__, __dir__)`` for the package ``package`` whose globals are ``namespace``:
    ``table`` maps a submodule (relative name) to the names it exports, ``aliases`` another name
    to one of those. A name is bound in the package's namespace once imported, so later lookups
    are plain attribute reads."""
    aliases = dict(aliases or {})
    where = {name: module for module, names in table.items() for name in names}

    def __getattr__(name: str):
        target = aliases.get(name, name)
        module = where.get(target)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), target)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where) | set(aliases))

    return __getattr__, __dir__
