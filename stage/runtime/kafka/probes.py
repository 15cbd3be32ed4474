"""Questions the consumer loop asks the brokers without waiting for the answers.

End offsets (read_committed: the last stable offset), committed offsets and partition counts
are asked on a small thread pool through consumers of their own (never subscribed, never
committing), one partition per request, and come back as futures the loop checks each
iteration. One partition per request: librdkafka fails a multi-partition ListOffsets as a whole
when one leader is down, and the point is to know which partition is unavailable. Consumers,
not the admin client: librdkafka 2.16's admin client aborted the process (an assertion in its
coordinator-request path) when a request was pending while the coordinator's broker died.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from confluent_kafka import Consumer, TopicPartition

from stage.runtime.kafka.clients import common
from stage.config.model import StageConfig


class BrokerQueries:
    def __init__(self, cfg: StageConfig, *, workers: int = 4, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        base = {**common(cfg), "enable.auto.commit": False, "enable.partition.eof": False,
                **{k: v for k, v in cfg.consumer.items() if k != "group.instance.id"}}
        # the stage's group id: committed() answers for the group; this consumer never joins it
        self.consumer = Consumer({**base, "group.id": cfg.group_id, "isolation.level": "read_committed"})
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="broker-query")

    def end_offset(self, topic: str, partition: int) -> Future:
        """The partition's last stable offset (what a read_committed reader can reach)."""
        return self.pool.submit(self._end_offset, topic, partition)

    def _end_offset(self, topic: str, partition: int) -> int:
        (tp,) = self.consumer.offsets_for_times([TopicPartition(topic, partition, -1)], timeout=self.timeout_s)
        if tp.error is not None:
            raise RuntimeError(str(tp.error))
        return tp.offset

    def start_offset(self, topic: str, partition: int) -> Future:
        """Where the group's consumer starts: the committed offset, else the log start."""
        return self.pool.submit(self._start_offset, topic, partition)

    def _start_offset(self, topic: str, partition: int) -> int:
        (tp,) = self.consumer.committed([TopicPartition(topic, partition)], timeout=self.timeout_s)
        if tp.error is not None:
            raise RuntimeError(str(tp.error))
        if tp.offset >= 0:
            return tp.offset
        low, _ = self.consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                     timeout=self.timeout_s, cached=False)
        return low

    def partition_count(self, topic: str) -> Future:
        return self.pool.submit(self._partition_count, topic)

    def _partition_count(self, topic: str) -> int:
        metadata = self.consumer.list_topics(topic, timeout=max(5.0, self.timeout_s))
        info = metadata.topics.get(topic)
        if info is None or info.error is not None:
            raise RuntimeError(f"no metadata for {topic}: {info.error if info else 'unknown topic'}")
        return len(info.partitions)

    def ask_metadata(self, topic: str, timeout_s: float) -> None:
        """One metadata request (to a random connected broker), raising when none answers in
        ``timeout_s``: stage.runtime.kafka.liveness."""
        self.consumer.list_topics(topic, timeout=timeout_s)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.consumer.close()
        except RuntimeError:
            pass
