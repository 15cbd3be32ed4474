"""verify._check_graph skips its ancestry walks when every parent's row precedes its child's;
on any manifest (ordered, shuffled, with cycles, absent parents, lengths that do not join) it
raises exactly what a plain walk from each row, in row order, raises."""

import random
from types import SimpleNamespace

import pytest

from stage.contract.errors import RebuildError
from stage.contract.verify import _check_graph


def _reference(manifest) -> str | None:
    by_id = {r.model_call_id: i for i, r in enumerate(manifest)}
    for record in manifest:
        parent = record.parent_call_id
        if parent is not None:
            if parent not in by_id:
                return f"missing_parent: call {record.model_call_id} names absent parent {parent}"
            if manifest[by_id[parent]].cum_len != record.prev_len:
                return (f"parent_length_mismatch: call {record.model_call_id} starts at "
                        f"{record.prev_len}, parent ends at {manifest[by_id[parent]].cum_len}")
        seen, node = [], record.model_call_id
        while node is not None and node in by_id:
            if node in seen:
                return f"lineage_cycle: cycle reaches call {node}"
            seen.append(node)
            node = manifest[by_id[node]].parent_call_id
    return None


def _outcome(manifest) -> str | None:
    try:
        _check_graph(manifest, {r.model_call_id: i for i, r in enumerate(manifest)})
    except RebuildError as error:
        return str(error)
    return None


def _manifest(rng: random.Random, n: int):
    rows, ends = [], {}
    for i in range(n):
        parent = None if i == 0 or rng.random() < 0.15 else f"c{rng.randrange(i)}"
        prev = 0 if parent is None else ends[parent]
        ends[f"c{i}"] = prev + rng.randint(1, 5)
        rows.append(SimpleNamespace(model_call_id=f"c{i}", parent_call_id=parent,
                                    prev_len=prev, cum_len=ends[f"c{i}"]))
    return rows


@pytest.mark.parametrize("seed", range(300))
def test_check_graph_raises_what_a_walk_from_each_row_raises(seed):
    rng = random.Random(seed)
    manifest = _manifest(rng, rng.randint(1, 12))
    kind = seed % 5
    if kind == 1:
        rng.shuffle(manifest)                      # children before parents: the walks run
    elif kind == 2 and len(manifest) > 2:          # a cycle (lengths made to join)
        a, b = rng.sample(range(len(manifest)), 2)
        manifest[a].parent_call_id = manifest[b].model_call_id
        manifest[b].parent_call_id = manifest[a].model_call_id
        manifest[a].prev_len = manifest[b].cum_len
        manifest[b].prev_len = manifest[a].cum_len
        rng.shuffle(manifest)
    elif kind == 3:
        manifest[rng.randrange(len(manifest))].parent_call_id = "absent"
    elif kind == 4:
        manifest[rng.randrange(len(manifest))].prev_len += 1
    assert _outcome(manifest) == _reference(manifest)


def test_a_two_row_cycle_is_found():
    a = SimpleNamespace(model_call_id="a", parent_call_id="b", prev_len=3, cum_len=3)
    b = SimpleNamespace(model_call_id="b", parent_call_id="a", prev_len=3, cum_len=3)
    assert _outcome([a, b]) == "lineage_cycle: cycle reaches call a"
