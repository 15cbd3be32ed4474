#!/usr/bin/env python3
"""An inference fleet and its rollout owner: stage every model call, then emit one receipt per
rollout, with the producer SDK (stage.client).

In production the two halves run in different processes: each inference worker stages the
calls it served (``RolloutStager.stage``: one StagedCall record per call, keyed by the prompt
group), and the rollout owner, once a rollout is done, emits its receipt naming those calls
(``ReceiptEmitter.emit``). Here ``--workers`` threads play the workers and the main thread the
owner; they share one ``StagingProducer`` (thread-safe, one Kafka producer). Each rollout is a
multi-turn agent episode: the first call generates from the prompt, every later call adds a
tool's output to the conversation and generates again. Random tokens stand in for the model.

    python examples/producer_fleet.py --groups 8                     # broker 127.0.0.1:9092
    python examples/producer_fleet.py --groups 8 --route-layers 48 --route-topk 8   # MoE routes

``--route-layers``/``--route-topk`` stage each call's routed experts ([tokens, L, K], what the
inference engine's router picked) and the boundary route of every child call: send them when
the stage runs with ``finalize.router_replay: true``; a stage without router replay ignores them.
It prints the group ids it produced and exits 0 once the broker acknowledged every record
(``flush()`` raises ``DeliveryError`` otherwise).

Crash and resume (docs/producers.md section 11): ``--crash-after-calls 2`` stages two calls of
every rollout, waits for the broker to acknowledge them and kills the fleet with SIGKILL, before
any receipt. Run it again with the same ``--run-id`` and ``--seed`` and ``--resume``: every
rollout is resumed from what it staged (``RolloutResumer``), continued from its last staged call
and receipted; it prints the tokens reused and regenerated, and the time the resume took next to
the time regenerating those tokens would take::

    python examples/producer_fleet.py --groups 4 --run-id r1 --crash-after-calls 2   # killed (-9)
    python examples/producer_fleet.py --groups 4 --run-id r1 --resume                # finishes
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from stage.client import BrokerUnreachable, ReceiptEmitter, RolloutResumer, RolloutStager, StagingProducer
from stage.client import resume as resumes
from stage.wire import TopicNames


def topic_names(prefix: str) -> TopicNames:
    """The stage's topics (``topics:`` of its config): the default names, with a prefix."""
    return TopicNames(**{role: prefix + name for role, name in TopicNames().all().items()})


def unreachable(prog: str, error: Exception) -> int:
    """One line for a broker that does not answer (no traceback), naming this program's setting."""
    print(f"{prog}: {error}; here the address is --bootstrap-servers (default: "
          "$KAFKA_BOOTSTRAP_SERVERS, else 127.0.0.1:9092)", file=sys.stderr)
    return 1


def run_rollout(producer: StagingProducer, group_id: str, rollout_id: str, args, seed, resumed=None):
    """One agent episode on an inference worker: stage each model call as it finishes. Returns
    the rollout's receipt (what the worker hands back to the rollout owner). ``resumed``: what
    a RolloutResumer found of this rollout after a crash (``--resume``)."""
    rng = np.random.default_rng(seed)
    if resumed is not None and not resumed.resumed and resumed.dropped:
        rollout_id += ".retry"     # what it staged is unusable: start again under other staging keys
    stager = RolloutStager(producer, group_id=group_id, rollout_id=rollout_id)
    parent, done = None, 0
    if resumed is not None and resumed.resumed:    # continue from its last staged call
        stager, parent, done = resumed.stager, resumed.last_call_id, len(resumed.call_ids)
    for turn in range(args.turns):
        # the prompt for the first call; the tool's output appended to the conversation after that
        prompt_delta = rng.integers(0, args.vocab, args.prompt_tokens if turn == 0 else args.tool_tokens)
        generated = rng.integers(0, args.vocab, args.generated_tokens)      # the model's answer
        logprobs = -rng.exponential(1.0, len(generated))                    # its log-probabilities
        routes = {}
        if args.route_layers:   # the experts the router chose, for every token this call added
            shape = (len(prompt_delta) + len(generated), args.route_layers, args.route_topk)
            routes["routed_experts"] = rng.integers(0, args.experts, shape)
            if turn > 0:   # the child's prefill route of its parent's last token
                routes["routed_experts_boundary"] = rng.integers(0, args.experts, (1, *shape[1:]))
        if turn < done:            # staged before the crash (this seeded stand-in model draws the same)
            continue
        if turn == args.crash_after_calls:     # the fleet is about to be killed mid-rollout
            break
        call_id = f"c{turn}"
        stager.stage(call_id, parent_call_id=parent, prompt_delta=prompt_delta, generated=generated,
                     generated_logprobs=logprobs, weight_version=args.weight_version, **routes)
        parent = call_id
    return stager.receipt(parent)    # names every staged call, with their digests


