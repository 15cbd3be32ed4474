#!/usr/bin/env bash
# An operator's session with `inspect` and `dead-letters`, against a running stage.
#
#   examples/operator_session.sh [STAGE_CONFIG]          # default: examples/stage.yaml
#
# The incident: a trainer reports that a prompt group never arrived. Here we cause it first: a
# producer that picks the partition itself (not the contract's murmur2 partitioner) sends one
# receipt of the group to the wrong partition, so the stage dead-letters it as misrouted and the
# group waits for that receipt. Then the session: find the group, find its dead letter, replay
# it where it belongs, see the group published. Replay before the group's deadline
# (group_timeout_ms after its first record): once it is published, `replay` refuses the record
# (the stage would count a copy as late and never use it).
#
# Every command reads the stage's own config (topics, bootstrap servers, client security) and
# honours the same environment (KAFKA_BOOTSTRAP_SERVERS, ROLLOUT_REASSEMBLER_*).
# The commands run from the checkout's .venv (`make install`), as the README's do, activated or
# not; without one, from PATH. RR names the command line and PYTHON the interpreter with the
# package installed (e.g. RR="python -m stage" PYTHON=python).
set -euo pipefail
CONFIG=${1:-examples/stage.yaml}
VENV_BIN="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin"
if [[ -x "$VENV_BIN/rollout-reassembler" ]]; then
  RR=${RR:-$VENV_BIN/rollout-reassembler}
  PYTHON=${PYTHON:-$VENV_BIN/python}
fi
RR=${RR:-rollout-reassembler}
PYTHON=${PYTHON:-python3}
GROUP=${GROUP:-incident-$(date +%s)}

run() {   # show the command and its exit status, as a transcript
  echo "\$ rollout-reassembler $* --config $CONFIG"
  local status=0
  $RR "$@" --config "$CONFIG" || status=$?
  echo "(exit $status)"
  return 0
}

echo "# the incident: group $GROUP, rollout 2's receipt on the wrong partition"
"$PYTHON" - "$CONFIG" "$GROUP" <<'PY'
import sys

import numpy as np

from stage.client import BrokerUnreachable, ReceiptEmitter, RolloutStager, StagingProducer
from stage.config.model import load_config
from stage.wire.partitioner import partition_for

cfg = load_config(sys.argv[1])                  # the stage's topics and brokers, as the CLI reads them
group_id, size = sys.argv[2], 4
rng = np.random.default_rng(42)


def incident(producer: StagingProducer) -> None:
    emitter = ReceiptEmitter(producer, group_id=group_id, group_size=size, prompt_idx=42)
    for i in range(size):
        stager = RolloutStager(producer, group_id=group_id, rollout_id=f"{group_id}-r{i}")
        stager.stage("c0", prompt_delta=rng.integers(0, 1000, 8), generated=rng.integers(0, 1000, 4),
                     generated_logprobs=-rng.random(4), weight_version=0)
        if i != 2:
            emitter.emit(i, stager.receipt(), reward=float(i % 2))
            continue
        # the bug: a producer that chooses the partition itself
        count = len(producer.producer.list_topics(cfg.topics.receipts, timeout=10).topics[cfg.topics.receipts].partitions)
        wrong = (partition_for(group_id.encode(), count) + 1) % count
        value = emitter.event(i, stager.receipt(), reward=0.0)
        producer.producer.produce(cfg.topics.receipts, key=group_id.encode(), partition=wrong,
                                  value=producer.codecs["ReceiptEvent"].encode(value))


try:
    with StagingProducer(cfg.bootstrap_servers, topics=cfg.topics) as producer:
        incident(producer)
except BrokerUnreachable as error:              # one line naming the address, no traceback
    sys.exit(f"operator_session.sh: {error}")
print(f"produced group {group_id}: 4 staged calls, 3 receipts where they belong, 1 on the wrong partition")
PY

echo "# wait until the stage has dead-lettered it"
for _ in $(seq 60); do
  if $RR dead-letters list --key "$GROUP" --config "$CONFIG" --quiet | grep -q "^1 dead letter(s) matched"; then break; fi
  sleep 1
done

run inspect "$GROUP" --quiet                          # no summary yet: exit 1; three receipts found
run dead-letters list --key "$GROUP" --quiet          # the misrouted receipt, and why
run dead-letters replay --key "$GROUP" --dry-run --quiet   # where it would go
run dead-letters replay --key "$GROUP" --quiet        # re-produce it, at most once

echo "# wait for the group's publication"
for _ in $(seq 60); do
  if $RR inspect "$GROUP" --config "$CONFIG" --quiet > /dev/null; then break; fi
  sleep 1
done
run inspect "$GROUP" --quiet                          # published: exit 0, every row and its status
run dead-letters replay --key "$GROUP" --quiet        # a second replay re-produces nothing
