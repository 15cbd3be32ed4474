"""What every Kafka client of the project shares (the stage's, the SDK's, the operator tools'):
librdkafka's own log lines through a rate-limited logger, and a first contact with the cluster
bounded in time that fails with one line naming the address.

Without a ``logger`` librdkafka writes every connection failure to stderr, several a second
per broker for as long as the client lives (hundreds of lines for a mistyped address before
any error reaches the caller). With ``kafka_logger()`` they go through ``logging``, a few of
each kind a minute. ``reach()`` asks the cluster for its metadata once, at most ``timeout``
seconds, and raises ``BrokerUnreachable`` (the address, the setting, what else to check)
instead of a KafkaException traceback or records unacknowledged a minute later.
"""

from __future__ import annotations

import logging
import re
import time

from confluent_kafka import KafkaException

KAFKA_LOGGER = "stage.kafka"
DEFAULT_CONNECT_TIMEOUT_S = 15.0
_DIGITS = re.compile(r"\d+")


class RateLimit(logging.Filter):
    """At most ``burst`` lines of one kind per ``window_s`` (a kind: the librdkafka facility and
    the message with its numbers masked, so every "Connect to ...:9092 failed ... after 0ms" is
    one kind); the next line of a kind after its window says how many were suppressed. A broker
    down for minutes is then a few lines a minute, not thousands."""

    def __init__(self, burst: int = 3, window_s: float = 60.0, clock=time.monotonic) -> None:
        super().__init__()
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._kinds: dict[tuple, list] = {}   # kind -> [window start, lines in it, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        facility = args[0] if args else ""
        text = str(args[-1]) if args else record.getMessage()
        kind = (record.levelno, facility, _DIGITS.sub("#", text)[:160])
        now = self.clock()
        seen = self._kinds.get(kind)
        if seen is None or now - seen[0] >= self.window_s:
            suppressed = seen[2] if seen else 0
            if len(self._kinds) > 1024:   # bounded: forget old kinds
                self._kinds.clear()
            self._kinds[kind] = [now, 1, 0]
            if suppressed:
                record.msg = f"{record.msg} ({suppressed} more like it in the last {self.window_s:.0f}s)"
            return True
        if seen[1] < self.burst:
            seen[1] += 1
            return True
        seen[2] += 1
        return False


def kafka_logger(name: str = KAFKA_LOGGER) -> logging.Logger:
    """The logger a Kafka client writes librdkafka's own lines through (its ``logger``
    property), rate limited; without it librdkafka writes straight to stderr."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RateLimit) for f in logger.filters):
        logger.addFilter(RateLimit())
    return logger


class BrokerUnreachable(ConnectionError):
    """No broker answered at the client's bootstrap servers within its connect timeout."""

    def __init__(self, who: str, bootstrap_servers: str, timeout: float, detail: str) -> None:
        super().__init__(
            f"{who}: no Kafka broker answered at {bootstrap_servers} within {timeout:g}s ({detail}). "
            f"Check the address given as bootstrap_servers, that the brokers run and are "
            f"reachable from here, and the client's security settings (security.protocol, "
            f"sasl.*, ssl.* in its config) if the listener needs them")
        self.who, self.bootstrap_servers, self.timeout = who, bootstrap_servers, timeout


def reach(client, bootstrap_servers: str, who: str, timeout: float):
    """The cluster's metadata from ``client`` (a confluent-kafka Producer, Consumer or
    AdminClient), asked for at most ``timeout`` seconds; BrokerUnreachable when none answers."""
    try:
        return client.list_topics(timeout=timeout)
    except KafkaException as error:
        detail = error.args[0].str() if error.args and hasattr(error.args[0], "str") else str(error)
        raise BrokerUnreachable(who, bootstrap_servers, timeout, detail) from None
