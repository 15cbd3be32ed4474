"""Stage configuration: defaults, then a YAML file, then environment variables.

``StageConfig`` is a pydantic model: each field carries its type, bounds and meaning, and the
rules between fields are checked at load time, so a value that would make the stage hang or
misbehave is refused with the setting's name and source. docs/configuration.md and the Helm
chart's values schema are generated from it (``python -m stage.config.schema``).
Environment rules (stage/config/sources.py, documented in docs/configuration.md):
``ROLLOUT_REASSEMBLER_<FIELD>``, ``..._<SECTION>__<FIELD>``, ``..._KAFKA__<PROPERTY>`` (``_`` read
as ``.``), ``KAFKA_BOOTSTRAP_SERVERS``; unknown names are errors; service links are ignored.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from stage.config.finalize import ReassemblyConfig
from stage.config.registry import SchemaRegistrySettings
from stage.config.sources import (
    ENV_PREFIX,
    NOT_SETTINGS,
    ConfigError,
    explain,
    from_environment,
    from_file,
    merge,
)
from stage.config.topics import TopicNames
from stage.config.types import ClientValue, ConfigModel, Int, conflict
from stage.config.sizes import DEFAULT_MAX_RECORD_BYTES

__all__ = ["AT_LEAST_ONCE", "ENV_PREFIX", "EXACTLY_ONCE", "NOT_SETTINGS", "ConfigError", "StageConfig",
           "load_config"]

EXACTLY_ONCE, AT_LEAST_ONCE = "exactly_once", "at_least_once"
# Kafka's default transaction.max.timeout.ms: init_transactions fails above the brokers' maximum.
KAFKA_MAX_TRANSACTION_TIMEOUT_MS = 900_000
# librdkafka's message.max.bytes maximum; the producer's limit is max_record_bytes + 1 MiB.
MAX_RECORD_BYTES = 1_000_000_000 - (1 << 20)
# /metrics, /healthz and /readyz are served by default: the chart's metrics.port, the image's
# EXPOSE and compose's published port are this number too (tests/ops check they agree).
DEFAULT_METRICS_PORT = 9400
ClientProperties = dict[str, ClientValue]


# Consumer properties the classic protocol takes from the client and KIP-848 from the brokers.
CLASSIC_ONLY_CONSUMER_PROPERTIES = ("session.timeout.ms", "heartbeat.interval.ms",
                                    "partition.assignment.strategy", "group.protocol.type")


class StageConfig(ConfigModel):
    bootstrap_servers: str = Field("127.0.0.1:9092", min_length=1, description="Kafka bootstrap list")
    group_id: str = Field("rollout-reassembler", min_length=1, description="consumer group of all replicas")
    transactional_id: str = Field(
        "", description="empty: `<group_id>-<hostname>`. Must be stable per replica (StatefulSet pod "
                        "name) so a restart fences its previous incarnation (KIP-447)")
    processing: Literal["exactly_once", "at_least_once"] = Field(
        EXACTLY_ONCE, description="`at_least_once`: deliver, then commit (duplicates possible after a "
                                  "crash between the two)")
    topics: TopicNames = Field(default_factory=TopicNames, description="topic names")
    framing: Literal["plain", "confluent"] = Field(
        "plain", description="`confluent` = Schema Registry framing (magic byte + schema id); needs "
                             "`schema_registry_url`")
    schema_registry_url: str = Field(
        "", description="Schema Registry URL (`framing: confluent`): Confluent's REST API, e.g. "
                        "`http://registry:8081`, Apicurio's `http://registry:8080/apis/ccompat/v7`. A "
                        "comma-separated list is tried in order")
    schema_registry: SchemaRegistrySettings = Field(
        default_factory=SchemaRegistrySettings,
        description="Schema Registry authentication and TLS, for every registry client of the stage and "
                    "its operator commands")
    group_timeout_ms: Int = Field(60_000, ge=1, description="a group's deadline = its first record's "
                                                             "Kafka timestamp + this")
    late_retention_ms: Int = Field(600_000, ge=0, description="how long published groups are remembered "
                                                               "so late records are skipped")
    max_inflight_groups: Int = Field(64, ge=1, description="groups finalizing or waiting for a transaction")
    finalize_workers: Int = Field(
        1, ge=1, description="finalization workers (off the poll thread): threads, or processes with "
                             "`finalize_pool: process`. Finalization is mostly CPU-bound Python, so more "
                             "threads help little (the GIL); give a replica with more cores processes, "
                             "about one per core left after the poll thread")
    finalize_pool: Literal["thread", "process"] = Field(
        "thread", description="where finalization runs: `thread` (this process) or `process` (worker "
                              "processes, each group pickled to one and its encoded outputs back; 2 "
                              "processes measured 1.58x one thread at agentic sizes without routes, "
                              "1.11x with direct routes). Worker processes use the wall clock and "
                              "their own route-dims cache: set `finalize.route_layers`/`route_topk` "
                              "with direct router replay")
    max_buffered_bytes: Int = Field(
        2 << 30, ge=1, description="cap on what the stage holds for unpublished groups: buffered input, "
                                   "the working sets of groups being finalized, encoded outputs waiting "
                                   "and the transaction in flight (docs/design.md, Memory). Partitions "
                                   "pause at it while groups are being finalized or published and resume "
                                   "below `resume_fraction` of it; a group starts finalizing only when its "
                                   "working set fits (or nothing else is in progress). When every buffered "
                                   "group waits for unread input the stage keeps reading (pausing would "
                                   "deadlock it); deadlines bound that growth")
    max_spill_bytes: Int = Field(
        16 << 30, ge=0, description="staged records (and route chunks) admitted while the stage holds "
                                    "`max_buffered_bytes` less a finalize reserve (what finalizing the "
                                    "largest group held would take) go to local disk under "
                                    "`spill_dir`, at most this many bytes, and are read back when their "
                                    "group is finalized (docs/design.md, Memory); 0: never spill")
    spill_dir: str = Field("", description="where spilled records go (one directory per replica, emptied "
                                           "at start); empty: the system temporary directory")
    max_buffered_groups: Int = Field(20_000, ge=1, description="back-pressure cap on open groups (as "
                                                               "`max_buffered_bytes`)")
    resume_fraction: float = Field(
        0.8, gt=0, lt=1, description="paused partitions resume below this share of a cap")
    max_record_bytes: Int = Field(DEFAULT_MAX_RECORD_BYTES, ge=1, le=MAX_RECORD_BYTES,
                                  description="the cap on every record: larger input records are "
                                              "dead-lettered undecoded, and every record the stage "
                                              "writes fits it (a canonical row larger than it is "
                                              "published in `row_part` records); fetch and producer "
                                              "limits follow it. The default, 8,000,000, fits managed "
                                              "Kafka (topics of 8 MiB, as `topics create` makes them); "
                                              "on a broker at Apache Kafka's 1 MiB default use 983040 "
                                              "(docs/operations.md, Record sizes). Give the trainer's "
                                              "readers the same value "
                                              "(`CanonicalReader(max_record_bytes=...)`, "
                                              "`DeferredRouteFetcher(max_record_bytes=...)`)")
    publish_batch_groups: Int = Field(64, ge=1, description="groups per transaction at most")
    publish_linger_ms: Int = Field(20, ge=0, description="wait this long for more finished groups "
                                                          "before a transaction")
    transaction_timeout_ms: Int = Field(
        120_000, ge=1000, le=KAFKA_MAX_TRANSACTION_TIMEOUT_MS,
        description="producer `transaction.timeout.ms`; at most the brokers' "
                    "`transaction.max.timeout.ms` (Kafka's default 900000). One that outlives it (the "
                    "brokers unreachable) is aborted by the brokers: the stage starts a new producer "
                    "and re-reads from the committed offsets")
    startup_broker_wait_ms: Int = Field(
        0, ge=0, description="`run` waits this long at start for a broker to answer at `bootstrap_servers` "
                             "before it exits 4; 0 = as long as it takes. Either way the message naming "
                             "the address is logged after 15 s and every minute after (readiness false "
                             "meanwhile): a replica restarted during a network partition starts once it "
                             "heals instead of restart-looping; set 15000 to fail fast on a wrong address",
    )
    publish_stuck_ms: Int = Field(
        15_000, ge=1000, description="a transaction whose coordinator call (begin, send offsets, commit, "
                                     "abort: milliseconds normally, whatever the batch size) has not "
                                     "returned in this long is stuck (librdkafka #5511 after a broker "
                                     "restart): readiness turns false and a new producer with the same "
                                     "transactional.id fences the stuck one and aborts its transaction, "
                                     "then the stage rewinds to the committed offsets. Capped at "
                                     "`transaction_timeout_ms`. When the consumer saw every broker down "
                                     "the new producer starts at once instead (docs/operations.md, "
                                     "Broker outages)")
    max_poll_interval_ms: Int = Field(
        600_000, ge=1, le=86_400_000, description="consumer `max.poll.interval.ms`; must exceed "
                                                  "`revoke_budget_ms + transaction_timeout_ms`")
    static_membership: bool = Field(
        True, description="the consumer joins its group with `group.instance.id` = the transactional id "
                          "(KIP-345), so a replica whose session expired while the brokers were "
                          "unreachable (a broker restart longer than `session.timeout.ms`) takes its "
                          "partitions back at once instead of waiting out its old session on the group "
                          "coordinator; it still leaves the group on a graceful shutdown, so its "
                          "partitions move at once. A `group.instance.id` set in `consumer` (the chart's "
                          "staticMembership) wins and keeps Kafka's static behaviour: no leave on "
                          "shutdown. false: a dynamic member, which after such an outage rejoins only "
                          "once its old session expires (up to `session.timeout.ms` after the brokers "
                          "are back). Under `group_protocol` consumer (KIP-848) the stage sets no static "
                          "id: the brokers keep a member across their restart without one, and a static "
                          "member could not leave on shutdown there")
    group_protocol: Literal["classic", "consumer"] = Field(
        "classic", description="the consumer group protocol: `classic` (cooperative-sticky assignment, "
                               "`session.timeout.ms` set on the client) or `consumer` (KIP-848, Kafka 4.0+ "
                               "brokers: the broker assigns, and the session timeout and heartbeat interval "
                               "are the brokers' `group.consumer.*` settings, so `consumer` may not set "
                               "`session.timeout.ms`, `heartbeat.interval.ms`, `group.protocol.type` or "
                               "`partition.assignment.strategy`). Both keep exactly-once; docs/operations.md "
                               "compares their rebalance pauses and says which suites ran on each")
    revoke_budget_ms: Int = Field(10_000, ge=0, description="on revoke and shutdown, wait this long for "
                                                             "in-flight groups before handing partitions over")
    deadline_hold_max_ms: Int = Field(
        300_000, ge=1, description="deadlines of a partition whose input partition does not answer (leader "
                                   "failover, broker down) wait for it; this long past a deadline it fires "
                                   "anyway (`deadlines_forced_total`, placeholders for what did not arrive)")
    poll_timeout_ms: Int = Field(
        50, ge=1, le=1000, description="consumer poll timeout: bounds how late a deadline or SIGTERM is "
                                       "seen with no traffic")
    metrics_port: Int = Field(
        DEFAULT_METRICS_PORT, ge=0, le=65535,
        description="HTTP port for /metrics, /healthz, /readyz on every interface (0 = no server). The "
                    "default is the port the Helm chart, the image and docker-compose use; two stages "
                    "on one host need different ports")
    statistics_interval_ms: Int = Field(
        5000, ge=0, le=86_400_000, description="how often the per-partition consumer lag on /metrics is "
                                               "updated from librdkafka's statistics; 0 = never. The "
                                               "consumer's statistics are read every second whatever "
                                               "this is: they say how long since each broker answered "
                                               "it (a silent network partition is an outage within ~5 s)")
    finalize: ReassemblyConfig = Field(default_factory=ReassemblyConfig, validate_default=True,
                                       description="finalization settings")
    kafka: ClientProperties = Field(default_factory=dict, description="librdkafka properties of every client")
    consumer: ClientProperties = Field(default_factory=dict, description="consumer-only librdkafka properties")
    producer: ClientProperties = Field(default_factory=dict, description="producer-only librdkafka properties")

    @field_validator("finalize")
    @classmethod
    def _staging_partition_follows_topics(cls, finalize: ReassemblyConfig, info: ValidationInfo):
        """Route plans name the staged-calls topic unless told otherwise. The derived value is
        left out of the fields set, so a copy with other topics derives it again."""
        topics = info.data.get("topics")
        if topics is None or "staging_partition" in finalize.model_fields_set:
            return finalize
        return ReassemblyConfig.model_construct(
            _fields_set=set(finalize.model_fields_set),
            **{**dict(finalize), "staging_partition": topics.staged_calls})

    @model_validator(mode="after")
    def _rules_between_fields(self) -> StageConfig:
        if self.framing == "confluent" and not self.schema_registry_url:
            raise conflict("framing 'confluent' needs schema_registry_url", "framing", "schema_registry_url")
        if self.schema_registry.basic_auth_user_info is not None and "@" in self.schema_registry_url:
            # confluent-kafka refuses credentials in both places
            raise conflict("schema_registry_url carries user info and so does "
                           "schema_registry.basic_auth_user_info: keep one (the setting: it is kept secret)",
                           "schema_registry_url", "schema_registry")
        in_consumer = self.consumer.get("group.protocol")
        if in_consumer is not None and str(in_consumer) != self.group_protocol:
            raise conflict(f"consumer sets group.protocol {in_consumer!r} and group_protocol is "
                           f"{self.group_protocol!r}: set group_protocol only", "group_protocol", "consumer")
        if self.group_protocol == "consumer":
            client_side = sorted(set(self.consumer) & set(CLASSIC_ONLY_CONSUMER_PROPERTIES))
            if client_side:
                # librdkafka refuses to create the consumer with any of them under KIP-848
                raise conflict(
                    f"group_protocol 'consumer' takes {', '.join(client_side)} from the brokers "
                    "(group.consumer.session.timeout.ms, group.consumer.heartbeat.interval.ms, "
                    "group.consumer.assignors): remove it from consumer, or use group_protocol "
                    "'classic'", "group_protocol", "consumer")
        needed = self.revoke_budget_ms + self.transaction_timeout_ms
        if self.max_poll_interval_ms <= needed:
            # a revoke runs inside poll(): it waits revoke_budget_ms for in-flight groups, then
            # commits a transaction; past max.poll.interval.ms the member is expelled mid-revoke
            raise conflict(
                f"max_poll_interval_ms ({self.max_poll_interval_ms}) must exceed revoke_budget_ms + "
                f"transaction_timeout_ms ({needed}): raise max_poll_interval_ms or lower the others",
                "max_poll_interval_ms", "revoke_budget_ms", "transaction_timeout_ms")
        return self

    @property
    def effective_transactional_id(self) -> str:
        return self.transactional_id or f"{self.group_id}-{socket.gethostname()}"

    def replace(self, **changes) -> StageConfig:
        """A validated copy with ``changes`` (``model_copy(update=...)`` would skip validation).
        Only the fields set explicitly are carried over, so derived values (the staging
        partition) follow the changes."""
        return StageConfig(**{**{name: getattr(self, name) for name in self.model_fields_set}, **changes})


def load_config(path: str | Path | None = None, env: dict | None = None, *,
                overrides: dict | None = None) -> StageConfig:
    """Defaults < the YAML file at ``path`` < ``env`` (default: os.environ) < ``overrides`` (the
    command line's). Raises ConfigError (a ValueError) naming each bad setting, where it came
    from and what is allowed."""
    file_values, origins = from_file(path)
    env_values, env_origins = from_environment(StageConfig, os.environ if env is None else env)
    origins.update(env_origins)
    origins.update({(name,): "command line" for name in overrides or {}})
    try:
        return StageConfig.model_validate(merge(merge(file_values, env_values), overrides or {}))
    except ValidationError as error:
        raise explain(error, StageConfig, origins) from None
