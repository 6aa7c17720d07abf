"""FP8 Qwen3-MoE checkpoints (laid out as Qwen's `Qwen3-30B-A3B-FP8`: every expert's projections in fp8 with their
own 128x128 block scales, the router, norms, embedding and LM head unquantized): the experts stay fp8 in memory,
stacked with their scales, from checkpoints of experts apart or stacked, whole or by rank; one packed forward's
logits and greedy output through the real engine path equal transformers' on the same weights dequantized to
float32, on chats, under chunked prefill and pre-emption, with prefix reuse, and on two tensor-parallel ranks;
skip lists that leave experts unquantized, splits off the blocks and fp8 where the engine keeps none are
refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.experts import Fp8Experts
from engine.model.families import read_shape
from engine.model.fp8 import FP8, Fp8Linear
from engine.model.loader import load_model
from engine.model.parallel import ALONE, Split
from engine.model.shape import rank_shape
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
from tests.test_engine_fp8 import with_config
from tests.test_engine_moe import stacked_copy
from tests.test_prefix_cache import assert_reuse_gives_the_tokens_of_no_reuse

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def chat_prompts(fp8_moe_models) -> list[list[int]]:
    """Customer chats, then random token prompts of up to 250 tokens."""
    return chats(fp8_moe_models["whole"][0]) + prompts(6, 5, 250, seed=13)


@pytest.fixture(scope="module")
def new_tokens(chat_prompts) -> list[int]:
    return [4 + i % 11 for i in range(len(chat_prompts))]


@pytest.fixture(scope="module")
def hf_outputs(fp8_moe_models, chat_prompts, new_tokens) -> list[list[int]]:
    """transformers' greedy tokens on the dequantized float32 copy."""
    return transformers_greedy(fp8_moe_models["whole"][1], chat_prompts, new_tokens)


def test_the_hubs_skip_list_is_read_and_the_experts_are_fp8(fp8_moe_models):
    fp8, fp32 = fp8_moe_models["whole"]
    skip = json.loads((fp8 / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    # as Qwen3-30B-A3B-FP8 lists them: the LM head, and every layer's norms and router (layer 0's dense MLP
    # included, whose gate_proj a pattern `mlp.gate` must not take for the router)
    assert skip[:4] == ["lm_head", "model.layers.0.input_layernorm", "model.layers.0.mlp.gate",
                        "model.layers.0.post_attention_layernorm"] and len(skip) == 1 + 3 * 3
    assert read_shape(fp8).fp8 and read_shape(fp8).moe.sparse == (False, True, True)
    assert not read_shape(fp32).fp8


def test_the_experts_stay_fp8_at_a_byte_each(fp8_moe_models):
    fp8, fp32 = fp8_moe_models["whole"]
    quantized, plain = make_engine(fp8, dtype="bfloat16"), make_engine(fp32, dtype="bfloat16")
    experts = [m for m in quantized.model.modules() if isinstance(m, Fp8Experts)]
    assert len(experts) == 2 and all(m.gate_up_proj.dtype == m.down_proj.dtype == FP8 for m in experts)
    assert experts[0].gate_up_proj_scale_inv.shape == (8, 4, 2) and experts[0].down_proj_scale_inv.shape == (8, 2, 2)
    weights = 2 * 8 * 3 * 256 * 256  # two sparse layers of 8 experts of three 256x256 projections
    scales = sum(m.gate_up_proj_scale_inv.nbytes + m.down_proj_scale_inv.nbytes for m in experts)
    ours, bf16 = quantized.memory_report(), plain.memory_report()
    assert ours["expert_bytes"] == weights + scales and bf16["expert_bytes"] == 2 * weights
    projections = [m for m in quantized.model.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) == 2 * 3 + 2  # q/k/v and o of each layer, the dense layer's gate/up and down
    elements = weights + sum(m.weight.numel() for m in projections)
    overhead = scales + sum(m.weight_scale_inv.nbytes + m.scale_rows.nbytes for m in projections)
    assert ours["weights_bytes"] == bf16["weights_bytes"] - elements + overhead


def test_each_expert_keeps_its_own_scale_rows(fp8_moe_models):
    """Experts of 192 rows: each up projection starts a scale row of its own, mid-block in the weights."""
    fp8, _ = fp8_moe_models["ragged"]
    experts = make_engine(fp8).model.model.layers[2].mlp.experts
    checkpoint = load_file(fp8 / "model.safetensors")
    for e in (0, 5):
        scales = [checkpoint[f"model.layers.2.mlp.experts.{e}.{p}.weight_scale_inv"] for p in ("gate_proj", "up_proj")]
        assert [s.shape for s in scales] == [(2, 2), (2, 2)]
        assert torch.equal(experts.gate_up_proj_scale_inv[e], torch.cat(scales))
        down = checkpoint[f"model.layers.2.mlp.experts.{e}.down_proj.weight"]
        assert torch.equal(experts.down_proj[e].view(torch.uint8), down.view(torch.uint8))


@pytest.mark.parametrize("width", ["whole", "ragged"])
def test_packed_forward_logits_match_transformers(fp8_moe_models, width):
    assert_packed_logits_match(*fp8_moe_models[width])


@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "chunked-preempting"])
def test_greedy_matches_transformers(fp8_moe_models, chat_prompts, new_tokens, hf_outputs, pressure):
    fp8, _ = fp8_moe_models["whole"]
    tokens, stats = engine_greedy(fp8, chat_prompts, new_tokens, **(tight(fp8) if pressure else {}))
    assert tokens == hf_outputs and (stats.preemptions > 0 or not pressure)


