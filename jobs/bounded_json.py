"""JSON parsed within bounds: what nests too deep, or holds a number no float holds, is refused."""

from __future__ import annotations

import json
import math
import sys

# JSON nested deeper than this is refused wherever it comes in (request bodies, batch lines, form fields): no
# request needs more, and Python's parser and pydantic's serializer fail (a 500) long before a client runs out
MAX_JSON_DEPTH = 64
FLOAT_DIGITS = 308  # an integer of more digits may be past a float's range (about 1.8e308)


class UnheldNumber(ValueError):
    """JSON that holds a number no float holds: what Python reads as NaN or infinity, stored as null (the job
    it was part of would fail when it is read back), or an integer past a float's range."""


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise UnheldNumber(f"the number {text[:40]} is out of a float's range")
    return value


def _int(text: str) -> int:
    value = int(text)
    if len(text) > FLOAT_DIGITS and abs(value) > sys.float_info.max:
        raise UnheldNumber(f"the number {text[:40]}... ({len(text)} digits) is out of a float's range")
    return value


def _constant(name: str) -> float:
    raise UnheldNumber(f"{name} is no JSON number")


def bounded_json(text: str | bytes) -> object:
    """`json.loads`, refusing (`ValueError`) what nests deeper than `MAX_JSON_DEPTH`, and (`UnheldNumber`) NaN,
    Infinity and numbers past a float's range."""
    too_deep = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = json.loads(text, parse_float=_float, parse_int=_int, parse_constant=_constant)
    except RecursionError:
        raise ValueError(too_deep) from None
    brackets = (text.count("[") + text.count("{")) if isinstance(text, str) else (text.count(b"[") + text.count(b"{"))
    if brackets > MAX_JSON_DEPTH and _deeper_than(value, MAX_JSON_DEPTH):  # few brackets (most requests): no walk
        raise ValueError(too_deep)
    return value


def _deeper_than(value: object, limit: int) -> bool:
    pending = [(value, 1)]
    while pending:  # iteratively: the walk itself must not recurse
        node, depth = pending.pop()
        if isinstance(node, dict | list):
            if depth > limit:
                return True
            pending.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False
