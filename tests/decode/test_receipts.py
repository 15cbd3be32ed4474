"""ReceiptEvent -> ReceiptItem: labels and result_stats are bounded and well-formed, or the
record is refused with the offending entry named (the runtime dead-letters it)."""

import pytest

from stage.buffer import Position
from stage.client import receipt_event
from stage.decode import DecodeError, InputLimits, receipt_item
from stage.wire import AvroCodec

CODEC = AvroCodec("ReceiptEvent")


def decoded(reward=1.0, **fields):
    value = receipt_event(group_id="g", rollout_id="g-r0", rollout_index=0, group_size=2,
                          prompt_idx=1, reward=reward, receipt=None, **fields)
    return CODEC.decode(CODEC.encode(value))       # what the stage sees: the wire's view


def item(record, limits=InputLimits()):
    return receipt_item(record, Position("receipts", 0, 0, 0), 10, limits)


def test_labels_and_result_stats_reach_the_buffer_item():
    out = item(decoded(labels=[("harness", "h")], result_stats=[("score", 2.5, 1), ("turns", 3, 2)]))
    assert out.labels == (("harness", "h"),)
    assert out.result_stats == (("score", 2.5, 1), ("turns", 3.0, 2))


@pytest.mark.parametrize("stats, message", [
    ([("score", 1.0, 1), ("turns", 1.0, 1), ("score", 2.0, 1)],
     "result_stats[2].field: 'score' listed twice (also result_stats[0])"),
    ([("score", float("nan"), 1)], "result_stats[0].sum: must be finite, got nan"),
    ([("ok", 1.0, 1), ("score", float("-inf"), 1)], "result_stats[1].sum: must be finite, got -inf"),
    ([("score", 1.0, -1)], "result_stats[0].count: must be >= 0, got -1"),
    ([("s" * 129, 1.0, 1)], "result_stats[0].field: longer than 128 characters"),
    ([(f"f{i}", 1.0, 1) for i in range(129)], "result_stats: 129 entries, more than 128"),
])
def test_malformed_result_stats_are_refused_with_the_entry_named(stats, message):
    with pytest.raises(DecodeError) as error:
        item(decoded(result_stats=stats))
    assert str(error.value) == message


@pytest.mark.parametrize("labels, message", [
    ([("harness", "n" * 129)], "labels[0].name: longer than 128 characters"),
    ([("s" * 129, "n")], "labels[0].scope: longer than 128 characters"),
    ([("agent", f"a{i}") for i in range(33)], "labels: 33 labels, more than 32"),
])
def test_oversized_labels_are_refused(labels, message):
    with pytest.raises(DecodeError) as error:
        item(decoded(labels=labels))
    assert str(error.value) == message


def test_limits_are_configurable():
    record = decoded(labels=[("a", "b"), ("c", "d")], result_stats=[("x", 1.0, 1), ("y", 1.0, 1)])
    with pytest.raises(DecodeError, match="labels: 2 labels, more than 1"):
        item(record, InputLimits(max_labels=1))
    with pytest.raises(DecodeError, match="result_stats: 2 entries, more than 1"):
        item(record, InputLimits(max_result_stats=1))
    assert item(record).result_stats == (("x", 1.0, 1), ("y", 1.0, 1))


@pytest.mark.parametrize("name", ["reward", "loss_multiplier"])
@pytest.mark.parametrize("value", [1e308, -1e308, 3.5e38, float("inf"), float("nan")])
def test_rewards_and_loss_multipliers_beyond_float32_are_refused(name, value):
    """Rows publish them as Avro floats: 1e308 passed a float64 finite check and was published
    as total_reward = inf / sample_mask = -inf in a valid row."""
    with pytest.raises(DecodeError) as error:
        item(decoded(**{name: value}))
    assert str(error.value).startswith(f"{name}: must be finite and within float32 range")


@pytest.mark.parametrize("value", [3.4028234e38, -3.4028234e38, 0.0, -1e-45])
def test_rewards_at_float32_extremes_are_kept(value):
    assert item(decoded(reward=value)).reward == value


def test_result_stat_sums_that_could_overflow_the_group_sum_are_refused():
    with pytest.raises(DecodeError, match=r"result_stats\[0\]\.sum: must be at most 4.39e\+304"):
        item(decoded(result_stats=[("score", 1e308, 1)]))
    assert item(decoded(result_stats=[("score", 1e300, 1)])).result_stats == (("score", 1e300, 1),)
