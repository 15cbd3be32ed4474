"""Checks before joining the consumer group: anything here would fail every group, so the stage
refuses to start with a message that says what to fix, instead of joining and then publishing
placeholders, dropping groups, or crash-looping on a traceback."""

from __future__ import annotations

import logging
import threading
import time

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from stage.runtime import exits
from stage.config.model import StageConfig
from stage.runtime.kafka.topics import TopologyError, check_copartitioning, durability_warnings
from stage.wire import WireError

logger = logging.getLogger(__name__)

_QUIET = logging.getLogger("stage.runtime.kafka.startup.librdkafka")  # connection-refused noise


_FIRST_REPORT_S = 15.0    # the first "no broker answered" message, then every minute
_REPORT_EVERY_S = 60.0
_ASK_S = 1.0              # each metadata request: a SIGTERM is seen within about this long


def connect_admin(cfg: StageConfig, stop: threading.Event | None = None, beat=None,
                  timeout_s: float = _FIRST_REPORT_S) -> tuple[AdminClient, int]:
    """An admin client that has reached the cluster, and the co-partitioned topics' count.
    Waits ``startup_broker_wait_ms`` for a first answer (0: as long as it takes), saying why
    after 15 s and every minute after; ``stop`` set meanwhile (SIGTERM) ends the wait, exit 0.
    ``beat()`` after each try: waiting is alive (/healthz), not a stalled loop to restart."""
    admin = AdminClient({"bootstrap.servers": cfg.bootstrap_servers, **cfg.kafka}, logger=_QUIET)
    limit_s = cfg.startup_broker_wait_ms / 1000
    started = time.monotonic()
    report_at = started + _FIRST_REPORT_S
    while True:
        try:
            admin.list_topics(timeout=_ASK_S)
            break
        except KafkaException as error:
            now = time.monotonic()
            if limit_s and now - started >= limit_s:
                raise exits.StageExit(exits.EXIT_KAFKA_UNREACHABLE,
                                      _unreachable(cfg, now - started, error)) from None
            if now >= report_at:
                report_at = now + _REPORT_EVERY_S
                logger.warning("%s Still trying (startup_broker_wait_ms %d: %s); readiness is false "
                               "meanwhile.", _unreachable(cfg, now - started, error),
                               cfg.startup_broker_wait_ms,
                               f"exit 4 after {limit_s:.0f}s" if limit_s else "for as long as it takes")
        if beat is not None:
            beat()
        if stop is not None and stop.is_set():
            raise exits.StageExit(exits.EXIT_OK, "stopped before a Kafka broker answered")
    if time.monotonic() - started >= _FIRST_REPORT_S:
        logger.info("a Kafka broker answered at %s after %.0fs", cfg.bootstrap_servers,
                    time.monotonic() - started)
    try:
        partitions = check_copartitioning(admin, cfg)
    except TopologyError as error:
        raise exits.StageExit(exits.EXIT_TOPOLOGY, f"refusing to start: {error}") from None
    try:
        for line in durability_warnings(admin, cfg, timeout_s):
            logger.warning("topic durability below production needs: %s", line)
    except KafkaException as error:   # a report only: the layout itself is fine
        logger.warning("could not read topic configs for the durability report: %s", error)
    return admin, partitions


def _unreachable(cfg: StageConfig, waited: float, error: KafkaException) -> str:
    return (f"no Kafka broker answered at {cfg.bootstrap_servers} within {waited:.0f}s "
            f"({error.args[0].str() if error.args else error}). Check bootstrap_servers "
            "(ROLLOUT_REASSEMBLER_BOOTSTRAP_SERVERS or KAFKA_BOOTSTRAP_SERVERS), that the brokers "
            "run and are reachable from here, and the security settings under `kafka:` "
            "(security.protocol, sasl.*, ssl.*) if the listener needs them.")


def probe_device(spec: str) -> None:
    """Allocate on the finalize device once: a missing GPU fails here, not in every group."""
    try:
        import torch

        from stage.routes import resolve_device
        device = resolve_device(spec)
        (torch.zeros(8, device=device) + 1).sum().item()
    except Exception as error:  # noqa: BLE001 - torch raises RuntimeError, AssertionError, ...
        raise exits.StageExit(exits.EXIT_DEVICE, (
            f"the finalize device {spec!r} cannot be used: {type(error).__name__}: {error}. Set "
            "finalize.device to cpu, or to cuda / cuda:N on a host whose GPU torch can see "
            "(auto picks CUDA when present). With the Helm chart, gpu.enabled=true needs a GPU "
            "node and the CUDA image.")) from None
    if device.type == "cpu":
        # One intra-op thread: finalize workers are the parallelism. Measured on 2 cores, torch's
        # own threads waiting on each other made direct-mode copies 10x slower (1.32 s vs 0.13 s).
        torch.set_num_threads(1)
    logger.info("finalize device %s is usable", device)


# What to fix, by the registry's HTTP answer to the registration of an output schema.
_REGISTRATION_HINTS = {
    401: "The registry refused the credentials: check schema_registry.basic_auth_user_info.",
    403: "The registry refused this client (credentials without write access, or a client "
         "certificate it does not accept): check schema_registry.basic_auth_user_info and "
         "schema_registry.ssl_certificate_location.",
    409: "The registry refuses the schema as incompatible with the versions already registered "
         "under this subject (its compatibility rule, BACKWARD by default): register a compatible "
         "version, or migrate the subject (docs/schemas.md, Subjects and compatibility).",
    422: "The registry refuses the schema as invalid for it.",
}
_DEFAULT_HINT = ("Check schema_registry_url and that the registry runs; a subject whose compatibility "
                 "rules refuse this schema needs the rules relaxed or the subject migrated.")


def register_output_schemas(codecs: dict, names, stop, timeout_s: float = 60.0) -> None:
    """Schema Registry framing: resolve the ids of the stage's own output schemas now, so
    publishing never waits on the registry; retried through a short outage. Credentials the
    registry refuses (401, 403) end the start at once: waiting does not fix them."""
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    for name in names:
        codec = codecs[name]
        while True:
            try:
                codec.ensure_registered()
                break
            except WireError as error:
                retriable = getattr(error, "retriable", False)
                status = getattr(error, "status", None)
                if (not retriable or status in (401, 403) or time.monotonic() + delay > deadline
                        or stop.is_set()):
                    raise exits.StageExit(exits.EXIT_SCHEMA_REGISTRY, (
                        f"cannot register the {name} schema under subject {codec.subject}: {error}. "
                        f"{_REGISTRATION_HINTS.get(status, _DEFAULT_HINT)}")) from None
                logger.warning("schema registry not answering (%s); retrying in %.1fs", error, delay)
                stop.wait(delay)
                delay = min(delay * 2, 10.0)
