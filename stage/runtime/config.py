"""Stage configuration: defaults, then a YAML file, then environment variables.

Environment rules (documented in docs/configuration.md):
- ``ROLLOUT_REASSEMBLER_<FIELD>`` sets a top-level field (``ROLLOUT_REASSEMBLER_GROUP_TIMEOUT_MS=30000``);
  nested sections use ``__`` (``ROLLOUT_REASSEMBLER_FINALIZE__DEVICE=cuda``,
  ``ROLLOUT_REASSEMBLER_TOPICS__RECEIPTS=my.receipts``).
- ``ROLLOUT_REASSEMBLER_KAFKA__<PROPERTY>`` passes a confluent-kafka/librdkafka property to every
  client, ``_`` read as ``.`` (``ROLLOUT_REASSEMBLER_KAFKA__SASL_MECHANISM=PLAIN`` ->
  ``sasl.mechanism``); ``..._CONSUMER__...`` and ``..._PRODUCER__...`` for one client kind.
- ``KAFKA_BOOTSTRAP_SERVERS`` (the common convention) sets ``bootstrap_servers``; no other
  ``KAFKA_*`` variable is read (tools such as Kafka's own scripts use that namespace).
Unknown keys are errors: a typo must not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stage.finalize import ReassemblyConfig
from stage.wire import TopicNames

ENV_PREFIX = "ROLLOUT_REASSEMBLER_"
# Variables in our namespace that are not settings (read by the modules named).
NOT_SETTINGS = frozenset({
    "ROLLOUT_REASSEMBLER_FAULT",           # stage.runtime.faults (crash injection in tests)
    "ROLLOUT_REASSEMBLER_MALLOC_TUNING",   # stage.tuning
    "ROLLOUT_REASSEMBLER_SCHEMAS_DIR",     # stage.wire.schemas
    "ROLLOUT_REASSEMBLER_KAFKA_JARS",      # stage.kraft
    "ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL",  # stage.runtime.logs (per-rejection log level)
})
EXACTLY_ONCE, AT_LEAST_ONCE = "exactly_once", "at_least_once"


@dataclass(frozen=True)
class StageConfig:
    bootstrap_servers: str = "127.0.0.1:9092"
    group_id: str = "rollout-reassembler"
    # Stable across restarts of the same replica (StatefulSet pod name) so a restarted
    # instance fences its previous incarnation by id as well as by group generation (KIP-447).
    transactional_id: str = ""
    processing: str = EXACTLY_ONCE
    topics: TopicNames = field(default_factory=TopicNames)
    framing: str = "plain"                    # plain | confluent (Schema Registry)
    schema_registry_url: str = ""
    group_timeout_ms: int = 60_000            # deadline: first record timestamp + this
    late_retention_ms: int = 600_000          # remember published groups this long for late records
    max_inflight_groups: int = 64             # finalizations running or waiting to publish
    finalize_workers: int = 1                 # CPU-bound Python: more threads only contend for the GIL
    max_buffered_bytes: int = 2 << 30
    max_buffered_groups: int = 20_000
    resume_fraction: float = 0.8              # resume paused partitions below this share of a cap
    max_record_bytes: int = 64 << 20          # larger input records are dead-lettered undecoded
    publish_batch_groups: int = 64            # groups per transaction at most
    publish_linger_ms: int = 20               # wait this long to batch more groups per transaction
    transaction_timeout_ms: int = 120_000
    max_poll_interval_ms: int = 600_000
    revoke_budget_ms: int = 10_000            # on revoke, wait this long for in-flight groups
    # Deadlines of a partition whose input partition is unavailable (leader failing over, fetch
    # errors) wait for it; after this long past the deadline they fire anyway (placeholders).
    deadline_hold_max_ms: int = 300_000
    poll_timeout_ms: int = 50
    metrics_port: int = 0                     # /metrics, /healthz, /readyz; 0 = no HTTP server
    statistics_interval_ms: int = 5000        # librdkafka statistics (consumer lag); 0 = off
    finalize: ReassemblyConfig = field(default_factory=ReassemblyConfig)
    kafka: dict = field(default_factory=dict)     # passed to every client
    consumer: dict = field(default_factory=dict)  # consumer-only properties
    producer: dict = field(default_factory=dict)  # producer-only properties

    def __post_init__(self) -> None:
        if self.processing not in (EXACTLY_ONCE, AT_LEAST_ONCE):
            raise ValueError(f"processing must be {EXACTLY_ONCE!r} or {AT_LEAST_ONCE!r}, got {self.processing!r}")
        if self.framing not in ("plain", "confluent"):
            raise ValueError(f"framing must be 'plain' or 'confluent', got {self.framing!r}")
        if self.framing == "confluent" and not self.schema_registry_url:
            raise ValueError("framing 'confluent' needs schema_registry_url")
        for name in ("group_timeout_ms", "max_inflight_groups", "finalize_workers", "max_buffered_bytes",
                     "max_buffered_groups", "max_record_bytes", "publish_batch_groups",
                     "transaction_timeout_ms", "max_poll_interval_ms", "deadline_hold_max_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.resume_fraction < 1:
            raise ValueError(f"resume_fraction must be in (0, 1), got {self.resume_fraction}")

    @property
    def effective_transactional_id(self) -> str:
        return self.transactional_id or f"{self.group_id}-{socket.gethostname()}"


_SECTIONS = {"topics": TopicNames, "finalize": ReassemblyConfig}
_DICTS = ("kafka", "consumer", "producer")


def _coerce(value: str, target: Any):
    """Environment strings -> the type of the field's default."""
    if isinstance(target, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    if isinstance(target, int):
        return int(value)
    if isinstance(target, float):
        return float(value)
    if target is None:
        return None if value.lower() in ("", "none", "null") else _number_or_text(value)
    return value


def _number_or_text(value: str):
    try:
        return int(value)
    except ValueError:
        return value


def _build(cls, values: dict, where: str):
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown {where} setting(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    return cls(**values)


def load_config(path: str | Path | None = None, env: dict | None = None) -> StageConfig:
    env = os.environ if env is None else env
    raw: dict = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        raw = loaded
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    defaults = StageConfig()
    for key, value in env.items():
        if key in NOT_SETTINGS:
            continue
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX):].lower()
            section, _, sub = name.partition("__")
            if sub and section in _SECTIONS:
                default_obj = getattr(defaults, section)
                if sub not in {f.name for f in dataclasses.fields(default_obj)}:
                    raise ValueError(f"unknown setting {key}")
                raw.setdefault(section, {})[sub] = _coerce(value, getattr(default_obj, sub))
            elif sub and section in _DICTS:
                raw.setdefault(section, {})[sub.replace("_", ".")] = value
            elif hasattr(defaults, name) and name not in _SECTIONS and name not in _DICTS:
                raw[name] = _coerce(value, getattr(defaults, name))
            else:
                raise ValueError(f"unknown setting {key}")
        elif key == "KAFKA_BOOTSTRAP_SERVERS":
            raw["bootstrap_servers"] = value
    for section, cls in _SECTIONS.items():
        if section in raw:
            if not isinstance(raw[section], dict):
                raise ValueError(f"{section} must be a mapping")
            raw[section] = _build(cls, raw[section], section)
    for section in _DICTS:
        if section in raw and not isinstance(raw[section], dict):
            raise ValueError(f"{section} must be a mapping of client properties")
    return _build(StageConfig, raw, "stage")
