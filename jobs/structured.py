"""Structured outputs: the check of a `response_format`'s JSON schema, and the grammar spec the engine constrains
the answer with (`engine.grammar`: JSON text, `{"type": "json_schema", "schema": ...}` or `{"type": "json_object"}`).

The API checks a schema against JSON Schema's meta-schema (its own `$schema`'s, else draft 2020-12) before
anything is stored: the API process must not import xgrammar (it loads torch). A schema that is valid but uses
what the grammar compiler cannot take fails its job alone, with the compiler's message (`grammar: ...`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

if TYPE_CHECKING:
    from jobs.schemas import ResponseFormat


# keywords the grammar compiler (xgrammar 0.2.9) passes over without enforcing them: an answer could break them,
# so a schema that uses one is refused rather than half kept
UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas", "if",
              "then", "else", "unevaluatedProperties", "unevaluatedItems")
# where a schema holds further schemas: one, a list of them, or a map of names to them
ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "not", "propertyNames", "contains", "if", "then",
              "else", "unevaluatedItems", "unevaluatedProperties")
SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What makes `schema` no JSON schema (where, and why), or one the grammar cannot enforce, or None."""
    declared = schema.get("$schema")
    meta = Draft202012Validator if not isinstance(declared, str) else validator_for(schema, Draft202012Validator)
    try:
        meta.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.path)
        return f"not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else "")
    if where := _unenforced(schema, ""):
        return (f"{where.rpartition('/')[2]} (at {where.lstrip('/') or 'the top'}) cannot be enforced while the "
                f"answer is generated; supported: types, properties, required, enum/const, anyOf/oneOf/allOf, "
                f"$ref, bounds on numbers, lengths, item counts and patterns")
    return None


def _unenforced(schema: object, path: str) -> str | None:
    """The path of the first keyword of UNENFORCED in `schema` or the schemas it holds (a property *named* like
    one is no keyword), or None."""
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return f"{path}/{key}"
    subschemas = [(f"{path}/{key}", schema[key]) for key in ONE_SCHEMA if key in schema]
    subschemas += [(f"{path}/{key}/{i}", sub) for key in SCHEMA_LIST for i, sub in enumerate(schema.get(key) or [])]
    subschemas += [(f"{path}/{key}/{name}", sub) for key in SCHEMA_MAP
                   for name, sub in (schema.get(key) or {}).items()]
    return next((found for where, sub in subschemas if (found := _unenforced(sub, where))), None)


def grammar_spec(response_format: ResponseFormat | None) -> str | None:
    """The engine's grammar spec for a job's `response_format`; None (free text) for `text` or none.

    Compact, so that one schema sent twice is one spec (the engine caches compiled grammars by spec). Keys are
    not sorted: the grammar emits an object's properties in the schema's order, which the client chose (a
    `reasoning` property before its `answer`)."""
    if response_format is None or response_format.type == "text":
        return None
    spec: dict[str, Any] = {"type": response_format.type}
    if response_format.type == "json_schema":
        spec["schema"] = response_format.json_schema.schema_
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
