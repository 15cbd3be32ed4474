"""Schema ids met by the poll loop, resolved on another thread.

With Schema Registry framing a record names its writer schema by id. The loop never calls the
registry: a record whose id is not cached yet is put back (its partition is sought back and
paused), the id is resolved here, and the partition resumes once the registry has answered. An
outage is retriable: records wait, nothing is dead-lettered or committed past them, and the
loop keeps polling (so the group membership, /healthz and SIGTERM keep working). Only an
answer that the schema does not exist, or is unusable, makes the records undecodable.

``build_codecs`` makes the codecs of every topic from the configuration (the registry client
too, with Schema Registry framing and the ``schema_registry:`` authentication and TLS settings);
the operator commands use it without the runtime loop.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from stage.wire import TOPIC_RECORDS, AvroCodec, RegistryError, value_subject

logger = logging.getLogger(__name__)


def registry_client(cfg):
    """The Schema Registry client of ``cfg`` (a StageConfig), None without registry framing."""
    if cfg.framing != "confluent":
        return None
    from stage.client.registry import schema_registry_client
    # Lookups run on the resolver's thread, with its own back-off: no client-side retries.
    return schema_registry_client(cfg.schema_registry_url, cfg.schema_registry.client_properties(),
                                  timeout=10, max_retries=0)


def build_codecs(cfg) -> dict[str, AvroCodec]:
    """Record name -> codec for every topic of ``cfg`` (a StageConfig)."""
    registry = registry_client(cfg)
    subjects = {record: getattr(cfg.topics, role) for role, record in TOPIC_RECORDS.items() if record}
    return {name: AvroCodec(name, framing=cfg.framing, registry=registry,
                            subject=value_subject(topic), max_record_bytes=cfg.max_record_bytes)
            for name, topic in subjects.items()}


@dataclass
class _Request:
    codec: object
    schema_id: int
    partitions: set = field(default_factory=set)
    future: Future | None = None
    attempts: int = 0
    retry_at: float = 0.0
    error: str | None = None


class SchemaResolver:
    def __init__(self, *, min_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 clock=time.monotonic) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="schema-registry")
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.clock = clock
        self.requests: dict[tuple[str, int], _Request] = {}
        self.last_error: str | None = None

    def request(self, codec, schema_id: int, partition: int) -> None:
        key = (codec.schema_name, schema_id)
        req = self.requests.get(key)
        if req is None:
            req = self.requests[key] = _Request(codec, schema_id)
        req.partitions.add(partition)
        if req.future is None and req.retry_at <= self.clock():
            req.future = self.pool.submit(codec.prefetch, schema_id)

    def poll(self) -> set[int]:
        """Partitions whose every pending schema is now resolved (or refused)."""
        now = self.clock()
        done: set[int] = set()
        for key, req in list(self.requests.items()):
            if req.future is None:
                if req.retry_at <= now:
                    req.future = self.pool.submit(req.codec.prefetch, req.schema_id)
                continue
            if not req.future.done():
                continue
            error = req.future.exception()
            req.future = None
            if error is None:
                if req.attempts:
                    logger.info("schema registry answered for schema id %d after %d failed attempts",
                                req.schema_id, req.attempts)
                del self.requests[key]
                done |= req.partitions
                continue
            req.attempts += 1
            backoff = min(self.max_backoff_s, self.min_backoff_s * 2 ** (req.attempts - 1))
            req.retry_at = now + backoff
            req.error = str(error) if isinstance(error, RegistryError) else f"{type(error).__name__}: {error}"
            self.last_error = req.error
            if req.attempts == 1 or req.attempts % 10 == 0:
                logger.warning("schema registry unavailable for schema id %d (%s); records of "
                               "partitions %s wait, retrying in %.1fs", req.schema_id, req.error,
                               sorted(req.partitions), backoff)
        still = {p for req in self.requests.values() for p in req.partitions}
        if not self.requests:
            self.last_error = None
        return done - still

    @property
    def pending(self) -> frozenset[int]:
        """Partitions with a record waiting for a schema id (the REGISTRY pause)."""
        return frozenset(p for req in self.requests.values() for p in req.partitions)

    def forget(self, partitions) -> None:
        for req in self.requests.values():
            req.partitions -= set(partitions)
        for key in [k for k, r in self.requests.items() if not r.partitions and r.future is None]:
            del self.requests[key]

    @property
    def unavailable(self) -> bool:
        """True while some schema id could not be resolved because the registry failed."""
        return any(req.attempts for req in self.requests.values())

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
