"""Schema field helpers for config dataclasses anywhere in freetx (imports nothing of freetx).

`at_least(n)` marks a count or size that must be `n` or more; the schema checks
(`freetx.config.schema`) report a smaller value with the key's path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MIN_KEY = "min"
_REQUIRED = "???"  # OmegaConf's MISSING


def at_least(minimum: int, default: Any = _REQUIRED) -> Any:
    """A schema field whose value must be `minimum` or more (a count, a size, a period)."""
    return dataclasses.field(default=default, metadata={MIN_KEY: minimum})
