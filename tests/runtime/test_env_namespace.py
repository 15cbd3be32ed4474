"""Every ROLLOUT_REASSEMBLER_* variable the code, the Makefile, the image or the chart names is
either a setting or declared not one (stage.config.sources.NOT_SETTINGS): the stage refuses any
other variable in its namespace (exit 3), so a switch that is neither stops every `run` in an
environment that sets it (`make test` sets ROLLOUT_REASSEMBLER_REQUIRE_NATIVE)."""

from __future__ import annotations

import re
from pathlib import Path

from stage.config.model import StageConfig
from stage.config.sources import ENV_PREFIX, NESTING, NOT_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(ENV_PREFIX + r"([A-Z0-9_]+)")
PLACES = ["stage/**/*.py", "tools/**/*.py", "tools/**/*.sh", "Makefile", "Dockerfile", "deploy/**/*.yaml",
          "deploy/**/*.tpl"]


def _names() -> dict[str, str]:
    found = {}
    for pattern in PLACES:
        for path in ROOT.glob(pattern):
            if path.is_file():
                for match in NAME.finditer(path.read_text(errors="replace")):
                    found.setdefault(ENV_PREFIX + match.group(1).rstrip("_"), str(path.relative_to(ROOT)))
    return found


def test_every_variable_in_the_namespace_is_a_setting_or_declared_not_one():
    fields = {name.upper() for name in StageConfig.model_fields}
    strays = {name: where for name, where in _names().items()
              if name not in NOT_SETTINGS and name[len(ENV_PREFIX):].split(NESTING)[0] not in fields}
    assert not strays, f"neither a setting nor in NOT_SETTINGS: {strays}"


def test_the_scan_sees_the_variables_it_guards():
    assert {"ROLLOUT_REASSEMBLER_MALLOC_TUNING", "ROLLOUT_REASSEMBLER_NATIVE",
            "ROLLOUT_REASSEMBLER_REQUIRE_NATIVE"} <= set(_names())
