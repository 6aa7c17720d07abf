"""YaRN rope scaling against transformers (tables, kernels, greedy tokens), and the config.json fields the engine
refuses rather than silently computing something else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from cli.tiny_model import build_tiny_model
from engine.interface import Request
from engine.model.families import read_shape
from kernels import qk_norm_rope, torch_ops
from kernels.qk_norm_rope import rope_tables
from tests.conftest import QWEN3_TOKENIZER
from tests.engine_helpers import greedy, make_engine, prompts, run_all
from tests.test_kernels_support import assert_close, interpret_kernels

pytestmark = pytest.mark.usefixtures("single_thread")

interpreted_kernels = interpret_kernels(qk_norm_rope)

# Qwen3's documented recipe, shrunk: 4x past an original context that every prompt below outruns
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
NEW_TOKENS = 8
# prompts prefilled 96 tokens at a time, so positions past 256 arrive chunk by chunk
CHUNKED = {"prefill_chunk_size": 96, "max_num_batched_tokens": 128, "max_num_seqs": 8}

_TEXT = ("My order #{n} arrived with a damaged box and the charger is missing. I called support on Monday, "
         "was promised a replacement within a week, and nothing came. Could you check the tracking number, "
         "refund the express shipping fee and tell me when the new package will ship? ")


def _without_scaling(path: Path, dest: Path) -> Path:
    """A copy of the checkpoint with the same weights and the rope scaling taken out."""
    shutil.copytree(path, dest)
    config = json.loads((dest / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def yarn_cases(tmp_path_factory) -> dict[str, tuple[Path, Path, list[list[int]]]]:
    """Per case: the YaRN checkpoint, its unscaled copy, and prompts that all run past 256 positions."""
    root = tmp_path_factory.mktemp("yarn")
    tiny = build_tiny_model(root / "tiny", preset="tiny", seed=3, rope_scaling=YARN)
    qwen3 = build_tiny_model(root / "qwen3", preset="qwen3-small", tokenizer=QWEN3_TOKENIZER,
                             max_position_embeddings=1024, rope_scaling=YARN)
    tok = AutoTokenizer.from_pretrained(qwen3)
    messages = [[{"role": "user", "content": "".join(_TEXT.format(n=n + i) for i in range(k))}]
                for n, k in ((17, 6), (4021, 9))]
    chats = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    cases = {"tiny": (tiny, prompts(3, 300, 700, seed=11)), "qwen3": (qwen3, [tok(c)["input_ids"] for c in chats])}
    out = {}
    for name, (path, ids) in cases.items():
        assert all(len(p) > YARN["original_max_position_embeddings"] + 50 for p in ids)
        out[name] = (path, _without_scaling(path, root / f"{name}-unscaled"), ids)
    return out


def _hf_greedy(path: Path, ids: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for prompt in ids:
        with torch.inference_mode():
            generated = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)).long(),
                                       max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=sorted(eos),
                                       pad_token_id=0)
        row = generated[0, len(prompt):].tolist()
        rows.append(row[: next((i for i, t in enumerate(row) if t in eos), len(row))])
    return rows


def _engine_greedy(path: Path, ids: list[list[int]], **settings) -> list[list[int]]:
    engine = make_engine(path, dtype="float32", **settings)
    done = run_all(engine, [Request(str(i), p, greedy(NEW_TOKENS, ignore_eos=False)) for i, p in enumerate(ids)])
    return [done[str(i)].token_ids for i in range(len(ids))]


@pytest.fixture(scope="module")
def hf_outputs(yarn_cases) -> dict[str, list[list[int]]]:
    return {name: _hf_greedy(path, ids) for name, (path, _, ids) in yarn_cases.items()}


@pytest.mark.parametrize("settings", [{}, CHUNKED], ids=["whole-prompts", "chunked-prefill"])
@pytest.mark.parametrize("case", ["tiny", "qwen3"])
def test_yarn_greedy_matches_transformers(yarn_cases, hf_outputs, case, settings):
    path, _, ids = yarn_cases[case]
    assert read_shape(path).yarn is not None
    assert _engine_greedy(path, ids, **settings) == hf_outputs[case]


@pytest.mark.parametrize("case", ["tiny", "qwen3"])
def test_ignoring_yarn_would_change_every_answer(yarn_cases, hf_outputs, case):
    """The control: on the same weights without the scaling, no prompt gets transformers' YaRN answer, so an
    engine that dropped the scaling could not pass the test above."""
    _, unscaled, ids = yarn_cases[case]
    plain = _engine_greedy(unscaled, ids)
    assert all(a != b for a, b in zip(plain, hf_outputs[case], strict=True))
    shape = read_shape(yarn_cases[case][0])
    scaled_cos, _ = rope_tables(shape.max_position_embeddings, shape.head_dim, shape.rope_theta, yarn=shape.yarn)
    plain_cos, _ = rope_tables(shape.max_position_embeddings, shape.head_dim, shape.rope_theta)
    assert (scaled_cos - plain_cos).abs().max() > 0.5


def _config_folder(tmp_path: Path, base: Path, **edits) -> Path:
    """`base`'s checkpoint with config.json edited (a `None` edit removes the key); the other files linked."""
    folder = tmp_path / "model"
    folder.mkdir()
    for file in base.iterdir():
        if file.name != "config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((base / "config.json").read_text())
    for key, value in edits.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _yarn(factor: float | None, original: int | None = None, **options) -> dict:
    """A YaRN rope dict; without `original`, it has no original_max_position_embeddings at all."""
    if original is not None:
        options["original_max_position_embeddings"] = original
    return {"rope_type": "yarn", "factor": factor, **options}


