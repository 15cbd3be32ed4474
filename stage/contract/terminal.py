"""No-witness terminal heuristic ``select_terminal_call`` (Gym section 5.2). Reads no tokens."""

from __future__ import annotations

from dataclasses import dataclass

from .constants import (
    TERMINAL_AMBIGUOUS,
    TERMINAL_DUPLICATE_CALL_ID,
    TERMINAL_NO_RECORDS,
    TERMINAL_NO_ROOT,
    TERMINAL_ORPHANED_ROW,
    TERMINAL_SELECTED,
)


@dataclass(frozen=True)
class TerminalSelection:
    terminal_model_call_id: str | None
    reason: str


def select_terminal_call(records) -> TerminalSelection:
    """Pick the terminal call of a manifest: prefer calls that have descendants, the earliest
    admitted root first; ambiguity below the root yields no terminal."""
    records = list(records)
    if not records:
        return TerminalSelection(None, TERMINAL_NO_RECORDS)
    by_id = {}
    for record in records:
        if record.model_call_id in by_id:
            return TerminalSelection(None, TERMINAL_DUPLICATE_CALL_ID)
        by_id[record.model_call_id] = record
    if any(r.parent_call_id is not None and r.parent_call_id not in by_id for r in records):
        return TerminalSelection(None, TERMINAL_ORPHANED_ROW)
    index = {r.model_call_id: i for i, r in enumerate(records)}
    children: dict[str, list] = {r.model_call_id: [] for r in records}
    roots = []
    for record in records:
        if record.parent_call_id is None:
            roots.append(record)
        else:
            children[record.parent_call_id].append(record)
    if not roots:
        return TerminalSelection(None, TERMINAL_NO_ROOT)

    def survivors(members):
        with_children = [m for m in members if children[m.model_call_id]]
        return with_children or members

    node = min(survivors(roots), key=lambda r: (
        r.admitted_at is None, r.admitted_at or 0.0, index[r.model_call_id]))
    while True:
        kids = children[node.model_call_id]
        if not kids:
            return TerminalSelection(node.model_call_id, TERMINAL_SELECTED)
        pool = survivors(kids)
        if len(pool) > 1:
            return TerminalSelection(None, TERMINAL_AMBIGUOUS)
        node = pool[0]
