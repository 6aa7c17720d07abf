"""The documentation cannot drift from the code: the configuration reference is what the settings generate."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from cli import config_docs
from engine.builder import knobs
from engine.config import BOUNDS, CHOICES, EngineConfig
from jobs.settings import Settings
from worker.engine_factory import WorkerSettings

DOCS = Path(__file__).resolve().parent.parent / "docs"


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
