"""Dead letters are exactly once, like every other output: committed offsets stay at the oldest
open group, so a restarted stage re-reads bad records it has already dead-lettered; the ledger's
dead-letter watermark makes it skip them. Restarts: SIGTERM, and kill -9 at every transaction
point: before it begins, inside the transaction that carries dead letters (not committed:
dead-lettered again after the restart, once) and right after it committed (never again)."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.faults.procs import StageProcess, SummaryWatcher
from tests.integration.harness import Feeder, make_group, read_all, setup_topics, stage_config, unique_topics


def _dead_letters(bootstrap: str, topic: str) -> Counter:
    letters = read_all(bootstrap, topic, timeout=15)
    return Counter((dict(m.headers())["source-topic"].decode(), int(dict(m.headers())["source-offset"]))
                   for m in letters)


def _bad(feeder: Feeder, topics, tag: str) -> None:
    feeder.raw(topics.receipts, tag.encode(), b"\xff\xfenot avro " + tag.encode())
    feeder.raw(topics.staged_calls, tag.encode(), b"")
    feeder.flush()


def _wave(feeder: Feeder, topics, spec) -> None:
    _bad(feeder, topics, spec.group_id)
    feeder.staged(spec)
    feeder.receipts(spec)
    feeder.flush()


@pytest.mark.parametrize("restart", ["sigterm", "before_begin:2", "after_produce:2", "before_commit:2",
                                     "after_commit:2"])
def test_each_bad_record_has_exactly_one_committed_dead_letter(kafka, tmp_path, restart):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=600_000, publish_linger_ms=300)
    setup_topics(cfg, partitions=1)
    feeder = Feeder(kafka.bootstrap, topics)
    watcher = SummaryWatcher(kafka.bootstrap, topics.finalized_groups)
    holder = make_group("holder", 2, seed=80, routes=None)      # stays open across the restart:
    feeder.staged(holder)                                       # the committed offsets stay
    feeder.receipts(holder, holder.receipts[:1])                # below every record after it
    waves = [make_group(f"w{i}", 2, seed=81 + i, routes=None) for i in range(3)]
    fault = None if restart == "sigterm" else restart
    procs = []
    try:
        first = StageProcess(cfg, tmp_path, "first", fault=fault)
        procs.append(first)
        fed = 0
        for wave in waves[:2]:          # each wave: bad records, then a group -> one transaction
            _wave(feeder, topics, wave)
            fed += 1
            try:
                watcher.wait_for([wave.group_id], 60, procs=[first], what=wave.group_id)
            except AssertionError:
                if first.alive():
                    raise
                break                   # the fault fired inside this wave's transaction
        if restart == "sigterm":
            assert first.terminate(45) == 0, first.tail()
        else:
            assert first.wait_exit(60) == -signal.SIGKILL, first.tail()
        for wave in waves[fed:2]:       # input that arrives while the stage is down
            _wave(feeder, topics, wave)
        second = StageProcess(cfg, tmp_path, "second")
        procs.append(second)
        _wave(feeder, topics, waves[2])
        feeder.receipts(holder, holder.receipts[1:])
        feeder.flush()
        watcher.wait_for([g.group_id for g in waves] + ["holder"], 90, procs=[second], what="all groups")
        assert second.terminate(45) == 0, second.tail()
        letters = _dead_letters(kafka.bootstrap, topics.dead_letter)
        twice = {k: v for k, v in letters.items() if v != 1}
        assert not twice, f"dead-lettered more than once: {twice}\n{second.tail()}"
        assert len(letters) == 6, letters        # 2 bad records per wave, none lost
        assert _skipped_logged(second), "the second process did not load the dead-letter watermark"
    except BaseException:
        for proc in procs:
            print(proc.tail(60))
        raise
    finally:
        for proc in procs:
            proc.close()
        watcher.close()


def _skipped_logged(proc: StageProcess) -> bool:
    """The second process read the ledger's watermark (it logs it when a partition is ready)."""
    return "dead letters up to offsets {'receipts'" in proc.log()
