"""`CONVOQ_MODEL` as a hub id, offline: resolved from a Hugging Face cache for the worker's backends and the API."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from engine.interface import Request, SamplingParams
from engine.runtime.engine_thread import EngineThread
from jobs.model_source import ModelNotFound, resolve_model
from jobs.settings import Settings
from tests.api_keys import API_KEY, AUTH
from worker.engine_factory import WorkerSettings, load_backend

REPO = "Owner/Name"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path, repo: str, source: Path, weights: bool = True) -> Path:
    """`source`'s files as `hf download` lays a repo out in `cache` (copies, not symlinks to blobs); the
    snapshot folder."""
    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        if weights or file.suffix != ".safetensors":
            shutil.copy(file, snapshot)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """HF_HOME, offline, set only now: huggingface_hub may have read other values when it was imported."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


@pytest.fixture
def snapshot(hf_home, tiny_model) -> Path:
    return fill_cache(hf_home / "hub", REPO, tiny_model)


def test_a_hub_id_resolves_to_its_cached_snapshot(snapshot, tiny_model):
    assert resolve_model(REPO) == snapshot
    assert resolve_model(REPO, weights=False) == snapshot
    assert resolve_model(str(tiny_model)) == tiny_model  # a folder stays as it is


def test_hf_hub_cache_wins_over_hf_home(tmp_path, monkeypatch, hf_home, tiny_model):
    snapshot = fill_cache(tmp_path / "elsewhere", REPO, tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert resolve_model(REPO) == snapshot


def test_our_engine_loads_a_hub_id_and_generates(snapshot):
    settings = WorkerSettings(model=REPO, device="cpu")
    engine = load_backend(settings)
    assert engine.config.model == str(snapshot)
    thread = EngineThread(engine)
    try:
        prompt = engine.tokenizer.encode("where is my parcel")
        done = thread.submit(Request("r", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))).result(60)
    finally:
        thread.close()
    assert done.ok and len(done.token_ids) == 4


seen: list[str] = []


def recording_backend(model: str, device: str, dtype: str) -> object:
    seen.append(model)
    return object()


def test_the_other_backends_get_the_folder_too(snapshot):
    seen.clear()
    load_backend(WorkerSettings(model=REPO, device="cpu", backend=f"{__name__}:recording_backend"))
    assert seen == [str(snapshot)]
    hf = load_backend(WorkerSettings(model=REPO, device="cpu", backend="hf"))
    assert hf.max_model_len == 1024


def test_the_api_checks_prompts_against_a_hub_id_without_its_weights(hf_home, tiny_model, database, broker):
    fill_cache(hf_home / "hub", REPO, tiny_model, weights=False)
    settings = Settings(database_url=database, broker_url=broker, api_keys=API_KEY, model=REPO)
    with TestClient(create_app(settings)) as client:
        assert client.app.state.prompt_check.context == 1024  # the tokenizer and config came from the cache
        r = client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "Where is my parcel?"}]},
                        headers=AUTH)
        assert r.status_code == 202, r.text
        too_long = {"messages": [{"role": "user", "content": "refund " * 1200}]}
        r = client.post("/v1/jobs", json=too_long, headers=AUTH)
        assert r.status_code == 422 and "context" in r.text


def test_a_hub_id_missing_from_the_offline_cache_says_where_it_looked_and_what_to_do(hf_home):
    with pytest.raises(ModelNotFound) as caught:
        resolve_model("Qwen/Qwen3-8B")
    message = str(caught.value)
    assert "Qwen/Qwen3-8B" in message and str(hf_home / "hub") in message
    assert "hf download Qwen/Qwen3-8B" in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ModelNotFound, match="Qwen/Qwen3-8B"):
        load_backend(WorkerSettings(model="Qwen/Qwen3-8B", device="cpu"))


@pytest.mark.parametrize("name", ["not a model", "models/../tiny", "a/b/c", "gpt2"])
def test_a_name_that_is_neither_a_folder_nor_a_hub_id_says_so(hf_home, name):
    with pytest.raises(ModelNotFound, match="neither an existing folder nor a Hugging Face hub id"):
        resolve_model(name)
