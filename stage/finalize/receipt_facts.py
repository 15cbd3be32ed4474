"""What the group metrics read from one receipt (NeMo RL section 4.5), taken once per rollout.

NeMo RL reads these from the raw receipt dicts. ``finalize_rollout`` also takes JSON text,
bytes and ``RolloutReceipt`` objects, so the facts are taken where the receipt is parsed: from
the validated receipt, or, for one that fails validation, from its decoded JSON object by NeMo
RL's raw-dict rules. Every form of the same receipt then yields the same metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from stage.contract import RolloutReceipt

TOKEN_IN = "token_in"
WITNESS_DISAGREEMENT = "witness_disagreement"


@dataclass(frozen=True)
class ReceiptFacts:
    manifest_modes: tuple = ()              # one entry per manifest row ("text", "token_in", ...)
    terminal_selection: str | None = None
    capture_poisoned: bool = False
    terminal_attribution_reason: str | None = None

    @property
    def witness_disagreement(self) -> bool:
        return WITNESS_DISAGREEMENT in (self.terminal_attribution_reason or "")


def facts_of_receipt(parsed: RolloutReceipt) -> ReceiptFacts:
    return ReceiptFacts(
        manifest_modes=tuple(record.mode for record in parsed.manifest),
        terminal_selection=parsed.terminal_selection,
        capture_poisoned=bool(parsed.capture_poisoned),
        terminal_attribution_reason=parsed.terminal_attribution_reason)


def facts_of_raw(obj) -> ReceiptFacts | None:
    """NeMo RL's raw-dict reading of a receipt that failed validation. Values of the wrong
    type count as absent: the object is untrusted and may hold anything."""
    if not isinstance(obj, dict):
        return None
    manifest = obj.get("manifest")
    entries = manifest if isinstance(manifest, list) else []
    modes = tuple(entry.get("mode") if isinstance(entry.get("mode"), str) else None
                  for entry in entries if isinstance(entry, dict))
    selection = obj.get("terminal_selection")
    reason = obj.get("terminal_attribution_reason")
    return ReceiptFacts(
        manifest_modes=modes,
        terminal_selection=selection if isinstance(selection, str) else None,
        capture_poisoned=obj.get("capture_poisoned") is True,
        terminal_attribution_reason=reason if isinstance(reason, str) else None)


def group_receipt_metrics(facts: list[ReceiptFacts | None], methods) -> dict[str, float]:
    """Manifest-mode, poisoning, terminal-selection and witness metrics over a group's
    receipts (``None``: no receipt, or one that could not be read at all)."""
    n = len(facts)
    known = [f for f in facts if f is not None]
    m: dict[str, float] = {}
    modes = [mode for f in known for mode in f.manifest_modes]
    if modes:  # absent, not 0/0, when no receipt named any call
        token_in = sum(1 for mode in modes if mode == TOKEN_IN)
        m["finalize/token_in_calls"] = float(token_in)
        m["finalize/text_root_calls"] = float(len(modes) - token_in)
        m["finalize/token_in_rate"] = token_in / len(modes)
    m["finalize/capture_poisoned_rollouts"] = float(sum(1 for f in known if f.capture_poisoned))
    for method in methods:  # missing receipts stay in the denominator (NeMo RL)
        count = sum(1 for f in known if f.terminal_selection == method)
        m[f"finalize/terminal_selection_{method}_count"] = float(count)
        m[f"finalize/terminal_selection_{method}_fraction"] = count / n
    m["finalize/terminal_witness_disagreement_count"] = float(
        sum(1 for f in known if f.witness_disagreement))
    return m
