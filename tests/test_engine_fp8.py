"""FP8 block-quantized checkpoints (laid out as Qwen's `*-FP8`): the projections stay fp8 in memory (half their
bf16 bytes) with each fused shard's own scales; one packed forward's logits and greedy output through the real
engine path equal transformers' on the same weights dequantized to an ordinary float32 checkpoint, under chunked
prefill and pre-emption, with prefix reuse, and on two tensor-parallel ranks; a split off the 128-blocks and
every quantization the engine does not implement are refused by name."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.families import read_shape
from engine.model.fp8 import FP8, Fp8Linear
from engine.model.parallel import Split
from engine.model.shape import rank_shape
from tests.engine_helpers import (
    assert_packed_logits_match,
    engine_greedy,
    make_engine,
    prompts,
    rank_block_bytes,
    tight,
    transformers_greedy,
)
from tests.test_prefix_cache import assert_reuse_gives_the_tokens_of_no_reuse

pytestmark = pytest.mark.usefixtures("single_thread")

PRESETS = ("tiny-blocks", "tiny-blocks-ragged")
PROMPTS = prompts(12, 5, 250, seed=11)
NEW_TOKENS = [4 + i % 9 for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def hf_outputs(fp8_models) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens on each preset's dequantized float32 copy."""
    return {preset: transformers_greedy(fp32, PROMPTS, NEW_TOKENS) for preset, (_, fp32) in fp8_models.items()}


def test_the_projections_stay_fp8_in_half_the_bytes_of_bf16(fp8_models):
    fp8, fp32 = fp8_models["tiny-blocks"]
    quantized = make_engine(fp8, dtype="bfloat16")
    plain = make_engine(fp32, dtype="bfloat16")
    projections = [m for m in quantized.model.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) == 4 * 2 and all(m.weight.dtype == FP8 for m in projections)  # 4 a layer, 2 layers
    elements = sum(m.weight.numel() for m in projections)
    scales = sum(m.weight_scale_inv.nbytes + m.scale_rows.nbytes for m in projections)
    ours, bf16 = quantized.memory_report()["weights_bytes"], plain.memory_report()["weights_bytes"]
    assert ours == bf16 - elements + scales  # a byte instead of two for each projection weight, plus the scales
    assert (elements + scales) / (2 * elements) < 0.51


def test_each_shard_keeps_its_own_scale_rows(fp8_models):
    """64-row K and V projections and an MLP of 4.5 blocks: every fused shard starts a scale row of its own."""
    fp8, _ = fp8_models["tiny-blocks-ragged"]
    attention = make_engine(fp8).model.model.layers[1].self_attn
    checkpoint = load_file(fp8 / "model.safetensors")
    scales = [checkpoint[f"model.layers.1.self_attn.{p}_proj.weight_scale_inv"] for p in "qkv"]
    assert [s.shape[0] for s in scales] == [2, 1, 1]
    assert torch.equal(attention.qkv_proj.weight_scale_inv, torch.cat(scales))
    assert attention.qkv_proj.scale_rows.tolist() == [0] * 128 + [1] * 128 + [2] * 64 + [3] * 64
    gate_up = make_engine(fp8).model.model.layers[0].mlp.gate_up_proj
    assert gate_up.scale_rows.tolist() == [r // 128 for r in range(576)] + [5 + r // 128 for r in range(576)]


@pytest.mark.parametrize("preset", PRESETS)
def test_packed_forward_logits_match_transformers(fp8_models, preset):
    assert_packed_logits_match(*fp8_models[preset])


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "chunked-preempting"])
def test_greedy_matches_transformers(fp8_models, hf_outputs, preset, pressure):
    fp8, _ = fp8_models[preset]
    tokens, stats = engine_greedy(fp8, PROMPTS, NEW_TOKENS, **(tight(fp8) if pressure else {}))
    assert tokens == hf_outputs[preset] and (stats.preemptions > 0 or not pressure)


def test_prefix_reuse_gives_the_tokens_of_the_dequantized_model(fp8_models):
    fp8, fp32 = fp8_models["tiny-blocks"]
    assert_reuse_gives_the_tokens_of_no_reuse(fp8, rank_block_bytes(fp8), fp32)


def test_two_ranks_give_transformers_tokens(fp8_models, hf_outputs):
    fp8, _ = fp8_models["tiny-blocks"]
    tokens, stats = engine_greedy(fp8, PROMPTS, NEW_TOKENS, tensor_parallel=2, **tight(fp8, 2))
    assert tokens == hf_outputs["tiny-blocks"] and stats.preemptions > 0


