"""The pure half of resuming a rollout (stage.client.resume): from a rollout group's staged-call
records, in offset order, to the longest verified chain and a RolloutBuilder holding it.

No Kafka here. Every judgement is the stage's own code, reused, not re-implemented:
- intake: ``stage.decode.staged.staged_item`` (a record the stage would dead-letter is not held)
  and ``stage.buffer.duplicates.staged_difference`` (a second copy under a held staging key is a
  duplicate, skipped, or a conflict: the first copy stays, as in the stage's buffer);
- finalization: ``stage.decode.staged.staged_row`` (tensor layouts, Gym's model rules, the call
  digest, the route reference) and ``stage.contract.verify_and_linearize`` on a receipt naming
  the chain (digests, parent links and lengths, chain hashes, mask order, cumulative hash).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from stage.buffer import Position
from stage.buffer.duplicates import staged_difference
from stage.contract import CallRecord, LinearizedRow, RolloutReceipt, verify_and_linearize
from stage.contract.producer import RolloutBuilder, StagedCall
from stage.decode.errors import DecodeError
from stage.decode.limits import InputLimits
from stage.decode.staged import staged_item, staged_row


@dataclass(frozen=True)
class StagedRecord:
    """One decoded StagedCall value and where it was read."""

    value: dict
    position: Position
    nbytes: int


@dataclass(frozen=True)
class Candidate:
    """A staged call the stage holds (first copy of its staging key), converted for verification."""

    record: StagedRecord
    row: CallRecord
    staged: object        # stage.staging.StagedRow: snapshot (digest checked), route reference

    @property
    def call_id(self) -> str:
        return self.row.model_call_id

    @property
    def offset(self) -> int:
        return self.record.position.offset


@dataclass
class ChainVerdict:
    """What the staged calls of one rollout support.

    ``calls``: the verified calls in admission order (parents first); ``terminal``: the last
    call of the longest verified chain (None: none verified) and ``linearized`` its row;
    ``dropped``: staging key -> why the call is not kept (never verified, dead-lettered at intake,
    invalid); ``conflicts``: the stage's conflict text of each second copy that differs from the
    first; ``missing_parents``: parents named by staged calls but absent from what was read."""

    calls: list[Candidate] = field(default_factory=list)
    terminal: Candidate | None = None
    linearized: LinearizedRow | None = None
    dropped: dict[str, str] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    missing_parents: set[str] = field(default_factory=set)

    @property
    def taken_call_ids(self) -> set[str]:
        """Call ids the resumed rollout must not stage again: any kept or dropped call's staging
        key is held by the stage (a new call under it would be a conflict, the old copy kept)."""
        return {c.call_id for c in self.calls} | {key.rsplit("/", 1)[-1] for key in self.dropped}


def held_calls(records: Iterable[StagedRecord], group_id: str, rollout_id: str,
               limits: InputLimits = InputLimits()) -> tuple[list[Candidate], dict[str, str], list[str]]:
    """The rollout's calls as the stage's buffer holds them: (candidates in offset order,
    dropped staging keys with why, conflict texts). ``records`` in offset order."""
    first: dict[str, object] = {}            # staging key -> StagedItem (the stage's identity)
    dropped: dict[str, str] = {}
    conflicts: list[str] = []
    kept: list[StagedRecord] = []
    for record in records:
        value = record.value
        if value.get("group_id") != group_id:
            continue
        try:   # the stage's intake: a record failing it is dead-lettered, never held
            item = staged_item(dict(value), record.position, record.nbytes, limits)
        except (DecodeError, ValueError, TypeError) as error:
            if value.get("rollout_id") == rollout_id:
                dropped[str(value.get("staging_key"))] = f"dead-lettered at intake: {error}"
            continue
        held = first.get(item.staging_key)
        if held is None:
            first[item.staging_key] = item
            kept.append(record)
            continue
        difference = staged_difference(held, item)
        if difference is not None and value.get("rollout_id") == rollout_id:
            conflicts.append(difference)
    out: list[Candidate] = []
    ids: set[str] = set()
    for record in kept:
        value = record.value
        if value.get("rollout_id") != rollout_id:
            continue
        key = value["staging_key"]
        try:   # the stage's finalization of a staged row (digest, layouts, route reference)
            row_value = dict(value)
            staged = staged_row(row_value, limits, partition=record.position.partition)
            row = manifest_row(value)
        except (ValueError, TypeError, KeyError) as error:
            dropped[key] = f"invalid_staging_row: {error}"
            continue
        if row.model_call_id in ids:   # a receipt cannot name two calls with one id
            dropped[key] = f"model_call_id {row.model_call_id!r} already staged under another staging key"
            continue
        ids.add(row.model_call_id)
        out.append(Candidate(record, row, staged))
    return out, dropped, conflicts


def manifest_row(value: dict) -> CallRecord:
    """The receipt's manifest row of a staged call (RolloutBuilder's: default response_id,
    no admitted_at; neither reaches the stage's rows)."""
    return CallRecord(
        model_call_id=value["model_call_id"], parent_call_id=value["parent_call_id"],
        prev_len=value["prev_len"], delta_len=value["delta_len"], cum_len=value["cum_len"],
        weight_version=value["weight_version"], digest=value["digest"],
        extras_digest=value["extras_digest"], staging_key=value["staging_key"], mode=value["mode"],
        chain_hash=value["chain_hash"], cumulative_hash=value["cumulative_hash"],
        response_id=f"resp-{value['model_call_id']}")


