"""Log levels the stage's command line applies from the environment, and the rate-limited
logger the stage's Kafka clients write their own lines to.

``ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL`` sets the level of the per-rejection log
(``stage.finalize.rejections``, one INFO line per placeholder row): ``WARNING`` or ``OFF``
silences it, ``INFO`` (the default) keeps it. An embedding application configures that logger
with ``logging`` itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

# The rate-limited logger of every Kafka client of the project, the SDK's included, lives with
# the SDK (the runtime imports stage.client, not the reverse); re-exported here.
from stage.client.connection import KAFKA_LOGGER, RateLimit, kafka_logger  # noqa: F401

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
