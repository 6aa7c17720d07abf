"""Structured outputs: the check of the JSON schemas a request holds (its `response_format`'s, its tools'
`parameters`), which the worker then makes the engine's grammar (`worker.grammar_spec`).

The API checks a schema against JSON Schema's meta-schema (its own `$schema`'s, else draft 2020-12) before
anything is stored, and refuses the keywords the engine's grammar cannot enforce: the API process must not import
the engine or xgrammar (it loads torch). A schema that is valid but uses what the grammar compiler cannot take
fails its job alone, with the compiler's message (`grammar: ...`).

What a grammar costs to compile grows with its schema (a thousand optional properties take seconds), so the API
also bounds a schema's size, its count of values and its nesting (`SchemaBounds`, from the settings) before it
checks anything else. Checking a large schema takes its time too: the API does it on a thread (`vet`), and the
verdicts it leaves in `VERDICTS` are what the job's validation then reads, so that the event loop never walks a
schema itself.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

if TYPE_CHECKING:
    from jobs.settings import Settings


# keywords the engine's grammar compiler (xgrammar 0.2.9) passes over without enforcing them: an answer could break
# them, so a schema that uses one is refused rather than half kept. Listed here, not in the engine, because the API
# refuses them and must not import the engine.
UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas", "if",
              "then", "else", "unevaluatedProperties", "unevaluatedItems")
# where a schema holds further schemas: one, a list of them, or a map of names to them
ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "not", "propertyNames", "contains", "if", "then",
              "else", "unevaluatedItems", "unevaluatedProperties")
SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# the verdicts of the schemas of the request being validated, by the identity of each schema's object: each entry
# holds the object itself, so that its id stays its own while the request lives
VERDICTS: ContextVar[dict[int, tuple[object, str | None]] | None] = ContextVar("schema_verdicts", default=None)


@dataclass(frozen=True)
class SchemaBounds:
    """What a request's JSON schema may be: its compact JSON's UTF-8 bytes, its JSON values (objects, arrays,
    strings, numbers, ... each one) and how deep its objects and arrays nest (the schema itself is level 1)."""

    max_bytes: int
    max_nodes: int
    max_depth: int

    @classmethod
    def of(cls, settings: Settings) -> SchemaBounds:
        return cls(settings.max_schema_bytes, settings.max_schema_nodes, settings.max_schema_depth)


def bounds_problem(schema: object, bounds: SchemaBounds) -> str | None:
    """Which of `bounds` `schema` passes (naming the bound and its setting), or None."""
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    if size > bounds.max_bytes:
        return f"the schema is {size} bytes of JSON; at most {bounds.max_bytes} (CONVOQ_MAX_SCHEMA_BYTES)"
    nodes, pending = 0, [(schema, 1)]
    while pending:  # iteratively: the walk itself must not recurse
        node, depth = pending.pop()
        nodes += 1
        if nodes > bounds.max_nodes:
            return f"the schema has more than {bounds.max_nodes} JSON values (CONVOQ_MAX_SCHEMA_NODES)"
        if isinstance(node, dict | list):
            if depth > bounds.max_depth:
                return f"the schema nests deeper than {bounds.max_depth} levels (CONVOQ_MAX_SCHEMA_DEPTH)"
            pending.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return None


def embedded_schemas(body: object) -> list[tuple[str, dict]]:
    """The JSON schemas a request body (a job's, a chat completion's, a batch line's) holds, each with where:
    `response_format.json_schema.schema` and each tool's `function.parameters`. Whatever is not shaped so is
    left to the request's validation to refuse."""
    if not isinstance(body, dict):
        return []
    found = []
    json_schema = _at(body, "response_format", "json_schema")
    if isinstance(json_schema, dict) and isinstance(json_schema.get("schema"), dict):
        found.append(("response_format.json_schema.schema", json_schema["schema"]))
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(parameters := _at(tool, "function", "parameters"), dict):
            found.append((f"tools.{i}.function.parameters", parameters))
    return found


def _at(value: object, *keys: str) -> object:
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def within_bounds(body: object, bounds: SchemaBounds) -> list[dict]:
    """The JSON schemas `body` holds (`embedded_schemas`); raises `SchemaTooLarge` naming the first one past
    `bounds`, and the bound."""
    for where, schema in (found := embedded_schemas(body)):
        if problem := bounds_problem(schema, bounds):
            raise SchemaTooLarge(f"{where}: {problem}")
    return [schema for _, schema in found]


def vet(body: object, bounds: SchemaBounds) -> dict[int, tuple[object, str | None]]:
    """The verdicts (`schema_problem`) of the schemas `body` holds, for `VERDICTS`, once they are all within
    `bounds` (`within_bounds`)."""
    return {id(schema): (schema, schema_problem(schema)) for schema in within_bounds(body, bounds)}


class SchemaTooLarge(ValueError):
    """A request's JSON schema is past the API's bounds."""


def vetted_problem(schema: dict[str, Any]) -> str | None:
    """`schema_problem(schema)`, from `VERDICTS` when the API vetted this very object."""
    known = (VERDICTS.get() or {}).get(id(schema))
    return known[1] if known is not None and known[0] is schema else schema_problem(schema)


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
    return next((found for where, sub in _subschemas(schema, path) if (found := _unenforced(sub, where))), None)


def _subschemas(schema: dict, path: str) -> list[tuple[str, object]]:
    """The schemas `schema` holds, with their paths, whatever shape its keywords have: a draft's meta-schema
    checks only its own keywords (draft-07's lets `$defs` be a list), and `items` is a list of schemas in
    drafts before 2020-12."""
    subschemas = []
    for key in ONE_SCHEMA + SCHEMA_LIST:
        value = schema.get(key)
        if isinstance(value, list):
            subschemas += [(f"{path}/{key}/{i}", sub) for i, sub in enumerate(value)]
        elif isinstance(value, dict):
            subschemas.append((f"{path}/{key}", value))
    for key in SCHEMA_MAP:
        if isinstance(value := schema.get(key), dict):
            subschemas += [(f"{path}/{key}/{name}", sub) for name, sub in value.items()]
    return subschemas

