"""A batch's completion window in OpenAI's form (`"24h"`), at most `jobs.schemas.MAX_DEADLINE_S`."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, WithJsonSchema

from jobs.schemas import MAX_DEADLINE_S

DEFAULT_COMPLETION_WINDOW = "24h"


WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# the windows of at most 7 days, as a pattern the OpenAPI document carries (window_seconds checks the same)
WINDOW_PATTERN = r"^([1-9][0-9]{0,4}s|[1-5][0-9]{5}s|60[0-3][0-9]{3}s|604[0-7][0-9]{2}s|604800s|[1-9][0-9]{0,3}m|100[0-7][0-9]m|10080m|[1-9][0-9]?h|1[0-5][0-9]h|16[0-8]h|[1-7]d)$"


def window_seconds(window: str) -> int:
    """A completion window in OpenAI's form (`"24h"`; also `"90s"`, `"30m"`, `"2d"`) in seconds."""
    match = re.fullmatch(r"([1-9]\d{0,6})([smhd])", window)
    if match is None:
        raise ValueError(f"completion_window {window!r} is not a window like '24h', '30m' or '2d'")
    seconds = int(match[1]) * WINDOW_UNITS[match[2]]
    if seconds > MAX_DEADLINE_S:
        raise ValueError(f"completion_window {window!r} is longer than {MAX_DEADLINE_S // 86400}d")
    return seconds


def _valid_window(window: str) -> str:
    window_seconds(window)
    return window


# a completion window: checked by `window_seconds` (its message names the problem), documented by the pattern
Window = Annotated[str, AfterValidator(_valid_window), WithJsonSchema({"type": "string", "pattern": WINDOW_PATTERN})]
