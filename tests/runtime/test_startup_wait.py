"""The start-up wait for a first broker answer (``startup_broker_wait_ms``), no broker: it beats
the liveness clock while it waits (a wait is not a stalled loop for /healthz to restart), ends
on SIGTERM with exit 0, and, when bounded, exits 4 naming the address."""

import threading

import pytest

from stage.config.model import StageConfig
from stage.runtime import exits
from stage.runtime.kafka.startup import connect_admin

NOWHERE = "127.0.0.1:9"


def test_a_bounded_wait_beats_while_it_waits_then_exits_4_naming_the_address():
    beats = []
    with pytest.raises(exits.StageExit) as stopped:
        connect_admin(StageConfig(bootstrap_servers=NOWHERE, startup_broker_wait_ms=1500),
                      beat=lambda: beats.append(1))
    assert stopped.value.code == exits.EXIT_KAFKA_UNREACHABLE
    assert f"no Kafka broker answered at {NOWHERE}" in str(stopped.value)
    assert beats


def test_an_unbounded_wait_ends_on_stop_with_exit_0():
    stop = threading.Event()
    timer = threading.Timer(1.5, stop.set)
    timer.start()
    with pytest.raises(exits.StageExit) as stopped:
        connect_admin(StageConfig(bootstrap_servers=NOWHERE), stop)
    assert stopped.value.code == exits.EXIT_OK
