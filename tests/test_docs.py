"""The documentation cannot drift from the code: the configuration reference is what the settings generate, every
setting the pages name exists, and the site builds with every link and page in place."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

from cli import config_docs
from engine.builder import knobs
from engine.config import BOUNDS, CHOICES, EngineConfig
from jobs.settings import Settings
from worker.engine_factory import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# CONVOQ_ variables that are not settings of the service: the command-line client's (generated on the page too),
# the tests' servers, and docker-compose's folder of models
NOT_SETTINGS = {"CONVOQ_API_URL", "CONVOQ_API_KEY", "CONVOQ_TEST_REDIS_URL", "CONVOQ_TEST_DATABASE_URL",
                "CONVOQ_MODELS_DIR"}


def test_the_configuration_page_is_what_the_settings_generate():
    assert (DOCS / "configuration.md").read_text() == config_docs.render(), \
        "docs/configuration.md is out of date: run `convoq config-docs`"


def test_every_setting_and_engine_knob_is_explained_on_the_page():
    page = config_docs.render()
    for name, field in WorkerSettings.model_fields.items():
        assert field.description, f"CONVOQ_{name.upper()} has no docstring to explain it"
        assert f"### `CONVOQ_{name.upper()}`" in page
    assert set(knobs()) <= set(WorkerSettings.model_fields) - set(Settings.model_fields)


def test_the_page_says_what_a_setting_declares():
    class Example(Settings):
        tokens_per_minute: int = Field(600, ge=1, le=10_000)
        """How many tokens a minute."""

    page = config_docs.render(Example, {})
    assert "### `CONVOQ_TOKENS_PER_MINUTE`\n\nInteger; default `600`; at least 1 and at most 10000.\n\n" \
           "How many tokens a minute.\n" in page
    assert "| [`CONVOQ_TOKENS_PER_MINUTE`](#convoq_tokens_per_minute) | integer | `600` | at least 1 and at most " \
           "10000 |" in page
    assert "`CONVOQ_MAX_REQUEST_BYTES`\n\nInteger; default `8388608` (8 MiB); at least 1024." in page
    assert "One of `auto`, `none`; default `auto`." in page  # a Literal's choices


def test_the_engine_refuses_what_the_page_says_is_out_of_bounds():
    # the bounds the page states for a knob are the ones `EngineConfig` checks, edge by edge
    assert BOUNDS and CHOICES
    for name, bound in BOUNDS.items():
        for op, limit in bound.items():
            outside = {"ge": limit - 1, "gt": limit, "le": limit + 1, "lt": limit}[op]
            with pytest.raises(ValueError, match=name):
                EngineConfig(model="", **{name: outside})
    for name, choices in CHOICES.items():
        for choice in choices:
            EngineConfig(model="", **{name: choice})
        with pytest.raises(ValueError, match=f"unknown {name}"):
            EngineConfig(model="", **{name: "no-such-thing"})
    assert "### `CONVOQ_BULK_STEP_OVERHEAD`\n\nNumber; default `0.05`; greater than 0 and less than 1." \
           in config_docs.render()


def named_settings(text: str) -> set[str]:
    """The CONVOQ_ names a text mentions; `CONVOQ_MAX_SCHEMA_*` stands for every setting it begins."""
    found = set()
    for name, star in re.findall(r"\b(CONVOQ_[A-Z0-9_]*[A-Z0-9_])(\*?)", text):
        if name.endswith("_") and not star:
            continue  # the prefix itself, as in `CONVOQ_<FIELD>`
        found.add(name + star)
    return found


def real_name(name: str, settings: set[str]) -> bool:
    if name.endswith("*"):
        return any(s.startswith(name[:-1]) for s in settings)
    return name in settings or name in NOT_SETTINGS


def test_the_pages_name_only_settings_that_exist():
    settings = {f"CONVOQ_{name.upper()}" for name in WorkerSettings.model_fields}
    pages = [ROOT / "README.md", ROOT / ".env.example", ROOT / "docker-compose.yml", *sorted(DOCS.rglob("*.md"))]
    unknown = {f"{page.relative_to(ROOT)}: {name}" for page in pages for name in named_settings(page.read_text())
               if not real_name(name, settings)}
    assert unknown == set()
    assert named_settings("`CONVOQ_GONE`, CONVOQ_<FIELD>, CONVOQ_FLOWER_*") == {"CONVOQ_GONE", "CONVOQ_FLOWER_*"}
    assert not real_name("CONVOQ_GONE", settings) and real_name("CONVOQ_FLOWER_*", settings)


def test_the_readme_links_only_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)#][^)]*)\)", readme) if "://" not in link]
    assert any(link.startswith("docs/") for link in links)
    assert [link for link in links if not (ROOT / link).exists()] == []


def test_the_site_builds_strictly(tmp_path):
    # strict: a link to a missing page or anchor, a nav entry without its page or a snippet without its file
    # fails the build (a page not yet in the nav does not)
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
