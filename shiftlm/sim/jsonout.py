"""Strict JSON for every `--json` the simulator prints: RFC 8259 has no NaN or Infinity.

Python's `json.dumps` writes `NaN` / `Infinity` by default, which `jq`, JavaScript's `JSON.parse`
and most non-Python readers reject. A non-finite number here always means "none" (an empty table's
MAPE, a serving layout that never shifts), so it is written as `null`.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every NaN / +-inf float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` that writes null for non-finite numbers and can never emit NaN / Infinity."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
