"""Canonical row records for reader tests: one real finalized group (3 rows, the last a
missing_receipt placeholder) re-labelled as any number of groups, and partition logs in which
groups interleave the way concurrent transactions (or a broker showing aborted records) make
them interleave."""

from __future__ import annotations

import random
from functools import lru_cache

from stage.publish.records import row_record
from stage.wire import AvroCodec
from tests.client.test_reader import finalized_group

ROWS = AvroCodec("CanonicalRow")


@lru_cache(maxsize=1)
def _template() -> tuple[dict, ...]:
    group, _ = finalized_group(group_id="tpl")
    return tuple(row_record(row) for row in group.rows)


def group_rows(group_id: str, *, weight_version: int | None = None, max_wv: int | None = None,
               valid: bool = True) -> list[tuple[dict, bytes]]:
    """(decoded record, encoded bytes) of each row of a 3-row group named ``group_id``."""
    out = []
    for record in _template():
        record = dict(record, group_id=group_id, sample_id=f"{group_id}_g{record['row_index']}",
                      rollout_id=f"{group_id}-r{record['row_index']}")
        if weight_version is not None:
            record.update(weight_version=weight_version, group_max_wv=max_wv or weight_version)
        if not valid:
            record.update(valid=False, rejection_reason="missing_receipt")
        raw = ROWS.encode(record)
        out.append((ROWS.decode(raw), raw))
    return out


def interleaved_log(group_ids, rng: random.Random, *, open_groups: int = 3, duplicate_rate: float = 0.0,
                    rows_of=group_rows) -> list[tuple[str, dict, bytes]]:
    """One partition's records: up to ``open_groups`` groups in progress at a time, rows in
    random order (``rows_of(group_id)`` makes them); with ``duplicate_rate``, a copy of a row of a
    group completed within the last 8 records appears (a replayed transaction's copy lands near the original)."""
    waiting = list(group_ids)
    open_: list[tuple[str, list]] = []
    done: list[tuple[int, list]] = []    # (offset of the last row, rows)
    log = []
    while waiting or open_:
        while waiting and len(open_) < open_groups:
            gid = waiting.pop(0)
            rows = rows_of(gid)
            rng.shuffle(rows)
            open_.append((gid, rows))
        gid, rows = rng.choice(open_)
        record, raw = rows.pop()
        log.append((gid, record, raw))
        if not rows:
            open_ = [(g, r) for g, r in open_ if g != gid]
            done.append((len(log) - 1, rows_of(gid)))
        recent = [rows for last, rows in done if len(log) - last <= 8]
        if recent and rng.random() < duplicate_rate:
            record, raw = rng.choice(rng.choice(recent))
            log.append((record["group_id"], record, raw))
    return log
