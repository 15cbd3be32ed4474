"""examples/check_trainer.py's classification without a broker: every published group is
trained, stale, not yet read, missing or twice, from the checkpoint's lists and position."""

from __future__ import annotations

import importlib.util

from tests.examples.test_examples import EXAMPLES

_spec = importlib.util.spec_from_file_location("check_trainer", EXAMPLES / "check_trainer.py")
check_trainer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_trainer)


def test_each_published_group_is_in_exactly_one_class():
    published = {"a", "b", "c", "d", "e", "f", "g"}
    trained = ["a", "b", "b", "x"]                  # b twice; x unknown to the topics
    stale = ["c", "a"]                              # a trained and set aside: twice too
    read_past = {"a": True, "b": True, "c": True, "d": True, "e": False, "f": False, "g": True}
    handed_out = {"e"}                              # handed out, rows straddle the position
    out = check_trainer.classify(published, trained, stale, read_past, handed_out)
    assert out == {"trained": [], "stale": ["c"], "not yet": ["f"], "missing": ["d", "e", "g"],
                   "twice": ["a", "b"], "unknown": ["x"]}


def test_a_clean_run_has_only_trained_stale_and_not_yet():
    out = check_trainer.classify({"a", "b", "c"}, ["a"], ["b"], {"a": True, "b": True, "c": False}, set())
    assert out == {"trained": ["a"], "stale": ["b"], "not yet": ["c"], "missing": [], "twice": [], "unknown": []}
