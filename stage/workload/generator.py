"""Seeded synthetic agentic rollouts: what inference workers and rollout owners would produce.

Every group is one prompt answered N times. A rollout is a multi-turn chain (a text root with
the group's prompt, then ``token_in`` children that add a tool result or user turn and
generate), with abandoned retries (a sibling of the call that replaced it, staged and named by
the receipt but off the terminal chain), off-chain side calls (separate text roots, e.g. a
judge or summarizer), weight versions that advance mid-rollout, MoE routes ``[delta, L, K]``
with the child's boundary route of its parent's last token, optional image media on the root
and optional sampler top-k. Faults are drawn per rollout (``faults.FaultRates``).

Each call's Gym record is built here with ``RolloutBuilder`` from its own extras (route
envelopes and boundary index computed here), so a producer that stages the same inputs must
return exactly these manifest rows. ``generate(config)`` is a pure function of the config:
the same seed gives the same bytes.

Sizes: by default every call's token counts are drawn from the ``*_tokens`` ranges (small,
toy-sized rollouts). With ``rollout_tokens=(mean, max)`` each rollout first draws its length
(log-normal around the mean, capped at the max) and its turns share it, as long agentic
rollouts do (``stage.workload.profiles``: the named profiles).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from stage.contract import CallRecord, RolloutReceipt, RouteEnvelope, StagedCallRecord
from stage.contract.producer import RolloutBuilder, StagedCall
from stage.finalize import StagedMedia, TopK
from stage.routes import (
    ROUTED_EXPERTS_BOUNDARY_FIELD,
    ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD,
    ROUTED_EXPERTS_FIELD,
)
from stage.wire import AvroCodec, WireError
from stage.workload import faults as F

CHAIN, RETRY, SIDE = "chain", "retry", "side"
_ROUTE_RANGES = {"int8": 127, "int16": 32_767, "int32": 2**31 - 1}  # largest expert id


@dataclass(frozen=True)
class WorkloadConfig:
    groups: int = 40
    group_size: int = 4                       # N rollouts per prompt
    turns: tuple[int, int] = (1, 4)           # terminal-chain length, inclusive range
    prompt_tokens: tuple[int, int] = (24, 96)
    turn_tokens: tuple[int, int] = (4, 32)    # tokens a tool result / user turn adds
    generated_tokens: tuple[int, int] = (8, 64)
    retry_rate: float = 0.15                  # a turn is first attempted and abandoned
    side_call_rate: float = 0.2               # a rollout makes an off-chain side call
    weight_version: int = 100                 # the policy version at the start
    version_bump_rate: float = 0.2            # the policy advances between two calls
    route_layers: int = 4                     # L (0: a dense model, no routes)
    route_topk: int = 2                       # K
    num_experts: int = 64
    route_dtype: str | tuple[str, ...] = "int16"   # a tuple: one drawn per rollout (its worker's)
    boundary_routes: bool = True
    media_rate: float = 0.0                   # a rollout's prompt carries an image
    media_patch_size: int = 14
    topk: int = 0                             # sampler top-k columns (0: none)
    vocab_size: int = 32_000
    seed: int = 0
    faults: F.FaultRates = field(default_factory=F.FaultRates)
    group_prefix: str = "g"
    # (mean, max) tokens of a rollout's terminal chain; None: per-call ranges above
    rollout_tokens: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.groups < 0 or self.group_size <= 0:
            raise ValueError("groups must be >= 0 and group_size > 0")
        for name in ("turns", "prompt_tokens", "turn_tokens", "generated_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        for name in ("retry_rate", "side_call_rate", "version_bump_rate", "media_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.route_layers < 0 or (self.route_layers and self.route_topk <= 0):
            raise ValueError("route_layers must be >= 0 and route_topk > 0 with routes")
        for dtype in self.route_dtypes:
            if dtype not in _ROUTE_RANGES:
                raise ValueError(f"route_dtype must be one of {sorted(_ROUTE_RANGES)}, got {dtype!r}")
            if self.routes and self.num_experts - 1 > _ROUTE_RANGES[dtype]:
                raise ValueError(f"{self.num_experts} experts do not fit route_dtype {dtype}")
        if self.rollout_tokens is not None:
            mean, most = self.rollout_tokens
            if not 1 <= mean <= most:
                raise ValueError(f"rollout_tokens must be (mean, max) with 1 <= mean <= max, "
                                 f"got {self.rollout_tokens}")
            if most < self.prompt_tokens[1] + 2 * self.turns[1]:
                raise ValueError("rollout_tokens max leaves no room for the prompt and the turns")

    @property
    def route_dtypes(self) -> tuple[str, ...]:
        return (self.route_dtype,) if isinstance(self.route_dtype, str) else tuple(self.route_dtype)

    @property
    def routes(self) -> tuple[int, int] | None:
        return (self.route_layers, self.route_topk) if self.route_layers else None


@dataclass(frozen=True, eq=False)
class CallSpec:
    """One model call: the inputs a worker stages, and the Gym record they make."""

    model_call_id: str
    parent_call_id: str | None
    role: str                                  # chain | retry (abandoned) | side
    prompt_delta: np.ndarray                   # uint64
    generated: np.ndarray                      # uint64
    logprobs: np.ndarray                       # float64 (float32-exact)
    weight_version: int
    routed_experts: np.ndarray | None          # [delta, L, K] in route_dtype
    routed_experts_boundary: np.ndarray | None  # [1, L, K] in route_dtype
    media: StagedMedia | None
    topk: TopK | None
    staged: StagedCall                         # snapshot + extras (route envelopes as parts)
    manifest_row: CallRecord
    route_dtype: str = "int16"                 # the dtype its worker stages routes in

    @property
    def record(self) -> StagedCallRecord:
        """The Gym record (its envelope strings written out on first use)."""
        return self.staged.record

    @property
    def staging_key(self) -> str:
        return self.manifest_row.staging_key

    def stage_kwargs(self, route_dtype: str | None = None) -> dict:
        """Keyword arguments of ``RolloutStager.prepare``/``stage`` for this call (routes in
        the call's own dtype unless ``route_dtype`` says otherwise)."""
        route_dtype = route_dtype or self.route_dtype
        return dict(parent_call_id=self.parent_call_id, prompt_delta=self.prompt_delta,
                    generated=self.generated, generated_logprobs=self.logprobs,
                    weight_version=self.weight_version, routed_experts=self.routed_experts,
                    routed_experts_boundary=self.routed_experts_boundary, route_dtype=route_dtype,
                    media=self.media, topk=self.topk, response_id=self.manifest_row.response_id)


@dataclass(eq=False)
class RolloutSpec:
    group_id: str
    rollout_id: str
    rollout_index: int
    reward: float
    calls: list[CallSpec]
    terminal: str
    receipt: RolloutReceipt                    # the clean receipt (what a healthy owner sends)
    fault: str | None = None
    fault_call: str | None = None              # the call a staged-row or digest fault hits
    tamper_position: int = 0                   # tampered_tokens: the delta index changed
    fake_digest: str = ""                      # tampered_digest: what the manifest claims
    vocab_size: int = 32_000

    def call(self, model_call_id: str) -> CallSpec:
        return next(c for c in self.calls if c.model_call_id == model_call_id)

    # -- what the rollout owner emits --------------------------------------------------------
    def emitted_receipt(self) -> dict | None:
        """The receipt JSON in its event (None: a missing-receipt event). Late receipts are
        emitted later, clean: see ``late``."""
        if self.fault in (F.MISSING_RECEIPT, F.LATE_RECEIPT):
            return None
        receipt = self.receipt.to_json()
        if self.fault == F.POISONED_RECEIPT:
            return F.poison_receipt(receipt)
        if self.fault == F.TAMPERED_DIGEST:
            return F.tamper_manifest_digest(receipt, self.fault_call, self.fake_digest)
        return receipt

    @property
    def late(self) -> bool:
        return self.fault == F.LATE_RECEIPT

    def staged_action(self, call: CallSpec) -> str:
        """What reaches the staged-calls topic for ``call``: send, skip or tamper."""
        if call.model_call_id == self.fault_call:
            if self.fault == F.MISSING_STAGED:
                return "skip"
            if self.fault == F.TAMPERED_TOKENS:
                return "tamper"
        return "send"

    # -- what the stage can know (for an independent recomputation) --------------------------
    def staged_records(self) -> list[tuple[StagedCallRecord, CallSpec]]:
        """The Gym records as they reach staging (faults applied), with their calls."""
        out = []
        for call in self.calls:
            action = self.staged_action(call)
            if action == "send":
                out.append((call.record, call))
            elif action == "tamper":
                out.append((F.tamper_staged_record(call.record, self.tamper_position, self.vocab_size), call))
        return out

    def expected_rejection(self, staged_topic: str) -> F.ExpectedRejection | None:
        if self.fault is None:
            return None
        if self.fault == F.TAMPERED_TOKENS:
            return F.ExpectedRejection("invalid_staging_row:", exact=False,
                                       contains=("digest does not match staged call contents",))
        if self.fault == F.TAMPERED_DIGEST:
            real = self.call(self.fault_call).record.digest
            return F.ExpectedRejection(f"rebuild_failed:wrong_digest: call {self.fault_call}: "
                                       f"snapshot {real!r}, manifest {self.fake_digest!r}")
        if self.fault == F.POISONED_RECEIPT:
            return F.ExpectedRejection("capture_poisoned")
        if self.fault in (F.MISSING_RECEIPT, F.LATE_RECEIPT):
            return F.ExpectedRejection("missing_receipt")
        n = len(self.calls)
        return F.ExpectedRejection("missing_staging_row:", exact=False,
                                   contains=(f"requested {n} keys from {staged_topic!r}", f"got {n - 1} rows"))


@dataclass(frozen=True)
class Garbage:
    topic_role: str        # receipts | staged_calls
    kind: str              # random | truncated | empty
    value: bytes


@dataclass(eq=False)
class GroupSpec:
    group_id: str
    prompt_idx: int
    rollouts: list[RolloutSpec]
    garbage: list[Garbage] = field(default_factory=list)

    @property
    def group_size(self) -> int:
        return len(self.rollouts)

    @property
    def expected_outcome(self) -> str:
        return "deadline" if any(r.fault in F.DEADLINE_FAULTS for r in self.rollouts) else "complete"


@dataclass(eq=False)
class Workload:
    config: WorkloadConfig
    groups: list[GroupSpec]

    @property
    def rollouts(self) -> list[RolloutSpec]:
        return [r for g in self.groups for r in g.rollouts]

    def fault_counts(self) -> Counter:
        counts = Counter(r.fault for r in self.rollouts if r.fault)
        garbage = sum(len(g.garbage) for g in self.groups)
        if garbage:
            counts[F.GARBAGE] = garbage
        return counts

    @property
    def calls(self) -> int:
        return sum(len(r.calls) for r in self.rollouts)


# ---------------------------------------------------------------------------------------------


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


class _RolloutMaker:
    """Builds one rollout's calls (the worker's view) and their Gym records."""

    def __init__(self, cfg: WorkloadConfig, rng: np.random.Generator, group_id: str,
                 rollout_id: str, prompt: np.ndarray, image: StagedMedia | None) -> None:
        self.cfg, self.rng = cfg, rng
        self.group_id = group_id
        self.builder = RolloutBuilder(rollout_id)
        self.prompt, self.image = prompt, image
        self.version = cfg.weight_version + int(rng.integers(0, 2))
        self.calls: list[CallSpec] = []
        self.lengths: dict[str, int] = {}  # call id -> full sequence length
        dtypes = cfg.route_dtypes  # drawn only when there is a choice (keeps single-dtype streams)
        self.route_dtype = dtypes[int(rng.integers(0, len(dtypes)))] if len(dtypes) > 1 else dtypes[0]
        # Route values come from a stream of their own, seeded by one draw made with routes or
        # without: the same seed gives the same rollouts (tokens, calls, versions) whatever the
        # route dims, so a workload with routes and the same one without (bench e2e's anchor)
        # or at other dims (agentic-moe and frontier) differ only in their routes.
        self.route_rng = np.random.default_rng(int(rng.integers(0, 1 << 63)))

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.cfg.vocab_size, n).astype(np.uint64)

    def call(self, call_id: str, parent: str | None, prompt_delta: np.ndarray, role: str,
             media: StagedMedia | None = None, generated_len: int | None = None) -> CallSpec:
        cfg, rng = self.cfg, self.rng
        if rng.random() < cfg.version_bump_rate:
            self.version += 1
        if generated_len is None:
            generated_len = _between(rng, cfg.generated_tokens)
        generated = self.tokens(generated_len)
        logprobs = (-rng.exponential(0.7, len(generated))).astype(np.float32).astype(np.float64)
        delta = len(prompt_delta) + len(generated)
        routes = boundary = None
        extras = None
        if cfg.routes is not None:
            layers, k = cfg.routes
            dtype = self.route_dtype   # held in the staged dtype: agentic groups carry GBs of routes
            routes = self.route_rng.integers(0, cfg.num_experts, (delta, layers, k)).astype(dtype)
            extras = {ROUTED_EXPERTS_FIELD: RouteEnvelope.of(routes, dtype)}
            if parent is not None and cfg.boundary_routes:
                boundary = self.route_rng.integers(0, cfg.num_experts, (1, layers, k)).astype(dtype)
                extras[ROUTED_EXPERTS_BOUNDARY_FIELD] = RouteEnvelope.of(boundary, dtype)
                # the parent's last token, in the canonical row's coordinates
                extras[ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD] = self.lengths[parent] - 1
        topk = None
        if cfg.topk:
            ids = rng.integers(0, cfg.vocab_size, (len(generated), cfg.topk)).astype(np.int32)
            lps = np.sort(-rng.exponential(1.0, (len(generated), cfg.topk)), axis=1)[:, ::-1]
            topk = TopK(ids=ids, logprobs=np.ascontiguousarray(lps, dtype=np.float32))
        staged = self.builder.stage(
            call_id, parent_call_id=parent, prompt_delta=prompt_delta, generated=generated,
            generated_logprobs=logprobs, weight_version=self.version, extras=extras,
            response_id=f"resp-{self.builder.rollout_id}-{call_id}")
        self.lengths[call_id] = (self.lengths[parent] if parent else 0) + delta
        spec = CallSpec(call_id, parent, role, np.asarray(prompt_delta, np.uint64), generated,
                        logprobs, self.version, routes, boundary, media, topk, staged,
                        staged.manifest_row, self.route_dtype)
        self.calls.append(spec)
        return spec

    def build(self) -> tuple[list[CallSpec], str]:
        cfg, rng = self.cfg, self.rng
        turns = _between(rng, cfg.turns)
        side_at = int(rng.integers(0, turns)) if rng.random() < cfg.side_call_rate else -1
        plan = self._turn_plan(turns) if cfg.rollout_tokens is not None else None
        parent: str | None = None
        for turn in range(turns):
            carry, generated = plan[turn] if plan is not None else (None, None)
            if parent is None:
                prompt_delta = self.prompt
            else:
                prompt_delta = self.tokens(carry if carry is not None else _between(rng, cfg.turn_tokens))
            media = self.image if parent is None else None
            if rng.random() < cfg.retry_rate:  # first attempt abandoned (e.g. a tool-call parse error)
                self.call(f"t{turn}a", parent, prompt_delta, RETRY, media, generated)
            parent = self.call(f"t{turn}", parent, prompt_delta, CHAIN, media, generated).model_call_id
            if turn == side_at:
                self.call(f"side{turn}", None, self.tokens(_between(rng, cfg.prompt_tokens)), SIDE,
                          generated_len=generated)
        return self.calls, parent

    def _turn_plan(self, turns: int) -> list[tuple[int, int]]:
        """(carry, generated) tokens of each chain turn for a rollout of a drawn length: a
        log-normal around the configured mean (long agentic rollouts are heavy-tailed), capped
        at the max; turns share it unevenly, carry (tool output, user turn) and generation
        split at random. The root's carry is the group prompt, so its entry carries 0."""
        mean, most = self.cfg.rollout_tokens
        sigma = 0.6
        target = float(self.rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma))
        budget = int(min(most, max(target, len(self.prompt) + 2 * turns))) - len(self.prompt)
        share = self.rng.uniform(0.5, 1.5, turns)
        generated_part = self.rng.uniform(0.25, 0.6, turns)
        size = share / share.sum() * budget
        generated = np.maximum(1, np.floor(size * generated_part)).astype(np.int64)
        carry = np.maximum(1, np.floor(size - generated)).astype(np.int64)
        carry[0] = 0
        while carry.sum() + generated.sum() > budget:  # floors of 1 can overshoot a tight budget
            i = int(np.argmax(carry + generated))
            if carry[i] > 1:
                carry[i] -= 1
            else:
                generated[i] -= 1
        return [(int(c), int(g)) for c, g in zip(carry, generated)]


