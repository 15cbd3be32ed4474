#!/usr/bin/env python3
"""A GRPO trainer's loop on CPU: complete prompt groups from the stage, a train step per batch,
checkpoints that hold the reader's position, and staleness control.

    python examples/trainer_loop.py --checkpoint trainer.ckpt            # broker 127.0.0.1:9092
    python examples/trainer_loop.py --checkpoint trainer.ckpt --max-steps 10

Each step reads up to ``--prompts-per-step`` complete groups (``CanonicalReader.read``: all N
rows of a group, padded to NeMo RL's training tensors) and hands them, each with its group id, to
``train_step``. After the step the policy's weight version moves on (the refit); a group whose
oldest tokens are more than ``--max-lag`` versions behind it is set aside as stale instead of
trained on (async GRPO's trajectory age; off unless ``--max-lag`` is given: the example fleet
never refits). Every ``--checkpoint-every`` steps, and when it stops, the model, the optimizer
and the reader's position go into one checkpoint file, written atomically: a trainer killed at
any point and restarted with the same ``--checkpoint`` trains every group exactly once
(``examples/check_trainer.py`` checks a checkpoint against the topics). It stops, with a final checkpoint, after ``--max-steps``, when no
group arrived for ``--idle-timeout`` seconds (the data ran out), or on Ctrl-C / SIGTERM.

The reader's ``group_id`` is this trainer's own (``--reader-group-id``): it only records the
committed offsets, for lag monitoring; the checkpoint, not the consumer group, says where to
resume. Give every separate reader its own id (docs/producers.md, "Reader group ids").
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

from stage.client import BrokerUnreachable, CanonicalReader, Staleness
from stage.wire import TopicNames


def topic_names(prefix: str) -> TopicNames:
    """The stage's topics (``topics:`` of its config): the default names, with a prefix."""
    return TopicNames(**{role: prefix + name for role, name in TopicNames().all().items()})


def unreachable(prog: str, error: Exception) -> int:
    """One line for a broker that does not answer (no traceback), naming this program's setting."""
    print(f"{prog}: {error}; here the address is --bootstrap-servers (default: "
          "$KAFKA_BOOTSTRAP_SERVERS, else 127.0.0.1:9092)", file=sys.stderr)
    return 1


