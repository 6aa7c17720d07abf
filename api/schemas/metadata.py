"""OpenAI's `metadata`: its bounds, what of a stored one may be shown, and the priority that may ride in it."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints, WithJsonSchema

from jobs.priority import HIGHEST, LEVELS, LOWEST
from jobs.schemas import NO_NUL

METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds on `metadata`
# OpenAI's `metadata`: at most 16 string keys of 64 characters, each with a string of at most 512
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=METADATA_KEY_CHARS, pattern=NO_NUL)],
         Annotated[str, StringConstraints(max_length=METADATA_VALUE_CHARS, pattern=NO_NUL)]],
    Field(max_length=METADATA_KEYS),
    # the keys' bounds as `propertyNames` (pydantic would write a `patternProperties` that lets other keys through)
    WithJsonSchema({"type": "object", "maxProperties": METADATA_KEYS,
                    "propertyNames": {"maxLength": METADATA_KEY_CHARS, "pattern": NO_NUL},
                    "additionalProperties": {"type": "string", "maxLength": METADATA_VALUE_CHARS, "pattern": NO_NUL}})]


def safe_metadata(stored: object) -> dict[str, str]:
    """Metadata as it may be shown, from whatever a row holds: rows stored before `Metadata` bounded it may hold
    anything JSON can; what does not fit the bounds is left out, never a reason for a read to fail."""
    if not isinstance(stored, dict):
        return {}
    kept = {k: v for k, v in stored.items() if isinstance(k, str) and isinstance(v, str) and "\x00" not in k + v
            and len(k) <= METADATA_KEY_CHARS and len(v) <= METADATA_VALUE_CHARS}
    return dict(list(kept.items())[:METADATA_KEYS])


PRIORITY_TEXTS = frozenset(str(p) for p in LEVELS)


def _priority_is_a_digit(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata and "priority" in metadata and metadata["priority"] not in PRIORITY_TEXTS:
        raise ValueError(f"metadata.priority must be a digit '{LOWEST}'..'{HIGHEST}' ({HIGHEST} most urgent), not "
                         f"{metadata['priority']!r}")
    return metadata


# OpenAI's `metadata`, in which a priority may ride as its digit
PriorityMetadata = Annotated[Metadata | None, AfterValidator(_priority_is_a_digit)]


def metadata_priority(metadata: dict[str, str] | None) -> int | None:
    return None if not metadata or "priority" not in metadata else int(metadata["priority"])