# Each spelling of the rope config a checkpoint may carry, with each YaRN option transformers reads.
TABLE_CASES = {
    "default": {},
    "v5-rope_parameters": {"rope_parameters": _yarn(4.0, 256, rope_theta=1e6)},
    "legacy-type-key": {"rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 256}},
    "rope_scaling-wins": {"rope_scaling": _yarn(2.0, 512), "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 1e6}},
    "betas-untruncated": {"rope_scaling": _yarn(4.0, 256, beta_fast=16, beta_slow=2, truncate=False)},
    "attention_factor": {"rope_scaling": _yarn(4.0, 256, attention_factor=1.3)},
    "mscale": {"rope_scaling": _yarn(8.0, 128, mscale=1.0, mscale_all_dim=0.5)},
    "factor-from-lengths": {"rope_scaling": _yarn(None, 128)},
    "original-defaults-to-max": {"rope_scaling": _yarn(4.0)},
    "top-level-original": {"original_max_position_embeddings": 128, "rope_scaling": _yarn(4.0, 256)},
}


@pytest.mark.parametrize("edits", TABLE_CASES.values(), ids=TABLE_CASES.keys())
def test_rope_tables_match_transformers_rotary_embedding(tmp_path, tiny_model, edits):
    folder = _config_folder(tmp_path, tiny_model, **edits)
    shape = read_shape(folder)
    cos, sin = rope_tables(shape.max_position_embeddings, shape.head_dim, shape.rope_theta, yarn=shape.yarn)
    rotary = Qwen3RotaryEmbedding(AutoConfig.from_pretrained(folder))
    positions = torch.arange(shape.max_position_embeddings)[None]
    hf_cos, hf_sin = (t[0] for t in rotary(torch.zeros(1, dtype=torch.float32), positions))
    half = shape.head_dim // 2
    assert torch.equal(hf_cos[:, :half], hf_cos[:, half:])
    # transformers forms its angles in float32 (ours in float64): at position ~1000 that is ~1e-4 of error
    torch.testing.assert_close(cos, hf_cos[:, :half], atol=3e-4, rtol=0)
    torch.testing.assert_close(sin, hf_sin[:, :half], atol=3e-4, rtol=0)
    # the two halves of the formula, tight: position 1's angle is the frequency, position 0's cos the factor
    torch.testing.assert_close(torch.atan2(sin[1], cos[1]).double(), rotary.inv_freq.double(), atol=0, rtol=1e-6)
    assert cos[0, 0].item() == pytest.approx(rotary.attention_scaling, rel=1e-6)
    assert (shape.yarn is None) == (edits == {})


KERNELS = {"reference": qk_norm_rope.qk_norm_rope_ref, "torch": torch_ops.qk_norm_rope,
           "triton": qk_norm_rope.qk_norm_rope}


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
def test_every_kernel_applies_the_attention_factor(yarn_cases, kernel):
    """Each q/k-norm + RoPE implementation, given YaRN tables, equals transformers' norm then rotation."""
    path = yarn_cases["tiny"][0]
    shape = read_shape(path)
    assert shape.yarn.attention_factor > 1.1
    cos, sin = rope_tables(shape.max_position_embeddings, shape.head_dim, shape.rope_theta, yarn=shape.yarn)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, shape.head_dim, generator=gen), torch.randn(5, 2, shape.head_dim, generator=gen)
    q_weight, k_weight = torch.randn(shape.head_dim, generator=gen), torch.randn(shape.head_dim, generator=gen)
    positions = torch.tensor([0, 255, 256, 700, 1023])
    ours = kernel(q, k, q_weight, k_weight, cos, sin, positions, 1e-6)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        module = Qwen3RMSNorm(shape.head_dim, 1e-6)
        module.weight.data.copy_(weight)
        return module(x)

    rotary = Qwen3RotaryEmbedding(AutoConfig.from_pretrained(path))
    hf_cos, hf_sin = (t[0] for t in rotary(q, positions[None]))
    expected = apply_rotary_pos_emb(norm(q, q_weight), norm(k, k_weight), hf_cos, hf_sin, unsqueeze_dim=1)
    for actual, reference in zip(ours, expected, strict=True):
        assert_close(actual, reference)


ROPE_TYPE_REFUSALS = {
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "dynamic": {"rope_scaling": {"type": "dynamic", "factor": 2.0}},  # the legacy key
    "longrope": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 16,
                                     "long_factor": [2.0] * 16, "original_max_position_embeddings": 256}},
    "made-up": {"rope_scaling": {"rope_type": "made-up", "factor": 2.0}},
}


