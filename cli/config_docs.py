"""The configuration reference, docs/configuration.md, written from the settings themselves: every `CONVOQ_*`
setting of the service (`jobs.settings.Settings`, each explained by its docstring), every engine knob the worker
reads (`engine.config.EngineConfig`, through `worker.engine_factory.WorkerSettings`) and the command-line client's
variables. `convoq config-docs` writes the page; `tests/test_docs.py` fails when the committed page differs.

`python -m cli.config_docs [--check]` does the same without the `convoq` command.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import SecretStr
from pydantic.fields import FieldInfo

from engine.builder import Knob, knobs
from engine.config import describe
from jobs.settings import Settings

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
PREFIX = "CONVOQ_"

INTRO = """\
# Configuration

<!-- Written by `convoq config-docs` from jobs/settings.py and engine/config.py: edit those, then run it again.
     tests/test_docs.py fails when this page and the code disagree. -->

Every setting is an environment variable, `CONVOQ_` and the setting's name in capitals, or a line of a `.env`
file in the directory the process starts in (the environment wins). Each process reads them once, at start: the
API, the workers, Flower and every `convoq` command read the service settings; the workers (and `convoq doctor`,
`convoq tune`) read the engine's knobs as well. A value out of its bounds stops the process at start with a line
naming the setting, never a value silently clamped. Booleans take `true`/`false`, `1`/`0`, `on`/`off`,
`yes`/`no`. Secrets (URLs with passwords, keys) are never printed or logged; `.env.example` lists what a
docker-compose deployment must set.
"""


def type_name(annotation: Any) -> str:
    """A field's type as a reader would say it: `int`, `secret string`, `one of auto, none`, `int or unset`."""
    if annotation is SecretStr:
        return "secret string"
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in get_args(annotation))
    if get_origin(annotation) in (Union, types.UnionType):
        named = [type_name(arg) for arg in get_args(annotation) if arg is not type(None)]
        return " or ".join(named) + (" or unset" if type(None) in get_args(annotation) else "")
    if hasattr(annotation, "__metadata__"):  # Annotated
        return type_name(get_args(annotation)[0])
    return {str: "string", bool: "boolean", int: "integer", float: "number"}.get(annotation, str(annotation))


def default_text(name: str, value: Any) -> str:
    """A default as it would be written in the environment, with byte counts also in KiB, MiB, GiB or MB."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return "empty"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    shown = f"`{value}`"
    if isinstance(value, int) and value >= 1024 and ("bytes" in name or "memory" in name):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("MB", 10**6)):
            if value % size == 0:
                return f"{shown} ({value // size} {unit})"
    return shown


def setting_bounds(field: FieldInfo) -> dict[str, Any]:
    """The bounds pydantic checks on a field (a type such as `Priority` brings its own): ge, gt, le, lt, and a
    pattern."""
    found: dict[str, Any] = {}
    for item in field.metadata:
        for attr in ("ge", "gt", "le", "lt", "pattern"):
            if getattr(item, attr, None) is not None:
                found[attr] = getattr(item, attr)
    return found


def bounds_text(bound: dict[str, Any], table: bool = False) -> str:
    """Bounds in words; in a table a pattern is only named (its `|` would split the cell)."""
    numeric = {op: limit for op, limit in bound.items() if op != "pattern"}
    parts = [describe(numeric)] if numeric else []
    if "pattern" in bound:
        parts.append("a pattern" if table else f"matches `{bound['pattern']}`")
    return "; ".join(parts)


def entry(name: str, kind: str, default: str, bound: dict[str, Any], text: str) -> list[str]:
    facts = "; ".join([kind, f"default {default}", *filter(None, [bounds_text(bound)])])
    return [f"### `{PREFIX}{name.upper()}`", "", facts[0].upper() + facts[1:] + ".", "", text or "(no description)", ""]


def summary(rows: list[tuple[str, str, str, dict[str, Any]]]) -> list[str]:
    lines = ["| setting | type | default | bounds |", "|---|---|---|---|"]
    for name, kind, default, bound in rows:
        anchor = f"{PREFIX}{name.upper()}".lower()
        lines.append(f"| [`{PREFIX}{name.upper()}`](#{anchor}) | {kind} | {default} | "
                     f"{bounds_text(bound, table=True) or '-'} |")
    return [*lines, ""]


def settings_section(settings: type[Settings]) -> list[str]:
    rows, entries = [], []
    for name, field in settings.model_fields.items():
        kind, default, bound = type_name(field.annotation), default_text(name, field.default), setting_bounds(field)
        rows.append((name, kind, default, bound))
        entries += entry(name, kind, default, bound, field.description or "")
    return [*summary(rows), *entries]


def knobs_section(found: dict[str, Knob]) -> list[str]:
    rows, entries = [], []
    for name, knob in found.items():
        default = default_text(name, knob.default)
        kind = ("one of " + ", ".join(f"`{c}`" for c in knob.choices)) if knob.choices else type_name(knob.type)
        rows.append((name, kind, default, knob.bound))
        entries += entry(name, kind, default, knob.bound, knob.doc)
    return [*summary(rows), *entries]


def client_section() -> list[str]:
    from cli.batch import KEY, URL

    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for option in (URL, KEY):
        lines.append(f"| `{option.envvar}` | {default_text('', option.default)} | {option.help} |")
    return [*lines, ""]


def render(settings: type[Settings] = Settings, engine_knobs: dict[str, Knob] | None = None) -> str:
    """The whole page."""
    lines = [INTRO,
             "## Service settings", "",
             "Read by every process of the service (API, workers, Flower, the `convoq` commands).", "",
             *settings_section(settings),
             "## Engine knobs", "",
             "The engine's own knobs (`engine/config.py`), read by the workers, `convoq doctor` and `convoq tune`. "
             "The engine checks each when a worker starts, and a value it refuses stops the worker with its reason. "
             "`convoq tune` measures the best `CONVOQ_MAX_NUM_SEQS` and `CONVOQ_MAX_NUM_BATCHED_TOKENS` for a "
             "sample of real jobs.", "",
             *knobs_section(knobs() if engine_knobs is None else engine_knobs),
             "## Command-line client", "",
             "What `convoq submit`, `convoq cancel` and `convoq batch` talk to (each also takes `--url` and "
             "`--api-key`).", "",
             *client_section()]
    return "\n".join(lines).rstrip("\n") + "\n"


def write(path: Path = PAGE, check: bool = False) -> bool:
    """Write the page (or with `check`, only compare); whether it was already up to date."""
    text = render()
    current = path.read_text() if path.exists() else None
    if not check and current != text:
        path.write_text(text)
    return current == text


def main(argv: list[str]) -> int:
    check = "--check" in argv
    fresh = write(check=check)
    if check and not fresh:
        print(f"{PAGE.name} is out of date: run `convoq config-docs`", file=sys.stderr)
        return 1
    print(f"{PAGE.name} {'is up to date' if fresh else 'written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