def _image(cfg: WorkloadConfig, rng: np.random.Generator) -> StagedMedia:
    patches, p = int(rng.integers(1, 5)), cfg.media_patch_size
    imgs = rng.random((1, patches, 3 * p * p)).astype(np.float16)
    return StagedMedia(imgs=imgs, imgs_sizes=np.array([[p, p * patches]], dtype=np.int32))


_RECEIPT_CODEC = AvroCodec("ReceiptEvent")
_STAGED_CODEC = AvroCodec("StagedCall")


def _garbage(rng: np.random.Generator, sample_receipt: bytes) -> Garbage:
    kind = ("random", "truncated", "empty")[int(rng.integers(0, 3))]
    if kind == "empty":
        return Garbage("staged_calls", kind, b"")
    if kind == "truncated":
        return Garbage("receipts", kind, sample_receipt[: max(1, len(sample_receipt) // 2)])
    role = ("receipts", "staged_calls")[int(rng.integers(0, 2))]
    codec = _RECEIPT_CODEC if role == "receipts" else _STAGED_CODEC
    while True:  # random bytes that certainly do not decode (a decodable draw is astronomically rare)
        value = rng.bytes(int(rng.integers(1, 64)))
        try:
            codec.decode(value)
        except WireError:
            return Garbage(role, kind, value)


def generate_group(cfg: WorkloadConfig, index: int) -> GroupSpec:
    """Group ``index`` of the workload (independent of the others: its own RNG stream)."""
    rng = np.random.default_rng([cfg.seed, index])
    group_id = f"{cfg.group_prefix}{cfg.seed}-{index:05d}"
    prompt = rng.integers(0, cfg.vocab_size, _between(rng, cfg.prompt_tokens)).astype(np.uint64)
    rollouts = []
    for i in range(cfg.group_size):
        rollout_id = f"{group_id}-r{i}"
        image = _image(cfg, rng) if cfg.media_rate and rng.random() < cfg.media_rate else None
        maker = _RolloutMaker(cfg, rng, group_id, rollout_id, prompt, image)
        calls, terminal = maker.build()
        reward = float(rng.integers(0, 5)) / 4.0
        rollout = RolloutSpec(group_id, rollout_id, i, reward, calls, terminal,
                              maker.builder.receipt(terminal, terminal_selection="declared"),
                              vocab_size=cfg.vocab_size)
        _assign_fault(rollout, cfg.faults.pick(rng), rng)
        rollouts.append(rollout)
    if all(r.fault for r in rollouts):
        # Keep one clean rollout per group: a direct-replay stage that has not learned the
        # model's (L, K) yet drops an all-placeholder group (it cannot shape its routes).
        _assign_fault(rollouts[0], None, rng)
    group = GroupSpec(group_id, index, rollouts)
    if cfg.faults.garbage and rng.random() < cfg.faults.garbage:
        sample = _RECEIPT_CODEC.encode({
            "group_id": group_id, "rollout_id": rollouts[0].rollout_id, "rollout_index": 0,
            "group_size": cfg.group_size, "prompt_idx": index, "reward": 0.0,
            "receipt": rollouts[0].receipt.to_json()})
        group.garbage.append(_garbage(rng, sample))
    return group


def _assign_fault(rollout: RolloutSpec, fault: str | None, rng: np.random.Generator) -> None:
    rollout.fault, rollout.fault_call = fault, None
    if fault in (F.TAMPERED_TOKENS, F.TAMPERED_DIGEST, F.MISSING_STAGED):
        victim = rollout.calls[int(rng.integers(0, len(rollout.calls)))]
        rollout.fault_call = victim.model_call_id
        rollout.tamper_position = int(rng.integers(0, victim.record.delta_len))
        rollout.fake_digest = rng.bytes(32).hex()


def generate(config: WorkloadConfig) -> Workload:
    return Workload(config, [generate_group(config, i) for i in range(config.groups)])
