"""Hypothesis strategies: random *valid* multi-call rollouts staged through RolloutBuilder.

A rollout is a root (text mode), a terminal chain of token_in children, and off-chain calls
(retries / abandoned siblings, possibly with their own abandoned subtrees, possibly extra
roots). Every call keeps the raw inputs it was staged from (``CallSpec``) so the tests can
recompute the expected LinearizedRow independently of the verifier.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from stage.contract import StagedCallBaseSnapshot, encode_routed_experts
from stage.contract.producer import RolloutBuilder

U64_MAX = (1 << 64) - 1
F32_MAX = float(np.finfo(np.float32).max)  # 3.4028234663852886e38
MAX_CALLS = 8
MAX_PART = 20  # prompt delta and generation are each <= 20 tokens, so a delta is <= 40

EDGE_TOKENS = [0, 1, 2, 255, 2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, U64_MAX - 1, U64_MAX]
EDGE_LOGPROBS = [-0.0, 0.0, -1e-50, -5e-324, -1e-45, -0.1, -0.25, -3.4e38, -F32_MAX, -1e30]
EDGE_WEIGHT_VERSIONS = [0, 1, 2**32, 2**63, U64_MAX]

# Single values (used by other modules' strategies).
token_ids = st.one_of(st.integers(0, 1000), st.integers(0, U64_MAX), st.sampled_from(EDGE_TOKENS))
generated_logprobs = st.one_of(
    st.floats(min_value=-F32_MAX, max_value=0.0, allow_nan=False, allow_infinity=False),
    st.sampled_from(EDGE_LOGPROBS),
)


# Columns are drawn in bulk from a seed (per-element draws make a rollout ~10x slower); the
# drawn "flavour" still lets hypothesis steer towards the edge values.
_SEEDS = st.integers(0, 2**32 - 1)
_TOKEN_FLAVOURS = st.sampled_from(["small", "u64", "edge", "mixed"])
_LOGPROB_FLAVOURS = st.sampled_from(["uniform", "edge", "wide", "mixed"])
_SIZES = {(lo, hi): st.integers(lo, hi) for lo in range(2) for hi in range(MAX_PART + 1)}


def draw_tokens(draw, min_size: int = 0, max_size: int = MAX_PART) -> list[int]:
    n = draw(_SIZES[(min_size, max_size)]) if min_size != max_size else min_size
    if n == 0:
        return []
    flavour = draw(_TOKEN_FLAVOURS)
    rng = np.random.default_rng(draw(_SEEDS))
    small = rng.integers(0, 1000, n, endpoint=True).tolist()
    wide = rng.integers(0, U64_MAX, n, dtype=np.uint64, endpoint=True).tolist()
    edge = [EDGE_TOKENS[i] for i in rng.integers(0, len(EDGE_TOKENS), n)]
    if flavour == "small":
        return small
    if flavour == "u64":
        return wide
    if flavour == "edge":
        edge[-1] = U64_MAX
        return edge
    pick = rng.integers(0, 3, n)
    return [(small, wide, edge)[k][i] for i, k in enumerate(pick)]


def draw_logprobs(draw, size: int) -> list[float]:
    if size == 0:
        return []
    flavour = draw(_LOGPROB_FLAVOURS)
    rng = np.random.default_rng(draw(_SEEDS))
    uniform = (-rng.uniform(0.0, 20.0, size)).tolist()
    edge = [EDGE_LOGPROBS[i] for i in rng.integers(0, len(EDGE_LOGPROBS), size)]
    wide = (-np.power(10.0, rng.uniform(-320.0, 38.5, size))).tolist()
    if flavour == "uniform":
        return uniform
    if flavour == "edge":
        return edge
    if flavour == "wide":
        return wide
    pick = rng.integers(0, 3, size)
    return [float((uniform, edge, wide)[k][i]) for i, k in enumerate(pick)]


weight_versions = st.one_of(st.integers(0, 10), st.integers(0, U64_MAX),
                            st.sampled_from(EDGE_WEIGHT_VERSIONS))

# Identifiers: non-empty str; '/', non-ASCII and astral characters are legal.
identifiers = st.one_of(
    st.from_regex(r"[a-z][a-z0-9_-]{0,6}", fullmatch=True),
    st.text(min_size=1, max_size=6),
    st.sampled_from(["call/1", "été", "\U0001f600", "a b", "0"]),
)

_ROUTE_RANGES = {"int8": (-128, 127), "int16": (-(2**15), 2**15 - 1), "int32": (-(2**31), 2**31 - 1)}


_DTYPES = st.sampled_from(sorted(_ROUTE_RANGES))
_WIDTH = st.integers(1, 3)
_BOOLS = st.booleans()


def draw_envelope(draw, rows: int) -> str:
    """An nrlre1 envelope with ``rows`` token rows (values cover the dtype's extremes)."""
    dtype = draw(_DTYPES)
    layers = draw(_WIDTH)
    topk = draw(_WIDTH)
    lo, hi = _ROUTE_RANGES[dtype]
    rng = np.random.default_rng(draw(_SEEDS))
    values = rng.integers(lo, hi, size=(rows, layers, topk), endpoint=True, dtype=np.int64)
    if draw(_BOOLS):
        values.flat[0] = lo
        values.flat[-1] = hi
    if draw(_BOOLS):
        values.flat[rng.integers(0, values.size)] = -1  # MISSING_ROUTE_SENTINEL-like value
    return encode_routed_experts(values, dtype=dtype)


_ROW_KINDS = st.sampled_from(["delta", "delta", "generated", "cumulative", "other"])
_PICK = {n: st.integers(0, n) for n in range(MAX_CALLS + 1)}
_ADMITTED_AT = st.one_of(st.none(), st.floats(0, 2e9))
_EXTRAS_KINDS = st.sampled_from(["none", "none", "empty", "routes", "routes+meta", "meta"])
_MEDIA_SPANS = st.lists(
    st.fixed_dictionaries({"start": st.integers(0, 100), "end": st.integers(0, 100)}), max_size=2)
_NOTES = st.one_of(st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False),
                   st.integers(-(2**63), 2**63 - 1), st.booleans(), st.none())


