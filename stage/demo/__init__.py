"""``rollout-reassembler demo``: broker, topics, stage, workload through the SDK, reader, checks.

Names are imported on first use, so the command line's parser (``stage.cli.demo``) stays light.
"""

from importlib import import_module

_EXPORTS = {"Demo": "run", "DemoOptions": "run", "ROUTE_MODES": "run", "run_demo": "run",
            "percentiles": "report", "render": "report", "write_json": "report"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"stage.demo.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'stage.demo' has no attribute {name!r}")
