"""``rollout-reassembler inspect GROUP_ID``: everything the topics say about one group.

Every topic is keyed by group id and co-partitioned, so the group lives in one partition number
of every topic: ``partition_for(utf8(group_id), partitions)``. The command reads, in that
partition only, and in bounded offset ranges:

1. the ledger (compacted: the whole partition) for the group's LedgerEntry: the highest input
   offsets of its records and when it was published;
2. the summaries topic for its GroupSummary (from ``--since`` to ``--until``, or around the
   ledger's publication time when the ledger still has the entry);
3. the rows and route plans around the summary's record timestamp (one transaction holds them);
4. the receipts and staged-calls topics from the summary's first input timestamp to its last
   (widened by ``--slack-ms``, and to the ledger's highest input offsets), for the group's
   input records: where they sit, which rollout or staging key each is, which staging keys the
   receipts name that were not found there;
5. the dead-letter topic (not co-partitioned: every partition) over the same time range, for
   dead letters keyed by the group id.
"""

from __future__ import annotations

from stage.debug.kafka import PartitionReader, Record
from stage.config.model import StageConfig
from stage.wire import WireError
from stage.wire.partitioner import partition_for

DEFAULT_SLACK_MS = 60_000


def _where(record: Record) -> dict:
    return {"topic": record.topic, "partition": record.partition, "offset": record.offset,
            "timestamp_ms": record.timestamp_ms}


def _decode(codec, record: Record) -> tuple[dict | None, str | None]:
    if record.value is None:
        return None, "null value"
    try:
        return codec.decode(record.value), None
    except WireError as error:
        return None, f"undecodable: {error}"