def draw_extras(draw, delta_len: int, generated: int, cum_len: int):
    """None, {} (a different digest!), or a dict with routes and/or other JSON-like keys."""
    kind = draw(_EXTRAS_KINDS)
    if kind == "none":
        return None
    if kind == "empty":
        return {}
    extras: dict = {}
    if kind.startswith("routes"):
        which = draw(_ROW_KINDS)
        rows = {"delta": delta_len, "generated": max(generated, 1), "cumulative": cum_len,
                "other": 0}[which] or draw(_WIDTH) * 2
        extras["routed_experts"] = draw_envelope(draw, rows)
    if kind.endswith("meta"):
        extras["media_spans"] = draw(_MEDIA_SPANS)
        extras["note"] = draw(_NOTES)
    return extras


@dataclass
class CallSpec:
    call_id: str
    parent: str | None
    prompt_delta: list[int]
    generated: list[int]
    logprobs: list[float]
    weight_version: int
    extras: dict | None
    admitted_at: float | None
    on_chain: bool

    @property
    def delta(self) -> list[int]:
        return self.prompt_delta + self.generated


@dataclass
class Rollout:
    rollout_id: str
    calls: dict[str, CallSpec]  # admission (staging) order
    chain: list[str]            # root ... terminal
    order: list[str]            # manifest order
    builder: RolloutBuilder
    receipt: object
    snapshots: list = field(default_factory=list)

    @property
    def terminal(self) -> str:
        return self.chain[-1]

    @property
    def off_chain(self) -> list[str]:
        return [c for c in self.order if c not in self.chain]

    def index(self, call_id: str) -> int:
        return self.order.index(call_id)


