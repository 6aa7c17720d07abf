"""Spans of time as the CLI takes them: 90s, 30m, 2h, 1d, 1w (`report --since`, `prune --older-than`)."""

from __future__ import annotations

import re
from datetime import timedelta

SPAN = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
SPAN_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_span(text: str) -> timedelta | None:
    """The span `text` names, or None if it names none."""
    if span := SPAN.fullmatch(text.strip()):
        return timedelta(seconds=float(span[1]) * SPAN_SECONDS[span[2]])
    return None
