"""The OpenAPI document is a contract clients can trust: `schemathesis run --checks all` against the running
API (uvicorn, real PostgreSQL and Redis), once with each of two tenants' keys, finds no failure and no 5xx:
every status code and content type it meets is documented, every body matches its schema, valid-by-schema
requests are accepted and invalid ones refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from cli.stack import Stack
from cli.tiny_model import build_tiny_model
from jobs.schemas import JobIn, Message

CONFIG = Path(__file__).with_name("schemathesis.toml")
TENANT_KEYS = {"shop": "shop-key-0123456789", "bank": "bank-key-0123456789"}
EXAMPLES_PER_OPERATION = 40  # per tenant; with ~22 operations and every phase, about 1,500 cases per tenant
ROOT = Path(__file__).resolve().parent.parent


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("message", [
    {"role": "tool"}, {"role": "tool", "content": "4"}, {"role": "tool", "content": "4", "tool_call_id": "c1"},
    {"role": "user"}, {"role": "user", "content": "hi"}, {"role": "user", "content": "hi", "tool_call_id": "c1"},
    {"role": "system", "content": "be brief", "tool_calls": [CALL]}, {"role": "assistant"},
    {"role": "assistant", "content": "ok"}, {"role": "assistant", "tool_calls": [CALL]},
    {"role": "assistant", "tool_calls": []}, {"role": "assistant", "content": "ok", "tool_call_id": "c1"}])
def test_the_document_says_which_fields_each_role_needs(message):
    """What the job refuses for its role, the OpenAPI document refuses too: a request valid by the document is
    not refused for it."""
    by_document = not list(jsonschema.Draft202012Validator(JobIn.model_json_schema()).iter_errors(
        {"messages": [message]}))
    try:
        Message.model_validate(message)
        by_model = True
    except ValidationError:
        by_model = False
    assert by_document == by_model


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    """The tiny model with Qwen3's context (40,960 positions), so that what the schema allows (up to 4,096 new
    tokens) fits, as it does on a real Qwen3."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-long", max_position_embeddings=40960)


def schemathesis(url: str, key: str, workdir: Path) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(CONFIG), "run",
               f"{url}/openapi.json", "--checks", "all",
               "-H", f"Authorization: Bearer {key}", "--max-examples", str(EXAMPLES_PER_OPERATION), "--seed", "17",
               "--phases", "examples,coverage,fuzzing", "--workers", "1", "--no-color",
               "--report", "junit", "--report-junit-path", str(workdir / "junit.xml")]
    # run in `workdir`: schemathesis keeps a cache of its own in the working directory; its hooks are imported
    # from this checkout
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=workdir,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_schemathesis_finds_no_failure_for_either_tenant(service_env, long_context_model, tmp_path):
    keys = ",".join(f"{key}@{tenant}" for tenant, key in TENANT_KEYS.items())
    env = {**service_env, "CONVOQ_MODEL": str(long_context_model), "CONVOQ_API_KEYS": keys,
           # schemathesis sends wrong keys on purpose (ignored_auth): past the failed-auth bound they get the 429
           # the document names (the hooks take it for a refusal); the valid keys are never limited by it
           "CONVOQ_RATE_LIMIT_PER_S": "100000",
           "CONVOQ_RATE_LIMIT_BURST": "1000000"}
    cases = 0
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        for tenant, key in TENANT_KEYS.items():
            workdir = tmp_path / tenant
            workdir.mkdir()
            run = schemathesis(stack.api_url, key, workdir)
            summary = run.stdout[-6000:]
            assert run.returncode == 0, summary
            # every generated case passed every check: no failure, no 5xx
            counted = re.search(r"([\d,]+) generated, ([\d,]+) passed", run.stdout)
            assert counted is not None and counted[1] == counted[2], summary
            cases += int(counted[1].replace(",", ""))
    assert cases >= 1500, cases
