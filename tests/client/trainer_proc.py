"""A checkpointing trainer loop as its own process (docs/trainer.md; examples/trainer_loop.py is the CPU version), for the
kill/resume test: ``python -m tests.client.trainer_proc --bootstrap ... --prefix ... --checkpoint
PATH --total N``.

Each step trains on up to ``PROMPTS_PER_STEP`` groups and updates the weights (the policy's
weight version is the step count). Its train state is the step, the groups it trained on and the
groups it set aside as stale; the state and the reader's position are written together,
atomically (temporary file, fsync, rename), every ``--every`` steps. With ``--crash-rate`` it SIGKILLs itself at random between training and
checkpointing, between writing and renaming the checkpoint, and between checkpointing and
committing offsets. It exits 0 once every one of the ``--total`` groups is in its saved state.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from stage.client import CanonicalReader, Staleness
from stage.wire import TopicNames

PROMPTS_PER_STEP = 2
CLIENT = {"fetch.wait.max.ms": 20}


def load_checkpoint(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def save_checkpoint(path: Path, state: dict, maybe_crash) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    maybe_crash("written, not renamed")
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--prefix", required=True, help="topic name prefix (tests' unique topics)")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--total", type=int, required=True)
    parser.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    parser.add_argument("--crash-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    topics = TopicNames(**{name: f"{args.prefix}.{value}" for name, value in TopicNames().all().items()})

    def maybe_crash(where: str) -> None:
        if rng.random() < args.crash_rate:
            print(f"crashing: {where}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    state = load_checkpoint(args.checkpoint) or {"step": 0, "trained": [], "stale": [], "reader": None}
    reader = CanonicalReader(args.bootstrap, topics=topics, group_id=f"trainer-{args.prefix}",
                             subscribe=False, start_from=state["reader"], config=CLIENT,
                             staleness=Staleness(max_weight_version_lag=1, on_stale="hold"))
    reader.set_weight_version(state["step"])               # the policy's version: one per step
    print(f"reading: {len(state['trained'])} trained, {len(state['stale'])} stale", flush=True)
    while True:
        batch = reader.read(PROMPTS_PER_STEP, timeout=0.5)    # at most that many, handed out now
        state["stale"] += [g.group_id for g in reader.take_held()]
        if batch:
            time.sleep(0.05)                                # the training step on the batch
            state["trained"] += [g.group_id for g in batch]
            state["step"] += 1
            reader.set_weight_version(state["step"])       # the refit after the step
        done = len(state["trained"]) + len(state["stale"]) >= args.total
        if (batch and state["step"] % args.every == 0) or done:
            maybe_crash("trained, not checkpointed")
            state["reader"] = reader.position().to_dict()
            save_checkpoint(args.checkpoint, state, maybe_crash)
            maybe_crash("checkpointed, not committed")
            reader.commit()                                 # lag monitoring only
        if done:
            break
    reader.close()
    print(f"done: {len(state['trained'])} trained, {len(state['stale'])} stale", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