class GroupInspector:
    def __init__(self, cfg: StageConfig, reader: PartitionReader, codecs: dict, *,
                 since_ms: int | None = None, until_ms: int | None = None,
                 slack_ms: int = DEFAULT_SLACK_MS) -> None:
        self.cfg, self.reader, self.codecs = cfg, reader, codecs
        self.since_ms, self.until_ms, self.slack_ms = since_ms, until_ms, slack_ms
        self.scanned: list[dict] = []

    def _scan(self, topic: str, partition: int, *, from_ms: int | None = None, to_ms: int | None = None,
              min_end: int | None = None, key: bytes | None = None) -> list[Record]:
        low, high = self.reader.bounds(topic, partition)
        start = max(low, self.reader.offset_at(topic, partition, from_ms, low))
        end = self.reader.offset_at(topic, partition, to_ms, high)
        if min_end is not None:     # a record known to be the group's: the range must hold it
            start, end = min(start, max(low, min_end - 1)), max(end, min(high, min_end))
        found, read = self.reader.scan(topic, partition, start, end,
                                       None if key is None else (lambda r: r.key == key))
        self.scanned.append({"topic": topic, "partition": partition, "start": start, "end": end,
                             "records_read": read, "found": len(found)})
        return found

    def report(self, group_id: str) -> dict:
        key = group_id.encode("utf-8")
        topics = self.cfg.topics
        count = self.reader.partitions(topics.finalized_groups)
        if count is None:
            raise LookupError(f"topic {topics.finalized_groups} does not exist")
        p = partition_for(key, count)
        out: dict = {"group_id": group_id, "partition": p, "partitions": count, "scanned": self.scanned}
        out["ledger"] = self._ledger(p, key)
        published = (out["ledger"] or {}).get("published_at_ms")
        around = (published - self.slack_ms, published + self.slack_ms) if published else (None, None)
        summaries = self._scan(topics.finalized_groups, p, key=key,
                               from_ms=self.since_ms if self.since_ms is not None else around[0],
                               to_ms=self.until_ms if self.until_ms is not None else around[1])
        out["summaries"] = []
        for record in summaries:
            value, error = _decode(self.codecs["GroupSummary"], record)
            out["summaries"].append({"at": _where(record), "error": error, **(value or {})})
        good = [s for s in out["summaries"] if s["error"] is None]
        summary = good[-1] if good else None
        ts = summary["at"]["timestamp_ms"] if summary else None
        window = (ts - self.slack_ms, ts + self.slack_ms) if ts is not None else (self.since_ms, self.until_ms)
        out["rows"] = self._rows(p, key, window)
        out["route_plans"] = self._plans(p, key, window)
        first = summary["first_input_timestamp_ms"] - self.slack_ms if summary else self.since_ms
        last = summary["last_input_timestamp_ms"] + self.slack_ms if summary else self.until_ms
        out["inputs"] = self._inputs(p, key, first, last, out["ledger"], summary)
        finalized = summary["finalized_at_ms"] + self.slack_ms if summary else self.until_ms
        out["dead_letters"] = self._dead_letters(key, first, finalized)
        return out

    def _ledger(self, p: int, key: bytes) -> dict | None:
        entry = None
        for record in self._scan(self.cfg.topics.stage_ledger, p, key=key):
            value, error = _decode(self.codecs["LedgerEntry"], record)
            entry = {"at": _where(record), "tombstone": record.value is None,
                     "error": None if record.value is None else error, **(value or {})}
        return entry

    def _rows(self, p: int, key: bytes, window) -> list[dict]:
        out = []
        for record in self._scan(self.cfg.topics.canonical_rows, p, key=key, from_ms=window[0], to_ms=window[1]):
            value, error = _decode(self.codecs["CanonicalRow"], record)
            row = {"at": _where(record), "error": error}
            if value is not None:
                row.update({k: value[k] for k in (
                    "row_index", "sample_id", "rollout_id", "valid", "rejection_reason", "input_lengths",
                    "weight_version", "group_max_wv", "total_reward", "sample_mask", "truncated")},
                           part=value.get("row_part"))   # a row over max_record_bytes: one of its parts
            out.append(row)
        return sorted(out, key=lambda r: (r.get("row_index", -1), r["at"]["offset"]))

    def _plans(self, p: int, key: bytes, window) -> list[dict]:
        topic = self.cfg.topics.route_plans
        if self.reader.partitions(topic) is None:
            return []
        out = []
        for record in self._scan(topic, p, key=key, from_ms=window[0], to_ms=window[1]):
            value, error = _decode(self.codecs["RoutePlan"], record)
            plan = {"at": _where(record), "error": error}
            if value is not None:
                plan.update(row_index=value["row_index"], fragments=[
                    {"staging_key": s["staging_key"], **s["fragment"]}
                    for s in value["spans"] if s["fragment"] is not None], chunks=[
                    {"staging_key": s["staging_key"], "topic": ref["topic"], "partition": ref["partition"],
                     "offsets": [c["offset"] for c in ref["chunks"]],
                     "bytes": sum(c["length"] for c in ref["chunks"])}
                    for s in value["spans"] if s.get("chunks") is not None
                    for ref in (s["chunks"]["reference"],)])
            out.append(plan)
        return out

    def _inputs(self, p: int, key: bytes, first, last, ledger, summary) -> dict:
        topics = self.cfg.topics
        highest = {topics.receipts: (ledger or {}).get("max_receipt_offset"),
                   topics.staged_calls: (ledger or {}).get("max_staged_offset")}
        found: dict = {"receipts": [], "staged_calls": []}
        for role, topic, codec in (("receipts", topics.receipts, "ReceiptEvent"),
                                   ("staged_calls", topics.staged_calls, "StagedCall")):
            top = highest.get(topic)
            for record in self._scan(topic, p, key=key, from_ms=first, to_ms=last,
                                     min_end=top + 1 if top is not None and top >= 0 else None):
                value, error = _decode(self.codecs[codec], record)
                item = {"at": _where(record), "bytes": len(record.value or b""), "error": error}
                if summary and record.timestamp_ms and record.timestamp_ms > summary["finalized_at_ms"]:
                    item["after_finalization"] = True
                if value is not None and role == "receipts":
                    receipt = value["receipt"]
                    item.update(rollout_index=value["rollout_index"], rollout_id=value["rollout_id"],
                                has_receipt=receipt is not None,
                                capture_poisoned=bool(receipt and receipt["capture_poisoned"]),
                                staging_keys=[c["staging_key"] for c in (receipt or {}).get("manifest", [])])
                elif value is not None:
                    item.update(staging_key=value["staging_key"], rollout_id=value["rollout_id"],
                                model_call_id=value["model_call_id"], weight_version=value["weight_version"])
                found[role].append(item)
        named = {k for r in found["receipts"] for k in r.get("staging_keys", [])}
        if summary:
            named |= set(summary["staging_keys"])
        present = {s.get("staging_key") for s in found["staged_calls"]}
        found["staging_keys_not_found"] = sorted(named - present)
        return found

    def _dead_letters(self, key: bytes, first, last) -> list[dict]:
        topic = self.cfg.topics.dead_letter
        count = self.reader.partitions(topic)
        out = []
        for p in range(count or 0):
            for record in self._scan(topic, p, key=key, from_ms=first, to_ms=last):
                headers = {k: (v or b"").decode("utf-8", "replace") for k, v in record.headers}
                out.append({"at": _where(record), "bytes": len(record.value or b""),
                            "source": f"{headers.get('source-topic')}[{headers.get('source-partition')}]"
                                      f"@{headers.get('source-offset')}",
                            "error_class": headers.get("error-class"), "error": headers.get("error")})
        return out
