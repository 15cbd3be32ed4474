"""staged_batch._plain_columns: the token columns of a plainly laid-out record, read without
unpack_tensor's general checks, are exactly staged_columns' arrays; any other layout is left to
staged_columns (None)."""

import copy

import numpy as np
import pytest

from stage.bench.wire import staged_call_record
from stage.decode.staged import staged_columns
from stage.decode.staged_batch import _plain_columns
from stage.wire import AvroCodec

CODEC = AvroCodec("StagedCall")


@pytest.mark.parametrize("compact", [False, True])
def test_plain_columns_equal_staged_columns(compact):
    record = CODEC.decode(CODEC.encode(staged_call_record(64, compact=compact)))
    got = _plain_columns(record, record["delta_len"])
    want = staged_columns(record)
    assert got is not None
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes() and a.flags.writeable


def _with(record, name, **change):
    record = copy.deepcopy(record)
    record[name] = dict(record[name], **change)
    return record


ODD = {
    "signed ids": ("token_ids_delta", lambda t: dict(dtype="int64")),
    "bool dim": ("token_mask_delta", lambda t: dict(shape=[True])),
    "tuple shape": ("token_mask_delta", lambda t: dict(shape=tuple(t["shape"]))),
    "2-D": ("token_mask_delta", lambda t: dict(shape=[t["shape"][0], 1])),
    "bytearray data": ("generation_log_probs_delta", lambda t: dict(data=bytearray(t["data"]))),
    "short data": ("generation_log_probs_delta", lambda t: dict(data=t["data"][:-1])),
    "float16": ("generation_log_probs_delta", lambda t: dict(dtype="float16")),
    "wrong length": ("token_ids_delta", lambda t: dict(shape=[t["shape"][0] + 1])),
}


@pytest.mark.parametrize("case", sorted(ODD))
def test_any_other_layout_is_left_to_staged_columns(case):
    record = CODEC.decode(CODEC.encode(staged_call_record(1)))
    name, change = ODD[case]
    odd = _with(record, name, **change(record[name]))
    assert _plain_columns(odd, record["delta_len"]) is None
    missing = copy.deepcopy(record)
    del missing[name]
    assert _plain_columns(missing, record["delta_len"]) is None
