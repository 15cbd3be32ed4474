"""The stage on a real broker plus the operator commands run in-process (``stage.cli.main``),
with the input records' Kafka coordinates recorded as they are acknowledged."""

from __future__ import annotations

import json
from pathlib import Path

from stage.cli import main
from tests.faults.procs import write_config
from tests.integration.harness import Feeder


class CoordinateFeeder(Feeder):
    """A Feeder that remembers where every record it produced landed: (topic, partition, offset)."""

    def __init__(self, bootstrap, topics) -> None:
        super().__init__(bootstrap, topics)
        self.landed: list[tuple[str, int, int, bytes | None]] = []

    def _delivered(self, err, msg) -> None:
        assert err is None, err
        self.landed.append((msg.topic(), msg.partition(), msg.offset(), msg.key()))

    def send(self, topic: str, key: bytes | None, value: bytes | None, *, partition: int | None = None,
             headers=None) -> None:
        extra = {} if partition is None else {"partition": partition}
        self.producer.produce(topic, key=key, value=value, headers=headers, on_delivery=self._delivered, **extra)

    def staged(self, spec, values=None) -> None:
        for value in (spec.staged if values is None else values):
            self.send(self.topics.staged_calls, spec.group_id.encode(), self.staged_codec.encode(value))

    def receipts(self, spec, values=None) -> None:
        for value in (spec.receipts if values is None else values):
            self.send(self.topics.receipts, spec.group_id.encode(), self.receipt_codec.encode(value))

    def where(self, topic: str, key: bytes) -> list[tuple[int, int]]:
        return sorted((p, o) for t, p, o, k in self.landed if t == topic and k == key)


def run_cli(capsys, cfg, tmp_path: Path, *args: str, as_json: bool = True):
    """(exit status, parsed JSON or text, stderr) of ``rollout-reassembler <args> --config
    <the config as YAML>``."""
    config = write_config(cfg, tmp_path / "stage.yaml")
    rc = main([*args, "--config", str(config), "--quiet", *(["--json"] if as_json else [])])
    captured = capsys.readouterr()
    out = captured.out
    return rc, (json.loads(out) if as_json and out.strip() else out), captured.err