def produce_group(producer: StagingProducer, workers: ThreadPoolExecutor, group_id: str,
                  prompt_idx: int, args, rng, resumed=None) -> int:
    """The rollout owner's side of one prompt group: dispatch its rollouts, emit each receipt
    (or, for a rollout that failed, a missing-receipt event). Returns the rollouts that failed."""
    emitter = ReceiptEmitter(producer, group_id=group_id, group_size=args.group_size,
                             prompt_idx=prompt_idx, fallback_weight_version=args.weight_version)
    # a rollout's seed is its run's, prompt's and index's: a restarted fleet draws the same calls
    rollouts = {i: workers.submit(run_rollout, producer, group_id, f"{group_id}-r{i}", args,
                                  (args.seed, prompt_idx, i), (resumed or {}).get(f"{group_id}-r{i}"))
                for i in range(args.group_size)}
    if args.crash_after_calls is not None:     # killed before any rollout ends: no receipt
        for future in rollouts.values():
            future.result()
        return 0
    failed = 0
    for index, future in rollouts.items():
        if rng.random() < args.missing_rate:     # the episode crashed: its row becomes a placeholder
            emitter.emit_missing(index, rollout_id=f"{group_id}-r{index}")
            failed += 1
            continue
        reward = float(rng.random() < 0.5)       # the environment's verdict
        emitter.emit(index, future.result(), reward=reward)
    return failed