class Policy(torch.nn.Module):
    """A stand-in language model: next-token logits from an embedding (yours goes here)."""

    def __init__(self, vocab: int, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def train_step(policy: Policy, optimizer, batch: list[tuple[str, dict]]) -> float:
    """One optimizer step on ``(group_id, tensors)`` pairs, a GRPO policy-gradient loss: each
    row's advantage is its reward minus the mean reward of its group's valid rows, applied to
    the log-probability of every generated token (``token_mask``); placeholder rows
    (``sample_mask`` 0: a rejected or missing rollout) carry no loss."""
    losses = []
    for group_id, t in batch:
        valid = t["sample_mask"] > 0
        if not valid.any():
            print(f"  {group_id}: no valid row, nothing to learn from", flush=True)
            continue
        advantage = (t["total_reward"] - t["total_reward"][valid].mean()) * t["sample_mask"]
        ids = t["input_ids"].clamp(max=policy.embed.num_embeddings - 1)    # your tokenizer's vocabulary
        logprobs = torch.log_softmax(policy(ids[:, :-1]), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = t["token_mask"][:, 1:]
        losses.append(-(advantage[:, None] * logprobs * mask).sum() / mask.sum().clamp(min=1))
    if not losses:
        return 0.0
    loss = torch.stack(losses).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def save_checkpoint(path: str, state: dict) -> None:
    """Atomic: a crash leaves the previous checkpoint or this one, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
                        help="Kafka bootstrap list (default: $KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092)")
    parser.add_argument("--topic-prefix", default="", help="prefix of the stage's topic names")
    parser.add_argument("--checkpoint", default="trainer.ckpt", help="checkpoint file (resumed from if it exists)")
    parser.add_argument("--reader-group-id", default="trainer-example",
                        help="consumer group the reader commits under (lag monitoring only); one per trainer")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="groups per train step")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in total")
    parser.add_argument("--idle-timeout", type=float, default=30.0,
                        help="stop when no group arrived for this many seconds")
    parser.add_argument("--checkpoint-every", type=int, default=1, help="steps between checkpoints")
    parser.add_argument("--max-lag", type=int, default=None,
                        help="set a group aside when its oldest weight version is more than this behind the "
                             "policy (default: no check; producer_fleet.py stamps the --weight-version it is "
                             "given and never refits, so its groups fall behind a trainer that steps)")
    parser.add_argument("--vocab", type=int, default=1024, help="the policy's vocabulary size")
    parser.add_argument("--device", default="cpu", help="where the training tensors go (cpu, cuda, ...)")
    args = parser.parse_args(argv)

    policy = Policy(args.vocab)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    state = {"step": 0, "weight_version": 0, "trained": [], "stale": [], "reader": None}
    if os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, weights_only=True)
        policy.load_state_dict(saved.pop("model"))
        optimizer.load_state_dict(saved.pop("optimizer"))
        state = saved
        print(f"resumed from {args.checkpoint}: step {state['step']}, weight version "
              f"{state['weight_version']}, {len(state['trained'])} groups trained, "
              f"{len(state['stale'])} set aside as stale", flush=True)

    def checkpoint() -> None:
        state["reader"] = reader.position().to_dict()    # where a restart must read from
        save_checkpoint(args.checkpoint, {**state, "model": policy.state_dict(),
                                          "optimizer": optimizer.state_dict()})
        reader.commit()      # after the checkpoint: offsets for `kafka-consumer-groups --describe`

    try:
        reader = CanonicalReader(
            args.bootstrap_servers, topics=topic_names(args.topic_prefix), group_id=args.reader_group_id,
            subscribe=False,                  # assign every partition; the checkpoint says where to start
            start_from=state["reader"],       # None: the group's committed offsets, else the beginning
            device=args.device,
            staleness=None if args.max_lag is None else Staleness(max_weight_version_lag=args.max_lag,
                                                                  on_stale="hold"))
    except BrokerUnreachable as error:        # no broker at that address: one line, no traceback
        return unreachable("trainer_loop.py", error)
    reader.set_weight_version(state["weight_version"])

    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):       # finish the step, checkpoint, then exit
        signal.signal(sig, lambda number, _frame: stopping.append(signal.Signals(number).name))
    last_group = time.monotonic()
    while True:
        if stopping:
            why = f"{stopping[0]} received"
            break
        if args.max_steps is not None and state["step"] >= args.max_steps:
            why = f"--max-steps {args.max_steps} reached"
            break
        batch = reader.read(args.prompts_per_step, timeout=1.0)   # at most that many, complete groups
        stale = reader.take_held()                                # groups too old for the policy
        if stale:
            state["stale"] += [g.group_id for g in stale]
            print(f"stale: set aside {', '.join(g.group_id for g in stale)} (oldest weight version "
                  f"{min(g.group_min_wv for g in stale)}, policy at {state['weight_version']}, "
                  f"max lag {args.max_lag})", flush=True)
        if not batch:
            if time.monotonic() - last_group > args.idle_timeout:   # the data ran out
                why = f"no new group for {args.idle_timeout:g} s"
                break
            continue
        last_group = time.monotonic()
        tensors = [(g.group_id, g.tensors()) for g in batch]
        loss = train_step(policy, optimizer, tensors)
        state["step"] += 1
        state["weight_version"] += 1                              # the refit after the step
        reader.set_weight_version(state["weight_version"])
        state["trained"] += [g.group_id for g in batch]
        routes = tensors[0][1].get("routed_experts")
        print(f"step {state['step']}: {len(batch)} group(s) [{', '.join(g.group_id for g in batch)}], "
              f"{sum(g.group_size for g in batch)} rows ({sum(g.valid_rows for g in batch)} valid), "
              f"loss {loss:.4f}, weight version {state['weight_version']}"
              + ("" if routes is None else f", routed_experts {list(routes.shape)}"), flush=True)
        if state["step"] % args.checkpoint_every == 0:
            checkpoint()
    checkpoint()
    reader.close()
    print(f"stopping: {why}; checkpoint {args.checkpoint}: step {state['step']}, "
          f"{len(state['trained'])} groups trained, {len(state['stale'])} set aside as stale", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