@pytest.mark.parametrize(("rope_type", "edits"), ROPE_TYPE_REFUSALS.items(), ids=ROPE_TYPE_REFUSALS.keys())
def test_unimplemented_rope_types_are_refused_at_load(tmp_path, tiny_model, rope_type, edits):
    folder = _config_folder(tmp_path, tiny_model, **edits)
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported; supported rope types are "
                                         "default, yarn, llama3"):
        make_engine(folder)


FIELD_REFUSALS = {
    "attention_bias": ({"attention_bias": True}, "attention_bias: true is not supported"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; only 'silu'"),
    "partial_rotary_factor": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    "partial_rotary_factor-in-rope": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.25}},
                                      "partial_rotary_factor 0.25 is not supported"),
    "unknown-rope-key": ({"rope_scaling": {**YARN, "short_factor": [1.0] * 16}},
                         r"rope parameters \['short_factor'\] are not supported for rope type 'yarn'"),
    "yarn-key-on-default": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 4.0}},
                            r"rope parameters \['factor'\] are not supported for rope type 'default'"),
    "rope-per-layer-type": ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
                            r"rope parameters \['full_attention'\] are not supported"),
    "layer_types-kind": ({"layer_types": ["full_attention", "linear_attention"] * 2},
                         r"layer types \['linear_attention'\] are not supported"),
    "layer_types-length": ({"layer_types": ["full_attention"] * 3},
                           "layer_types lists 3 layers, num_hidden_layers is 4"),
    "model_type": ({"model_type": "phi3"}, "model_type 'phi3' is not supported; supported are llama, mistral, "
                                           "qwen2, qwen3"),
    "quantization_config": ({"quantization_config": {"quant_method": "awq", "bits": 4}},
                            r"quantization_config quant_method 'awq' is not supported; only 'fp8' \(128x128 blocks\)"),
}


@pytest.mark.parametrize(("edits", "message"), FIELD_REFUSALS.values(), ids=FIELD_REFUSALS.keys())
def test_fields_the_engine_does_not_implement_are_refused_at_load(tmp_path, tiny_model, edits, message):
    # read_shape, which LLMEngine calls before building anything: transformers' tokenizer loading, which the
    # engine does first, already rejects some of these configs (a short layer_types) with its own error
    with pytest.raises(ValueError, match=message):
        read_shape(_config_folder(tmp_path, tiny_model, **edits))


def test_fields_the_engine_honours_read_as_transformers_reads_them(tmp_path, tiny_model):
    """Defaults included: a sliding-window config without max_window_layers or layer_types slides from layer
    28 on, as Qwen3Config says; 'swish' is SiLU; an explicit default rope type is no scaling."""
    folder = _config_folder(tmp_path, tiny_model, num_hidden_layers=30, layer_types=None, max_window_layers=None,
                            use_sliding_window=True, sliding_window=64, hidden_act="swish", rms_norm_eps=1e-5,
                            rope_scaling={"rope_type": "default"}, rope_theta=2e5, rope_parameters=None)
    shape, hf = read_shape(folder), AutoConfig.from_pretrained(folder)
    assert shape.windows == tuple(64 if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert shape.windows.count(64) == 2
    assert (shape.rms_norm_eps, shape.rope_theta, shape.yarn) == (
        hf.rms_norm_eps, hf.rope_parameters["rope_theta"], None)
    assert (shape.head_dim, shape.num_kv_heads, shape.tie_word_embeddings) == (
        hf.head_dim, hf.num_key_value_heads, hf.tie_word_embeddings)
