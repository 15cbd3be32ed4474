"""DeferredRouteFetcher's cache without a broker: an LRU bounded by bytes, and an integrity
check that runs once per fragment and digest."""

import numpy as np
import torch

from stage.client.route_fetch import DeferredRouteFetcher, FetchedFragment
from stage.contract import compute_extras_digest, encode_routed_experts
from stage.routes import ROUTE_ENCODING_ENVELOPE, RouteFragment, RouteSpan
from stage.routes.fragment import encode_extras_metadata_json


def _fetcher(**kwargs) -> DeferredRouteFetcher:
    # no broker is ever contacted: only the cache is exercised
    return DeferredRouteFetcher("127.0.0.1:1", dims=(2, 2), **kwargs)


def _entry(key: str, tokens: int, seed: int = 0) -> tuple[FetchedFragment, str]:
    values = np.random.default_rng(seed).integers(0, 60, (tokens, 2, 2)).astype(np.int16)
    extras = {"routed_experts": encode_routed_experts(values, "int16")}
    fragment = RouteFragment(torch.from_numpy(values), ROUTE_ENCODING_ENVELOPE,
                             encode_extras_metadata_json(extras))
    return FetchedFragment(key, fragment), compute_extras_digest(extras)


def test_cache_is_an_lru_bounded_by_bytes():
    entries = [_entry(f"r/c{i}", 100, i)[0] for i in range(6)]
    size = entries[0].nbytes
    assert size == 100 * 2 * 2 * 2 + len(entries[0].fragment.extras_metadata_json) + 1024
    fetcher = _fetcher(cache_bytes=3 * size)
    out: dict = {}
    fetcher._remember({("t", 0, i): e for i, e in enumerate(entries[:3])}, out)
    assert list(fetcher.cache) == [("t", 0, 0), ("t", 0, 1), ("t", 0, 2)] and fetcher.cached_bytes == 3 * size
    fetcher.fetch([("t", 0, 0)])                    # a hit refreshes it
    fetcher._remember({("t", 0, 3): entries[3], ("t", 0, 4): entries[4]}, out)
    assert list(fetcher.cache) == [("t", 0, 0), ("t", 0, 3), ("t", 0, 4)]   # 1 and 2 were oldest
    assert fetcher.cached_bytes == 3 * size <= fetcher.cache_bytes
    big = _entry("r/big", 10_000)[0]
    fetcher._remember({("t", 0, 9): big, ("t", 0, 8): LookupError("gone")}, out)
    assert ("t", 0, 9) not in fetcher.cache and out[("t", 0, 9)] is big     # used, not kept
    assert ("t", 0, 8) not in fetcher.cache


def test_integrity_runs_once_per_fragment_and_digest():
    entry, digest = _entry("r/c0", 5)
    good = RouteSpan("r/c0", 2, 3, 5, 1, digest)
    other = RouteSpan("r/c0", 2, 3, 5, 1, "0" * 64)
    fetcher = _fetcher()
    assert fetcher._integrity(good, entry.fragment) and fetcher._integrity(good, entry.fragment)
    assert not fetcher._integrity(other, entry.fragment) and not fetcher._integrity(other, entry.fragment)
    assert (fetcher.verified, fetcher.verified_cached) == (2, 2)
    copy = FetchedFragment("r/c0", RouteFragment(entry.fragment.routes.clone(), ROUTE_ENCODING_ENVELOPE,
                                                 entry.fragment.extras_metadata_json))
    assert fetcher._integrity(good, copy.fragment) and fetcher.verified == 3   # another read: checked