def test_prefix_reuse_gives_the_tokens_of_the_dequantized_model(fp8_moe_models):
    fp8, fp32 = fp8_moe_models["whole"]
    assert_reuse_gives_the_tokens_of_no_reuse(fp8, rank_block_bytes(fp8), fp32)


def test_two_ranks_give_transformers_tokens(fp8_moe_models, chat_prompts, new_tokens, hf_outputs):
    fp8, _ = fp8_moe_models["whole"]
    tokens, stats = engine_greedy(fp8, chat_prompts, new_tokens, tensor_parallel=2, **tight(fp8, 2))
    assert tokens == hf_outputs and stats.preemptions > 0


@pytest.mark.parametrize("split", [ALONE, Split(0, 2), Split(1, 2)], ids=["whole", "rank-0-of-2", "rank-1-of-2"])
def test_a_stacked_checkpoint_loads_as_its_experts_apart(fp8_moe_models, tmp_path, split):
    """Stacked as transformers holds FP8 experts (`gate_up_proj` and `gate_up_proj_scale_inv`, ...); a rank
    reads its rows of every expert's gate and up and its columns of down, with their scales."""
    fp8, _ = fp8_moe_models["whole"]
    stacked = stacked_copy(fp8, tmp_path / "stacked")
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in load_file(stacked / "model.safetensors")
    ops = select_ops("torch", "cpu", head_dim=128)
    apart, together = (load_model(folder, torch.device("cpu"), torch.float32, ops, split=split).state_dict()
                       for folder in (fp8, stacked))
    assert together.keys() == apart.keys()
    assert all(torch.equal(together[name].view(torch.uint8), apart[name].view(torch.uint8)) for name in apart
               if apart[name].dtype == FP8)
    assert apart["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 2 * 256 // split.world, 256)
    assert apart["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (8, 4 // split.world, 2)
    assert apart["model.layers.1.mlp.experts.down_proj_scale_inv"].shape == (8, 2, 2 // split.world)


def test_a_stacked_checkpoint_off_the_blocks_is_refused_by_name(fp8_moe_models, tmp_path):
    fp8, _ = fp8_moe_models["ragged"]
    stacked = stacked_copy(fp8, tmp_path / "stacked")
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.mlp\.experts\.gate_up_proj: stacked FP8 experts of "
                                         r"width 192 share a 128-row scale block"):
        make_engine(stacked)


def test_a_split_off_the_experts_blocks_is_refused_by_name(fp8_moe_models):
    fp8, _ = fp8_moe_models["ragged"]
    with pytest.raises(ValueError, match=r"tensor_parallel=2 would split the FP8 weights off their 128x128 scale "
                                         r"blocks: the experts' gate_proj, up_proj and down_proj into parts of 96 "
                                         r"of 192 \(each rank's part"):
        make_engine(fp8, tensor_parallel=2)
    assert rank_shape(read_shape(fp8_moe_models["whole"][0]), Split(1, 2)).moe.intermediate_size == 128


@pytest.mark.parametrize(("skip", "refusal"), [
    (["lm_head", "mlp.experts"], r"leaves \['model.layers.1.mlp.experts', 'model.layers.2.mlp.experts'\] unquantized: "
                                 "the engine loads every layer's projections and experts in FP8 or none"),
    (["model.layers.2.mlp.experts.5"], r"leaves \['model.layers.2.mlp.experts.5.gate_proj', "
                                       r"'model.layers.2.mlp.experts.5.up_proj', 'model.layers.2.mlp.experts.5.down_proj'\]"),
    (["model.layers.2.mlp"], r"leaves \['model.layers.2.mlp.experts', 'model.layers.2.mlp.experts.0.gate_proj', "),
], ids=["every-experts-module", "one-expert", "one-layers-mlp"])
def test_a_skip_list_that_leaves_experts_unquantized_is_refused_by_name(fp8_moe_models, tmp_path, skip, refusal):
    folder = with_config(fp8_moe_models["whole"][0], tmp_path / "model", modules_to_not_convert=skip)
    with pytest.raises(ValueError, match=refusal):
        read_shape(folder)


def test_fp8_experts_where_the_engine_keeps_none_are_refused(fp8_moe_models, tmp_path):
    fp8, fp32 = fp8_moe_models["whole"]
    unquantized = tmp_path / "unquantized"  # an fp8 expert in a checkpoint that declares no quantization
    shutil.copytree(fp32, unquantized)
    tensors = load_file(fp32 / "model.safetensors")
    tensors["model.layers.1.mlp.experts.3.up_proj.weight"] = tensors["model.layers.1.mlp.experts.3.up_proj.weight"].to(FP8)
    save_file(tensors, unquantized / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight is torch\.float8_e4m3fn in the checkpoint, "
                                         r"but only the layers' q/k/v/o, MLP and expert projections are loaded in FP8"):
        make_engine(unquantized)
    wide = tmp_path / "wide"  # a bf16 expert in an FP8 checkpoint
    shutil.copytree(fp8, wide)
    tensors = load_file(fp8 / "model.safetensors")
    tensors["model.layers.2.mlp.experts.7.down_proj.weight"] = tensors["model.layers.2.mlp.experts.7.down_proj.weight"].bfloat16()
    save_file(tensors, wide / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.7\.down_proj\.weight is torch\.bfloat16 in the checkpoint; a "
                                         r"quantized projection's weight must be torch\.float8_e4m3fn"):
        make_engine(wide)
