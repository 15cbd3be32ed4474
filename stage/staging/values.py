"""Value checks shared by the decoder and finalization."""

from __future__ import annotations

import math

import numpy as np


def fits_float32(value: float) -> bool:
    """Finite, and finite once rounded to float32: the published width of total_reward and
    sample_mask (Avro floats), so 1e308 is as unpublishable as inf."""
    with np.errstate(over="ignore"):
        return math.isfinite(value) and bool(np.isfinite(np.float32(value)))
