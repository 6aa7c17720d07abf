"""Our Qwen3 modules against transformers: loading, one packed forward's logits, memory accounting."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.interface import Request
from engine.llm_engine import LLMEngine
from engine.model.families import read_shape
from engine.model.memory_fit import split_budget
from tests.engine_helpers import assert_packed_logits_match, greedy, make_engine, prompts, run_all

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("preset", ["tiny", "tiny-untied", "tiny-swa"])
def test_packed_forward_logits_match_transformers(tiny_models, preset):
    assert_packed_logits_match(tiny_models[preset])


def test_config_forms(tmp_path, tiny_models):
    config = json.loads((tiny_models["tiny-swa"] / "config.json").read_text())
    assert read_shape(tiny_models["tiny-swa"]).windows == (0, 0, 64, 64)
    # an older config: top-level rope_theta, no layer_types, no head_dim
    config.pop("layer_types", None)
    config.pop("rope_parameters", None)
    config.pop("head_dim")
    config.update(rope_theta=5e5, max_window_layers=1, num_attention_heads=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = read_shape(tmp_path)
    assert shape.rope_theta == 5e5
    assert shape.windows == (0, 64, 64, 64)
    assert shape.head_dim == config["hidden_size"] // 4
    config["use_sliding_window"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_shape(tmp_path).windows == (0, 0, 0, 0)


def test_weights_held_once_and_memory_report(tiny_models):
    tied = make_engine(tiny_models["tiny"])
    assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight
    untied = make_engine(tiny_models["tiny-untied"])
    assert untied.model.lm_head.weight is not untied.model.model.embed_tokens.weight
    for engine in (tied, untied):
        params = {p.data_ptr(): p.numel() * p.element_size() for p in engine.model.parameters()}
        report = engine.memory_report()
        assert sum(params.values()) <= report["weights_bytes"] < sum(params.values()) * 1.2  # + rope tables
        shape = engine.model.shape
        assert report["kv_bytes_per_token"] == 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
        assert report["pool_blocks_used"] == 0
        assert report["pool_blocks_free"] == report["pool_blocks"]
        assert report["max_tokens"] >= report["max_batch_at_max_len"] * engine.max_model_len


def test_budget_split_between_pools():
    # equal shares by layers; a pool that can never use its share hands the rest over
    assert split_budget(1000, [2, 2], [10, 10], [1000, 1000]) == [50, 50]
    assert split_budget(1000, [2, 2], [10, 10], [1000, 5]) == [95, 5]
    assert split_budget(1000, [3], [7], [10]) == [10]


def test_weights_given_in_memory_load_like_the_checkpoint_files(tiny_model):
    tensors = load_file(str(tiny_model / "model.safetensors"))
    from_files = make_engine(tiny_model)
    in_memory = LLMEngine(EngineConfig(model=str(tiny_model)), weights=tensors.items())
    requests = [Request(str(i), p, greedy(8)) for i, p in enumerate(prompts(4, 10, 60, seed=3))]
    a = run_all(from_files, requests)
    b = run_all(in_memory, [Request(r.request_id, r.prompt_ids, r.sampling) for r in requests])
    assert {k: v.token_ids for k, v in a.items()} == {k: v.token_ids for k, v in b.items()}
