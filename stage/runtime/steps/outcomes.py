"""What the steps are given and what they hand back, besides their typed work.

A step is not handed callbacks into other steps. It is given a read-only ``Budget`` (taken by
the runtime from the steps that own each figure) and it reports what it cannot handle itself
as an outcome that ``StageRuntime.step`` handles in one place: ``Rewind`` (start every
partition over from the committed offsets: an aborted or replaced transaction, a failed seek),
``ConsumerFenced`` (the consumer can go on no more: a new one joins) or a
``stage.runtime.exits.StageExit`` (the stage must stop).
"""

from __future__ import annotations

from dataclasses import dataclass

_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Budget:
    """A snapshot of what the stage holds, for the steps that must not exceed it."""

    room: int = _UNLIMITED   # bytes left under max_buffered_bytes (negative when over it)
    reserve: int = 0         # of the room, what the intake leaves for a group's finalization
    busy: bool = False       # some group is being finalized, waits for a worker, or is publishing
    idle: bool = True        # no transaction in flight


class Rewind(Exception):
    """Every assigned partition must start over from its committed offsets."""


class ConsumerFenced(Exception):
    """The group coordinator fenced the consumer's static group.instance.id, which librdkafka
    makes fatal for that consumer: every partition goes as if lost, and a new consumer with the
    same settings joins the group again."""
