"""The model's route dims (L MoE layers, K experts a token) in direct router replay.

Direct mode shapes a ``[tokens, L, K]`` int16 tensor for every row: a row's own routes, and -1
for a valid row that staged none and for every placeholder. Configured dims
(``finalize.route_layers`` / ``route_topk``) are the model's; without them the stage learns
them from the staged routes (NeMo RL's cache). What is learned comes from producers, so it is
bounded, and one rollout never decides it for others:

* A rollout's fragments are executed in its own dims only while ``L * K`` is at most
  ``MAX_LEARNED_ROUTE_SLOTS`` (4 KiB a token as int16; the largest MoE models published have
  under 800 slots). Above it the rollout is rejected (``route_assembly:fragment_dims_limit``)
  before anything is allocated: a model that large configures its dims.
* Every verified rollout with routes votes for its dims; the last ``WINDOW`` votes are kept.
  Dims are *agreed* once at least ``AGREEMENT`` rollouts voted for them and they hold a strict
  majority of the window. Agreed dims are the stage's from then on (as configured ones are): a
  rollout whose routes have others is rejected (``route_assembly:fragment_model_shape``), and
  they shape the rows that carry no routes of their own. A majority of later votes replaces
  them (a stage whose first rollouts came from a misconfigured worker heals itself).
* Before dims are agreed, a group's routed rows settle its own dims (the dims most of them
  carry; a tie settles none: ``route_dims_unknown``); its placeholders (one token each) take
  them, but a valid row that staged no routes is rejected (``route_dims_unknown``) instead of
  being filled in dims one sibling chose.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from stage.routes.constants import ROUTE_FAILURE_DIMS_LIMIT, ROUTE_FAILURE_MODEL_SHAPE

MAX_LEARNED_ROUTE_SLOTS = 2048     # L * K a token, learned (configured dims are not bounded)
AGREEMENT = 2                      # rollouts that must carry dims before they are agreed
WINDOW = 1024                      # votes kept: the majority is of recent rollouts

Dims = tuple[int, int]


@dataclass(frozen=True)
class GroupDims:
    """The dims one group's route tensor is built with (None: none can be), and whether they
    are agreed (configured, or by votes): only agreed dims shape a valid row without routes."""

    dims: Dims | None
    agreed: bool


@dataclass
class RouteDimsCache:
    """The stage's learned route dims (``dims``: the agreed ones, or None). Dims given at
    construction are taken as agreed (a caller that knows the model) until a majority of votes
    agrees on others. Thread-safe: the finalize threads of one stage share it; each worker
    process has its own."""

    dims: Dims | None = None
    _votes: deque = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False, compare=False)
    _tally: Counter = field(default_factory=Counter, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def rollout_dims(self, first: torch.Tensor) -> tuple[Dims | None, str | None]:
        """The dims to execute a rollout's plan in, given its first fragment's routes (rank 3),
        or (None, executor failure): over the learned bound, or other than the agreed dims."""
        own = (int(first.shape[1]), int(first.shape[2]))
        if own[0] * own[1] > MAX_LEARNED_ROUTE_SLOTS:
            return None, ROUTE_FAILURE_DIMS_LIMIT
        agreed = self.dims
        if agreed is not None and own != agreed:
            self.vote([own])    # counted: a majority of such rollouts replaces the agreed dims
            if self.dims != own:
                return None, ROUTE_FAILURE_MODEL_SHAPE
        return own, None

    def vote(self, dims: list[Dims]) -> None:
        """Count verified rollouts' dims; agree on dims a strict majority of the window holds
        (with at least AGREEMENT votes). A window without such a majority keeps what it had."""
        if not dims:
            return
        with self._lock:
            for one in dims:
                if len(self._votes) == self._votes.maxlen:
                    old = self._votes[0]
                    self._tally[old] -= 1
                    if not self._tally[old]:
                        del self._tally[old]
                self._votes.append(one)
                self._tally[one] += 1
            top, count = self._tally.most_common(1)[0]
            if count >= AGREEMENT and 2 * count > len(self._votes):
                self.dims = top

    def settle(self, routed: list[Dims]) -> GroupDims:
        """A group's dims from its valid rows' routes (``routed``, in row order), once they are
        counted: the agreed dims, else the dims most of its rows carry (a tie: none)."""
        bounded = [d for d in routed if d[0] * d[1] <= MAX_LEARNED_ROUTE_SLOTS]
        self.vote(bounded)
        if self.dims is not None:
            return GroupDims(self.dims, True)
        ranked = Counter(bounded).most_common(2)
        if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
            return GroupDims(None, False)
        return GroupDims(ranked[0][0], False)

    def learn(self, routes: torch.Tensor) -> None:
        """One rollout's routes counted (kept for callers of the NeMo RL name)."""
        self.vote([(int(routes.shape[1]), int(routes.shape[2]))])


class ConfiguredRouteDims(RouteDimsCache):
    """The model's (L, K) from the configuration: staged routes are checked against it, never
    counted (a producer's routes with other dims reject their own rollout)."""

    def rollout_dims(self, first: torch.Tensor) -> tuple[Dims | None, str | None]:
        return self.dims, None

    def vote(self, dims: list[Dims]) -> None:
        pass

    def settle(self, routed: list[Dims]) -> GroupDims:
        return GroupDims(self.dims, True)