def verify_chain(rollout_id: str, chain: list[Candidate]) -> LinearizedRow:
    """The stage's verification of a receipt whose terminal is ``chain[-1]``; raises
    ReceiptVerificationError (a ValueError) naming the failure."""
    receipt = RolloutReceipt(rollout_id=rollout_id, terminal_model_call_id=chain[-1].call_id,
                             manifest=[c.row for c in chain], terminal_selection="declared")
    return verify_and_linearize(receipt, [c.staged.snapshot for c in chain])


def _chain_to(call: Candidate, by_id: dict[str, Candidate]) -> list[Candidate]:
    """``call`` and its ancestors present in ``by_id``, root first (stops at a cycle)."""
    chain, seen, node = [], set(), call
    while node is not None and node.call_id not in seen:
        seen.add(node.call_id)
        chain.append(node)
        parent = node.row.parent_call_id
        node = by_id.get(parent) if parent is not None else None
    return chain[::-1]


def longest_verified(rollout_id: str, candidates: list[Candidate],
                     dropped: dict[str, str] | None = None,
                     conflicts: list[str] | None = None) -> ChainVerdict:
    """Verify the candidates' chains, longest first (cum_len, then the later offset); a chain
    that fails is tried again from each ancestor up (its longest verified prefix). Every call of
    a verified chain is kept: a receipt must name only calls whose digests and parents verify."""
    verdict = ChainVerdict(dropped=dict(dropped or {}), conflicts=list(conflicts or []))
    by_id = {c.call_id: c for c in candidates}
    verified: dict[str, LinearizedRow | None] = {}
    failed: dict[str, str] = {}
    best: tuple | None = None
    for call in sorted(candidates, key=lambda c: (c.row.cum_len, c.offset), reverse=True):
        if call.call_id in verified or call.call_id in failed:
            continue
        chain = _chain_to(call, by_id)
        parent = chain[0].row.parent_call_id
        if parent is not None:
            verdict.missing_parents.add(parent)
        for end in range(len(chain) - 1, -1, -1):
            node = chain[end]
            if node.call_id in verified:
                break
            if node.call_id in failed:
                continue
            try:
                row = verify_chain(rollout_id, chain[:end + 1])
            except ValueError as error:   # ReceiptVerificationError, a manifest the model refuses
                failed[node.call_id] = str(error)
                continue
            verified.update({c.call_id: None for c in chain[:end]})
            verified[node.call_id] = row
            if best is None or (node.row.cum_len, node.offset) > best[0]:
                best = ((node.row.cum_len, node.offset), node, row)
            break
    for call_id, reason in failed.items():
        if call_id not in verified:
            verdict.dropped[by_id[call_id].row.staging_key] = reason
    if best is not None:
        _, verdict.terminal, verdict.linearized = best
    verdict.calls = _admission_order([c for c in candidates if c.call_id in verified], by_id)
    return verdict


def _admission_order(calls: list[Candidate], by_id: dict[str, Candidate]) -> list[Candidate]:
    """Offset order with every parent before its children (a call staged by reference is
    produced once its route chunks are acknowledged, so a child can land before its parent)."""
    out, done = [], set()

    def emit(call: Candidate) -> None:
        if call.call_id in done:
            return
        done.add(call.call_id)
        parent = call.row.parent_call_id
        if parent is not None and parent in by_id:
            emit(by_id[parent])
        out.append(call)

    for call in sorted(calls, key=lambda c: c.offset):
        emit(call)
    return out


def rehydrate(rollout_id: str, calls: list[Candidate]) -> RolloutBuilder:
    """A RolloutBuilder holding ``calls`` (admission order) as if it had staged them: the next
    call chains onto them (its parent's tokens and chain hash) and the receipt names them all."""
    builder = RolloutBuilder(rollout_id)
    for call in calls:
        parent = call.row.parent_call_id
        # extras None: the old calls' route payloads stay where they were staged (the receipt
        # names them by staging key); nothing of them is produced again
        builder.calls[call.call_id] = StagedCall(call.staged.snapshot, None, call.row,
                                                 builder.calls.get(parent) if parent else None)
    return builder


def route_chunk_offsets(calls: Iterable[Candidate]) -> dict[int, int]:
    """The lowest route-chunk offset each route partition must still hold for ``calls``."""
    lowest: dict[int, int] = {}
    for call in calls:
        reference = call.staged.route_ref
        if reference is None or not reference.chunks:
            continue
        low = min(chunk.offset for chunk in reference.chunks)
        lowest[reference.partition] = min(low, lowest.get(reference.partition, low))
    return lowest
