"""Qwen3-MoE (`tiny-moe`: 8 experts, 2 a token renormalized, a dense first layer), loaded from a checkpoint
transformers wrote: which layers are sparse and how tokens are routed read as transformers reads them; one packed
forward's logits and greedy output through the real engine path equal transformers' on chats, under chunked
prefill and pre-emption, with prefix reuse, and on two tensor-parallel ranks; a checkpoint of stacked experts
loads as one of experts apart, whole or by rank; the memory plan counts every expert; and fields of other
mixture-of-experts designs are refused by name."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeModel,
    Qwen3MoeSparseMoeBlock,
    Qwen3MoeTopKRouter,
)

from engine.model.families import read_shape
from engine.model.fp8 import MLP_PROJECTIONS
from engine.model.loader import load_model
from engine.model.moe import Router
from engine.model.parallel import ALONE, Split
from engine.model.shape import MoEShape, rank_shape
from kernels.dispatch import select_ops
from tests.engine_helpers import (
    assert_packed_logits_match,
    chats,
    engine_greedy,
    make_engine,
    prompts,
    rank_block_bytes,
    tight,
    transformers_greedy,
)
from tests.test_engine_rope_scaling import _config_folder
from tests.test_prefix_cache import assert_reuse_gives_the_tokens_of_no_reuse

pytestmark = pytest.mark.usefixtures("single_thread")

@pytest.fixture(scope="module")
def moe_model(tiny_models) -> Path:
    return tiny_models["tiny-moe"]


@pytest.fixture(scope="module")
def chat_prompts(moe_model) -> list[list[int]]:
    """Customer chats, then random token prompts of up to 300 tokens."""
    return chats(moe_model) + prompts(8, 5, 300, seed=7)


@pytest.fixture(scope="module")
def new_tokens(chat_prompts) -> list[int]:
    return [4 + i % 11 for i in range(len(chat_prompts))]


@pytest.fixture(scope="module")
def hf_outputs(moe_model, chat_prompts, new_tokens) -> list[list[int]]:
    return transformers_greedy(moe_model, chat_prompts, new_tokens)


def test_the_preset_reads_its_experts(moe_model):
    shape = read_shape(moe_model)
    assert shape.family == "qwen3_moe" and shape.qk_norm and not shape.qkv_bias
    assert shape.moe == MoEShape(num_experts=8, top_k=2, intermediate_size=256, norm_topk_prob=True,
                                 sparse=(False, True, True, True))


SPARSITY = {"default": {}, "every-second": {"decoder_sparse_step": 2},
            "every-third-but-2": {"decoder_sparse_step": 3, "mlp_only_layers": [2]},
            "all-dense": {"mlp_only_layers": [0, 1, 2, 3]}, "no-experts": {"num_local_experts": 0},
            "hub-name": {"num_local_experts": None, "num_experts": 8, "mlp_only_layers": [1]}}


@pytest.mark.parametrize("edits", SPARSITY.values(), ids=SPARSITY.keys())
def test_sparse_layers_are_those_transformers_builds(moe_model, tmp_path, edits):
    folder = _config_folder(tmp_path, moe_model, **edits)
    layers = Qwen3MoeModel(AutoConfig.from_pretrained(folder)).layers
    shape = read_shape(folder)
    assert [shape.sparse(i) for i in range(shape.num_layers)] == [
        isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_transformers(dtype, renormalize):
    config = Qwen3MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=renormalize)
    theirs = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(theirs.weight, std=0.3)
    ours = Router(64, MoEShape(16, 4, 32, renormalize, (True,)))
    ours.weight.data.copy_(theirs.weight)
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        _, expected_weights, expected_ids = theirs.to(dtype)(x)
        weights, ids = ours.to(dtype)(x)
    assert torch.equal(ids, expected_ids)
    assert weights.dtype == dtype and torch.equal(weights, expected_weights)
    assert torch.allclose(weights.float().sum(-1), torch.ones(300), atol=1e-2) == renormalize


def test_packed_forward_logits_match_transformers(moe_model):
    assert_packed_logits_match(moe_model)


@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "chunked-preempting"])
def test_greedy_matches_transformers(moe_model, chat_prompts, new_tokens, hf_outputs, pressure):
    tokens, stats = engine_greedy(moe_model, chat_prompts, new_tokens, **(tight(moe_model) if pressure else {}))
    assert tokens == hf_outputs and (stats.preemptions > 0 or not pressure)


def test_prefix_reuse_gives_the_tokens_of_no_reuse(moe_model):
    assert_reuse_gives_the_tokens_of_no_reuse(moe_model, rank_block_bytes(moe_model))


def test_two_ranks_give_transformers_tokens(moe_model, chat_prompts, new_tokens, hf_outputs):
    tokens, _ = engine_greedy(moe_model, chat_prompts, new_tokens, tensor_parallel=2, **tight(moe_model, 2))
    assert tokens == hf_outputs


def test_ranks_that_cannot_split_an_expert_are_refused_with_its_width(moe_model, tmp_path):
    shape = read_shape(_config_folder(tmp_path, moe_model, moe_intermediate_size=250))
    with pytest.raises(ValueError, match=r"tensor_parallel=4 does not divide its expert width 250$"):
        rank_shape(shape, Split(0, 4))
    assert rank_shape(shape, Split(0, 2)).moe.intermediate_size == 125
    all_sparse = replace(shape, intermediate_size=251, moe=replace(shape.moe, sparse=(True,) * 4))
    assert rank_shape(all_sparse, Split(0, 2)).num_heads == 4  # no layer is dense: its odd MLP width is unused


def stacked_copy(folder: Path, to: Path) -> Path:
    """`folder`'s checkpoint with each layer's experts stacked as transformers holds them in memory (an FP8
    checkpoint's scales stacked alike, under transformers' names)."""
    to.mkdir()
    for file in folder.iterdir():
        if file.suffix != ".safetensors":
            (to / file.name).symlink_to(file)
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    layers = sorted({name.split(".experts.")[0] for name in tensors if ".experts." in name})
    for layer, (leaf, suffix) in itertools.product(layers, (("weight", ""), ("weight_scale_inv", "_scale_inv"))):
        count = sum(1 for name in tensors if name.startswith(f"{layer}.experts.") and name.endswith(f"down_proj.{leaf}"))
        experts = [{proj: tensors.pop(f"{layer}.experts.{e}.{proj}.{leaf}") for proj in MLP_PROJECTIONS}
                   for e in range(count)]
        if experts:
            tensors[f"{layer}.experts.gate_up_proj{suffix}"] = torch.stack([torch.cat([e["gate_proj"], e["up_proj"]])
                                                                            for e in experts])
            tensors[f"{layer}.experts.down_proj{suffix}"] = torch.stack([e["down_proj"] for e in experts])
    save_file(tensors, to / "model.safetensors")
    return to


@pytest.mark.parametrize("split", [ALONE, Split(0, 2), Split(1, 2)], ids=["whole", "rank-0-of-2", "rank-1-of-2"])
def test_a_stacked_checkpoint_loads_as_its_experts_apart(moe_model, tmp_path, split):
    stacked = stacked_copy(moe_model, tmp_path / "stacked")
    ops = select_ops("torch", "cpu", head_dim=32)
    apart, together = (load_model(folder, torch.device("cpu"), torch.float32, ops, split=split).state_dict()
                       for folder in (moe_model, stacked))
    assert together.keys() == apart.keys() and any(".experts." in name for name in apart)
    assert all(torch.equal(together[name], apart[name]) for name in apart)
    experts = apart["model.layers.1.mlp.experts.gate_up_proj"]
    assert experts.shape == (8, 2 * 256 // split.world, 256)


def test_the_memory_plan_counts_every_expert_and_each_layers_kv(moe_model):
    report = make_engine(moe_model).memory_report()
    with safe_open(moe_model / "model.safetensors", framework="pt") as f:
        checkpoint = sum(f.get_tensor(name).nbytes for name in f.keys())  # noqa: SIM118 (safe_open is not a dict)
    assert report["expert_bytes"] == 3 * 8 * 3 * 256 * 256 * 4  # three sparse layers of 8 experts, fp32
    assert checkpoint <= report["weights_bytes"] < checkpoint * 1.05  # and the rope tables
    assert report["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 4  # every layer attends: 2 KV heads of 32, fp32


REFUSALS = {
    "shared-expert": ({"shared_expert_intermediate_size": 512},
                      r"\['shared_expert_intermediate_size'\] are not supported"),
    "scaled-and-sigmoid": ({"routed_scaling_factor": 2.5, "scoring_func": "sigmoid"},
                           r"\['routed_scaling_factor', 'scoring_func'\] are not supported"),
    "grouped": ({"n_group": 8, "topk_group": 4}, r"\['n_group', 'topk_group'\] are not supported"),
    "sparse-step": ({"decoder_sparse_step": 0}, "decoder_sparse_step 0 is not supported"),
    "top-k": ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is not supported with 8 experts"),
    "attention_bias": ({"attention_bias": True}, "attention_bias: true is not supported"),
}


@pytest.mark.parametrize(("edits", "message"), REFUSALS.values(), ids=REFUSALS.keys())
def test_fields_the_experts_do_not_implement_are_refused_by_name(moe_model, tmp_path, edits, message):
    with pytest.raises(ValueError, match=message):
        read_shape(_config_folder(tmp_path, moe_model, **edits))


def test_the_other_designs_fields_at_qwen3_moe_s_values_load(moe_model, tmp_path):
    folder = _config_folder(tmp_path, moe_model, routed_scaling_factor=1.0, scoring_func="softmax",
                            shared_expert_intermediate_size=0)
    assert read_shape(folder) == read_shape(moe_model)