def test_a_split_off_the_scale_blocks_is_refused_by_name(fp8_models):
    fp8, _ = fp8_models["tiny-blocks-ragged"]
    # an MLP of 576 rows: 288 a rank would cut its third block
    with pytest.raises(ValueError, match=r"tensor_parallel=2 would split the FP8 weights off their 128x128 scale "
                                         r"blocks: gate_proj, up_proj and down_proj into parts of 288 of 576"):
        make_engine(fp8, tensor_parallel=2)
    two_kv_heads = replace(read_shape(fp8), num_kv_heads=2, intermediate_size=512)
    with pytest.raises(ValueError, match=r"k_proj and v_proj into parts of 64 of 128 \(each rank's part must be a "
                                         r"multiple of 128\)"):
        rank_shape(two_kv_heads, Split(0, 2))
    assert rank_shape(replace(two_kv_heads, fp8=False), Split(0, 2)).num_kv_heads == 1  # only FP8 is bound to blocks
    # one 64-row KV head, held whole by each rank: nothing is cut
    assert rank_shape(replace(read_shape(fp8), intermediate_size=512), Split(1, 2)).num_kv_heads == 1


def with_config(source: Path, folder: Path, **quantization) -> Path:
    """A copy of the FP8 checkpoint `source` whose quantization_config is changed by `quantization` (a value of
    None removes its key)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    quant = {**config["quantization_config"], **quantization}
    config["quantization_config"] = {key: value for key, value in quant.items() if value is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("change", "refusal"), [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported; only 'fp8'"),
    ({"fmt": "e5m2"}, "fmt 'e5m2' is not supported; the engine implements 'e4m3'"),
    ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\] is not supported; the engine implements \[128, 128\]"),
    ({"weight_block_size": None}, "weight_block_size None is not supported"),  # per-tensor scales
    ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported; the engine implements 'dynamic'"),
    ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0' is not supported"),
    ({"kv_cache_scheme": {"num_bits": 8}}, r"quantization_config keys \['kv_cache_scheme'\] are not supported"),
    ({"modules_to_not_convert": ["lm_head", "model.layers.1.mlp"]},
     r"leaves \['model.layers.1.mlp.gate_proj', 'model.layers.1.mlp.up_proj', 'model.layers.1.mlp.down_proj'\] "
     "unquantized"),
    ({"ignored_layers": ["o_proj"]}, r"leaves \['model.layers.0.self_attn.o_proj', 'model.layers.1.self_attn.o_proj'\]"),
], ids=["method", "format", "block", "per-tensor", "static-activations", "scale-format", "unknown-key",
        "unquantized-mlp", "unquantized-o-proj"])
def test_a_quantization_the_engine_does_not_implement_is_refused_by_name(fp8_models, tmp_path, change, refusal):
    folder = with_config(fp8_models["tiny-blocks"][0], tmp_path / "model", **change)
    with pytest.raises(ValueError, match=refusal):
        read_shape(folder)


def test_what_transformers_writes_with_its_defaults_is_read(fp8_models, tmp_path):
    """`FineGrainedFP8Config` saves every option, defaults included; a skip list may name what is never
    quantized (norms, the embedding, the LM head, a MoE router)."""
    folder = with_config(fp8_models["tiny-blocks"][0], tmp_path / "model", fmt=None, dequantize=False,
                         modules_to_convert=None, scale_fmt="float", expert_dtype="fp8",
                         modules_to_not_convert=["lm_head", "model.embed_tokens", "model.layers.0.input_layernorm",
                                                 "mlp.gate"])
    assert read_shape(folder).fp8 and not read_shape(fp8_models["tiny-blocks"][1]).fp8


def test_an_fp8_tensor_where_the_engine_keeps_no_scales_is_refused(fp8_models, tmp_path):
    fp8, _ = fp8_models["tiny-blocks-ragged"]
    folder = tmp_path / "model"
    shutil.copytree(fp8, folder)
    tensors = load_file(fp8 / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].float().to(FP8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"lm_head\.weight is torch\.float8_e4m3fn in the checkpoint, but only"):
        make_engine(folder)
    tensors["lm_head.weight"] = load_file(fp8 / "model.safetensors")["lm_head.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"].bfloat16()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj\.weight is torch\.bfloat16 in the checkpoint; a quantized "
                                         r"projection's weight must be torch\.float8_e4m3fn"):
        make_engine(folder)


def test_the_cli_writes_an_fp8_checkpoint_the_engine_runs_as_the_fixtures(fp8_models, tmp_path):
    """`convoq tiny-model --fp8` writes what the tests' FP8 checkpoints are: the same seed gives the same
    quantized weights, which the engine loads and runs."""
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "fp8"), "--preset", "tiny-blocks", "--fp8"])
    assert result.exit_code == 0, result.output
    written = tmp_path / "fp8"
    assert result.output.strip().endswith(str(written))
    assert json.loads((written / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    ours, fixture = load_file(written / "model.safetensors"), load_file(fp8_models["tiny-blocks"][0] / "model.safetensors")
    assert ours.keys() == fixture.keys() and all(torch.equal(ours[k], fixture[k]) for k in ours)
    assert any(t.dtype == FP8 for t in ours.values())
    tokens, _ = engine_greedy(written, PROMPTS[:2], NEW_TOKENS[:2])
    assert tokens == engine_greedy(fp8_models["tiny-blocks"][0], PROMPTS[:2], NEW_TOKENS[:2])[0]
