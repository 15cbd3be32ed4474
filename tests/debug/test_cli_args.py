"""The operator commands' arguments without a broker: every option says its default, times
parse in the three documented forms, bad values are usage errors."""

from __future__ import annotations

import argparse

import pytest

from stage.cli import _parser, main
from stage.debug.cli import parse_time
from stage.debug.deadletters import Filters, parse
from stage.debug.kafka import Record
from stage.publish.deadletters import DeadLetter


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


@pytest.mark.parametrize("path", [("inspect",), ("dead-letters", "list"), ("dead-letters", "replay")])
def test_every_option_has_help_with_its_default(path):
    parser = _parser()
    for name in path:
        parser = dict(_subparsers(parser))[name]
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and "default" in action.help, (path, action.option_strings)


def test_times_in_epoch_ms_iso_or_before_now():
    now = 1_800_000_000_000
    assert parse_time("1764500000000", now) == 1_764_500_000_000
    assert parse_time("2026-11-30T10:00:00Z", now) == parse_time("2026-11-30T10:00:00", now) \
        == parse_time("2026-11-30T11:00:00+01:00", now)
    assert parse_time("90s", now) == now - 90_000 and parse_time("2h", now) == now - 7_200_000
    assert parse_time("1.5d", now) == now - 129_600_000
    with pytest.raises(argparse.ArgumentTypeError, match="not a time"):
        parse_time("yesterday", now)


@pytest.mark.parametrize("argv", [["inspect", "g", "--since", "soon"],
                                  ["dead-letters", "replay", "--at", "3"],
                                  ["dead-letters", "list", "--error-class", "bogus"]])
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2


def test_a_config_error_exits_3_as_in_every_command(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_setting: 1\n")
    assert main(["dead-letters", "list", "--config", str(bad)]) == 3
    assert "configuration error" in capsys.readouterr().err


def test_dead_letter_headers_parse_back_and_foreign_records_are_recognised():
    letter = DeadLetter("in", 3, 41, b"g", b"v", [("trace", b"x")], "InvalidError: bad", "invalid")
    topic, _, key, value, headers = letter.record("dl")
    view = parse(Record(topic, 0, 7, 1, key, value, tuple(headers)))
    assert (view.source_topic, view.source_partition, view.source_offset) == ("in", 3, 41)
    assert (view.error_class, view.error, view.original_headers) == ("invalid", "InvalidError: bad",
                                                                      (("trace", b"x"),))
    assert view.marker_key == "dl/0/7" and view.well_formed
    foreign = parse(Record("dl", 0, 8, 1, b"g", b"v", (("trace", b"x"),)))
    assert not foreign.well_formed and "not a dead letter" in foreign.error
    assert Filters(error_classes={"invalid"}, source_partition=3).match(view)
    assert not Filters(grep="other").match(view)
    with pytest.raises(ValueError, match="unknown error class"):
        Filters(error_classes={"bogus"})
