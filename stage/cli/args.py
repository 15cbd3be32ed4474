"""Argument types and help formatting shared by the command line's parsers: a bad argument is
refused at once (argparse's usage error, exit status 2), and every option's help states its
default."""

from __future__ import annotations

import argparse
import re

from stage.config.types import DEVICE_PATTERN


class Help(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says what the default
    is (options whose default is None describe it in words: "default: start a local broker")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # `is`, not `in`: 0 == False, and a default of 0 is worth stating
        if ("default" in text or not action.option_strings or action.required or action.nargs == 0
                or any(action.default is v for v in (None, False, argparse.SUPPRESS))):
            return text
        return text + " (default: %(default)s)"


def add_parser(commands, name: str, help: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose help lists its options with their defaults."""
    return commands.add_parser(name, help=help, description=kwargs.pop("description", help),
                               formatter_class=Help, **kwargs)


def at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"   # argparse names the type in "invalid <type> value"
    return parse


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def device(text: str) -> str:
    if not re.fullmatch(DEVICE_PATTERN, text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda, cuda:N or auto, got {text!r}")
    return text


def topic_prefix(text: str) -> str:
    # the prefix becomes part of every topic name: Kafka's legal characters only
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", text):
        raise argparse.ArgumentTypeError(f"must be letters, digits, '.', '_' or '-', got {text!r}")
    return text


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
