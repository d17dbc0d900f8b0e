"""JSON the evaluation tools write: strict JSON, which has no NaN."""

from __future__ import annotations

import math
from typing import Any


def without_nan(value: Any) -> Any:
    """`value` with every NaN as None (ranx and scipy give NaN for two identical runs,
    whose difference cannot be tested)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: without_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_nan(v) for v in value]
    return value
