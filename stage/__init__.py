"""rollout-reassembler: verified canonical GRPO rows from staged model calls."""

__version__ = "0.1.0"
