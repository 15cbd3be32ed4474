"""A stand-in for confluent_kafka.Producer: records what is produced, acknowledges on poll/flush
(or fails every delivery with a given error), so SDK behaviour is testable without a broker."""

from __future__ import annotations

from confluent_kafka import KafkaError


class FakeMessage:
    def __init__(self, topic, key, value, offset) -> None:
        self._topic, self._key, self._value, self._offset = topic, key, value, offset

    def topic(self):
        return self._topic

    def key(self):
        return self._key

    def value(self):
        return self._value

    def offset(self):
        return self._offset

    def partition(self):
        return 0


class FakeProducer:
    def __init__(self, fail_with: int | None = None) -> None:
        self.fail_with = fail_with
        self.records: list[FakeMessage] = []
        self._pending: list = []

    def produce(self, topic, key=None, value=None, headers=None, on_delivery=None):
        msg = FakeMessage(topic, key, value, len(self.records))
        self.records.append(msg)
        self._pending.append((msg, on_delivery))

    def poll(self, timeout=0):
        served, self._pending = self._pending, []
        for msg, callback in served:
            err = None if self.fail_with is None else KafkaError(self.fail_with)
            callback(err, msg)
        return len(served)

    def flush(self, timeout=None):
        self.poll()
        return 0
