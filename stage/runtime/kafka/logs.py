"""Log levels the stage's command line applies from the environment, and the rate-limited
logger the stage's Kafka clients write their own lines to.

``ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL`` sets the level of the per-rejection log
(``stage.finalize.rejections``, one INFO line per placeholder row): ``WARNING`` or ``OFF``
silences it, ``INFO`` (the default) keeps it. An embedding application configures that logger
with ``logging`` itself.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping

REJECTION_LOG_ENV = "ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL"
_OFF = "OFF"


def rejection_log_level(value: str) -> int:
    """A level name (``DEBUG`` ... ``CRITICAL``), a number, or ``OFF``."""
    text = value.strip().upper()
    if text == _OFF:
        return logging.CRITICAL + 1
    if text.isdigit():
        return int(text)
    level = logging.getLevelName(text)
    if not isinstance(level, int):
        raise ValueError(f"{REJECTION_LOG_ENV} must be a logging level name, a number or OFF, got {value!r}")
    return level


def apply_rejection_log_level(environ: Mapping[str, str]) -> None:
    """Set the rejection logger's level from the environment; untouched when unset."""
    value = environ.get(REJECTION_LOG_ENV)
    if value is not None and value.strip():
        from stage.finalize import REJECTION_LOGGER   # here: `topics` must not import torch
        logging.getLogger(REJECTION_LOGGER).setLevel(rejection_log_level(value))


# -- the Kafka clients' own log lines ----------------------------------------------------
KAFKA_LOGGER = "stage.kafka"
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


def kafka_logger() -> logging.Logger:
    """The logger every Kafka client of the stage logs through (librdkafka's own lines), rate
    limited; without it librdkafka writes straight to stderr."""
    logger = logging.getLogger(KAFKA_LOGGER)
    if not any(isinstance(f, RateLimit) for f in logger.filters):
        logger.addFilter(RateLimit())
    return logger