@st.composite
def rollouts(draw, max_calls: int = MAX_CALLS, min_calls: int = 1, min_chain: int = 1,
             min_off_chain: int = 0, with_extras: bool = True, list_columns: bool | None = False):
    """A valid rollout: builder, receipt (manifest in a random order) and snapshots in the
    same order. ``list_columns=None`` lets hypothesis choose list vs numpy token columns."""
    rollout_id = draw(identifiers)
    n_chain = draw(st.integers(min_chain, max_calls - min_off_chain))
    n_off = draw(st.integers(max(min_off_chain, min_calls - n_chain), max_calls - n_chain))
    ids = draw(st.lists(identifiers, min_size=n_chain + n_off, max_size=n_chain + n_off,
                        unique=True))
    chain_ids, off_ids = ids[:n_chain], ids[n_chain:]
    # Admission order: the chain root first, then chain calls (in order) interleaved with
    # off-chain calls, each of which hangs off something admitted before it (or is a root).
    kinds = draw(st.permutations(["chain"] * (n_chain - 1) + ["off"] * n_off))
    builder = RolloutBuilder(rollout_id)
    calls: dict[str, CallSpec] = {}
    next_chain, next_off = iter(chain_ids), iter(off_ids)
    for kind in ["chain", *kinds]:
        if kind == "chain":
            call_id = next(next_chain)
            on_chain = True
            parent = chain_ids[chain_ids.index(call_id) - 1] if call_id != chain_ids[0] else None
        else:
            call_id = next(next_off)
            on_chain = False
            pick = draw(_PICK[len(calls)])  # 0 = another root
            parent = None if pick == 0 else list(calls)[pick - 1]
        generated_n = draw(_SIZES[(1 if on_chain else 0, MAX_PART)])
        prompt_min = 0 if generated_n else 1
        prompt_delta = draw_tokens(draw, prompt_min, MAX_PART)
        generated = draw_tokens(draw, generated_n, generated_n)
        logprobs = draw_logprobs(draw, generated_n)
        prefix = builder.calls[parent].manifest_row.cum_len if parent is not None else 0
        delta_len = len(prompt_delta) + generated_n
        extras = (draw_extras(draw, delta_len, generated_n, prefix + delta_len)
                  if with_extras else None)
        spec = CallSpec(
            call_id=call_id, parent=parent, prompt_delta=prompt_delta, generated=generated,
            logprobs=logprobs, weight_version=draw(weight_versions), extras=extras,
            admitted_at=draw(_ADMITTED_AT), on_chain=on_chain)
        builder.stage(call_id, parent_call_id=parent, prompt_delta=prompt_delta,
                      generated=generated, generated_logprobs=logprobs,
                      weight_version=spec.weight_version, extras=extras,
                      admitted_at=spec.admitted_at)
        calls[call_id] = spec
    order = draw(st.permutations(list(calls)))
    receipt = builder.receipt(chain_ids[-1], order=order)
    snapshots = builder.snapshots(order)
    if list_columns is None:
        list_columns = draw(_BOOLS)
    if list_columns:
        snapshots = [with_list_columns(s) for s in snapshots]
    return Rollout(rollout_id, calls, list(chain_ids), list(order), builder, receipt, snapshots)


# --- record copies (Record.construct never validates) ----------------------------------------

def fields_of(record) -> dict:
    return {name: getattr(record, name) for name, _p, _d in type(record).FIELDS}


def replace(record, **changes):
    """A copy of a wire record with some attributes changed, without validation."""
    return type(record).construct(**{**fields_of(record), **changes})


def with_list_columns(snapshot):
    """The same snapshot holding Python lists (Gym's own types) instead of numpy arrays."""
    return replace(
        snapshot,
        token_ids_delta=[int(x) for x in snapshot.token_ids_delta],
        token_mask_delta=[float(x) for x in snapshot.token_mask_delta],
        generation_log_probs_delta=[float(x) for x in snapshot.generation_log_probs_delta])


def replace_manifest_row(receipt, index: int, **changes):
    manifest = list(receipt.manifest)
    manifest[index] = replace(manifest[index], **changes)
    return replace(receipt, manifest=manifest)


def base_snapshot_of(record) -> StagedCallBaseSnapshot:
    return StagedCallBaseSnapshot.construct(
        **{name: getattr(record, name) for name, _p, _d in StagedCallBaseSnapshot.FIELDS})