def resume_rollouts(producer: StagingProducer, args) -> dict:
    """Every rollout of the run's groups, resumed at once (one read of each partition they live
    in, from the stage's committed offset); prints what was reused and what regenerating costs."""
    group_ids = [f"{args.run_id}-p{p}" for p in range(args.first_prompt, args.first_prompt + args.groups)]
    wanted = [(g, f"{g}-r{i}") for g in group_ids for i in range(args.group_size)]
    started = time.perf_counter()
    with RolloutResumer(args.bootstrap_servers, stage_group_id=args.stage_group_id,
                        topics=topic_names(args.topic_prefix)) as resumer:
        results = resumer.resume_all(wanted, producer=producer)
        read = (f"read {resumer.records_read} records ({resumer.bytes_read / 1e6:.1f} MB) of "
                f"{len(resumer.starts)} partitions from the stage's committed offsets")
    took = time.perf_counter() - started
    outcomes = Counter(result.outcome for result in results)
    reused = sum(result.tokens_reused for result in results)
    # calls staged before the crash but not usable, regenerated from the start (sizes: the options)
    calls = [min(len(r.dropped), args.turns) for r in results if not r.resumed]
    regenerated = sum(args.prompt_tokens + args.generated_tokens + (n - 1) * (args.tool_tokens + args.generated_tokens)
                      for n in calls if n)
    longest = max((result.tokens_reused for result in results), default=0)
    print(f"resume: {outcomes[resumes.RESUMED]}/{len(results)} rollouts resumed "
          f"({', '.join(f'{k} {v}' for k, v in sorted(outcomes.items()))}) in {took:.2f} s; "
          f"regenerating them instead: ~{longest / args.decode_tokens_per_s:.1f} s (the longest "
          f"rollout's {longest} tokens at {args.decode_tokens_per_s:g} tokens/s)")
    share = 100.0 * reused / max(1, reused + regenerated)
    print(f"tokens reused {reused}, regenerated {regenerated} ({share:.1f}% of the staged tokens reused)")
    print(f"resume {read}")
    return {result.rollout_id: result for result in results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
                        help="Kafka bootstrap list (default: $KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092)")
    parser.add_argument("--topic-prefix", default="", help="prefix of the stage's topic names")
    parser.add_argument("--groups", type=int, default=4, help="prompt groups to produce")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per group (GRPO's N)")
    parser.add_argument("--turns", type=int, default=3, help="model calls per rollout")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tool-tokens", type=int, default=16, help="tool output tokens before each later call")
    parser.add_argument("--generated-tokens", type=int, default=32, help="tokens each call generates")
    parser.add_argument("--vocab", type=int, default=1024, help="token ids are below this")
    parser.add_argument("--weight-version", type=int, default=0,
                        help="the policy weights the fleet generates with (the trainer's staleness check reads it)")
    parser.add_argument("--route-layers", type=int, default=0, help="MoE layers L (0: no routes)")
    parser.add_argument("--route-topk", type=int, default=8, help="experts per token K")
    parser.add_argument("--experts", type=int, default=128, help="experts per layer")
    parser.add_argument("--missing-rate", type=float, default=0.0, help="share of rollouts that fail")
    parser.add_argument("--workers", type=int, default=4, help="inference worker threads")
    parser.add_argument("--run-id", default=uuid.uuid4().hex[:8],
                        help="group ids are <run-id>-p<prompt index> (default: random)")
    parser.add_argument("--first-prompt", type=int, default=0, help="prompt index of the first group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crash-after-calls", type=int, default=None,
                        help="stage this many calls of every rollout, then kill the fleet (SIGKILL)")
    parser.add_argument("--resume", action="store_true",
                        help="resume every rollout of these groups from what it staged before a crash")
    parser.add_argument("--stage-group-id", default=os.environ.get("ROLLOUT_REASSEMBLER_GROUP_ID", "rollout-reassembler-dev"),
                        help="the stage's consumer group (its group_id), whose committed offsets bound "
                             "what --resume reads (default: $ROLLOUT_REASSEMBLER_GROUP_ID, else examples/stage.yaml's)")
    parser.add_argument("--decode-tokens-per-s", type=float, default=50.0,
                        help="one sequence's decode speed, to print what regenerating would cost")
    args = parser.parse_args(argv)
    if args.crash_after_calls is not None and not 1 <= args.crash_after_calls <= args.turns:
        parser.error(f"--crash-after-calls must be in 1..--turns ({args.turns})")
    rng = np.random.default_rng(args.seed)

    group_ids, failed = [], 0
    try:
        with StagingProducer(args.bootstrap_servers, topics=topic_names(args.topic_prefix)) as producer, \
                ThreadPoolExecutor(args.workers, thread_name_prefix="inference-worker") as workers:
            resumed = resume_rollouts(producer, args) if args.resume else None    # after a crash
            for prompt_idx in range(args.first_prompt, args.first_prompt + args.groups):
                group_id = f"{args.run_id}-p{prompt_idx}"
                failed += produce_group(producer, workers, group_id, prompt_idx, args, rng, resumed)
                group_ids.append(group_id)
            producer.flush()         # every record acknowledged by the broker, or DeliveryError
            if args.crash_after_calls is not None:
                print(f"staged {args.crash_after_calls} call(s) of every rollout of {' '.join(group_ids)}, "
                      "all acknowledged; killing the fleet (SIGKILL)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            routes = f"routes {args.route_layers}x{args.route_topk}" if args.route_layers else "no routes"
            print(f"produced {len(group_ids)} groups x {args.group_size} rollouts x {args.turns} calls "
                  f"(weight version {args.weight_version}, {routes}, {failed} failed rollouts): "
                  f"{producer.produced} records, {producer.produced_bytes / 1e6:.2f} MB, all acknowledged")
    except BrokerUnreachable as error:   # the first record found no broker: one line, no traceback
        return unreachable("producer_fleet.py", error)
    print("groups: " + " ".join(group_ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
