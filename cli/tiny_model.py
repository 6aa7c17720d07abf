"""Deterministic small checkpoints of each family we load, for tests, the demo and CPU benchmarks.

A folder written here is a normal Hugging Face model folder (config.json, model.safetensors, tokenizer files
with a chat template) and loads through exactly the path a real `Qwen/Qwen3-*` (or Llama, Mistral, Qwen2)
folder does. The weights are
random, so the text it writes is gibberish; speed and correctness against transformers are what it is for.
"""

from __future__ import annotations

import gzip
import json
import random
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen3's ChatML layout and its tools (listed in the system turn, calls as `<tool_call>` blocks, results as
# `<tool_response>` blocks of a user turn), without its thinking branches: with thinking on, a chat renders as
# Qwen3's own template renders it.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}"
    "{%- set call = call['function'] if call['function'] else call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3's layout: a header per turn, each turn ended by <|eot_id|>, the whole chat after <|begin_of_text|>
LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

# Shapes: `tiny` is the demo/benchmark model; the others exercise loader paths (untied head, sliding window);
# `micro` is the cheapest model that still runs every part of the engine, for benchmarks of what is around
# it (bench.pipeline --model micro); `0.6b` has Qwen3-0.6B's shapes (vocab included) with this tokenizer.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True),
    "micro": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True),
    "tiny-untied": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, head_dim=48, max_position_embeddings=1024,
                        tie_word_embeddings=False, rope_theta=10000.0),
    "tiny-swa": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                     use_sliding_window=True, sliding_window=64, max_window_layers=2),
    # with the real Qwen3 tokenizer (`tokenizer=`): small, but with Qwen3's vocabulary and a longer context
    "qwen3-small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
                        vocab_size=151936),
    # the other families, each with the switches that set it apart from Qwen3 (no q/k norm; Qwen2's q/k/v
    # biases; Llama 3's rope scaling and chat template; Mistral's sliding window over every layer)
    "tiny-llama": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                       tie_word_embeddings=True, rope_theta=500000.0,
                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=128)),
    "tiny-mistral": dict(model_type="mistral", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=False, sliding_window=48),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       tie_word_embeddings=False),
    # what FP8 copies are written from (`write_fp8`): `tiny-blocks` in whole 128x128 blocks, head_dim 128 as in
    # Qwen3's FP8 checkpoints; `tiny-blocks-ragged` with shards off the blocks (64-row K and V projections, an MLP
    # of 4.5 blocks)
    "tiny-blocks": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, tie_word_embeddings=True),
    "tiny-blocks-ragged": dict(hidden_size=256, intermediate_size=576, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                               tie_word_embeddings=False),
    # Qwen3-MoE: 8 experts of which each token takes 2 (renormalized), and a dense first layer as
    # mlp_only_layers allows; its experts are half the dense MLP's width, as Qwen3-30B-A3B's are an eighth
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                     tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                     norm_topk_prob=True, mlp_only_layers=[0]),
    # what the FP8 Qwen3-MoE copy is written from: tiny-moe's experts at blocks' sizes (hidden 256, experts of
    # width 256: two blocks, one a rank of two) and head_dim 128, so that two ranks split every projection on
    # whole blocks; moe_intermediate_size=192 makes each expert's up projection start mid-block
    "tiny-moe-blocks": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=1024,
                            tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[0]),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                 vocab_size=151936),
}

_WORDS = (
    "hello thanks order refund account password shipping delivery invoice charge card billing plan upgrade "
    "cancel subscription agent customer issue ticket number address email phone reset login error app "
    "update payment late package tracking return replace damaged help please sorry understand check "
    "minutes today tomorrow week month credit balance fee discount store manager call back summary resolved"
).split()
_SYLLABLES = "ka lo mi nu pe ra si to vu ze ba de fi go hu ja ke li mo ny pa qu re sa te".split()


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    """Text to train the tokenizer on: chat-like sentences plus made-up words, so merges fill the vocab."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) if rng.random() < 0.6 else
                 "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(4, 16))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        if rng.random() < 0.2:
            sentence += f" #{rng.randint(0, 99999)}"
        out.append(sentence)
    return out


def build_tokenizer(vocab_size: int = 4096, seed: int = 0, llama3: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here, with Qwen3's ChatML template, or Llama 3's tokens and template."""
    special = SPECIAL_TOKENS + (LLAMA3_SPECIAL_TOKENS if llama3 else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if llama3:
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                       pad_token="<|endoftext|>", chat_template=LLAMA3_CHAT_TEMPLATE)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


# Qwen3's published generation_config.json: it samples by default
QWEN3_GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                           "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def copy_qwen3_tokenizer(source: Path, path: Path) -> PreTrainedTokenizerFast:
    """The real Qwen3 tokenizer files from `source` (tokenizer.json may be gzipped) into the folder `path`."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(source / name, path / name)
    if (source / "tokenizer.json").exists():
        shutil.copyfile(source / "tokenizer.json", path / "tokenizer.json")
    else:
        with gzip.open(source / "tokenizer.json.gz", "rb") as src, open(path / "tokenizer.json", "wb") as dst:
            shutil.copyfileobj(src, dst)
    return AutoTokenizer.from_pretrained(path)


def build_tiny_model(path: str | Path, preset: str = "tiny", seed: int = 0, tokenizer: str | Path | None = None,
                     **overrides) -> Path:
    """Write a checkpoint folder; the same preset, seed and overrides give the same bytes. With `tokenizer`
    (a folder of the real Qwen3 tokenizer files), the folder tokenizes, renders chats and samples by default
    exactly like a downloaded `Qwen/Qwen3-*` one."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    real = tokenizer is not None
    shape = {**PRESETS[preset], **overrides}
    family = shape.pop("model_type", "qwen3")
    tokenizer = (copy_qwen3_tokenizer(Path(tokenizer), path) if real
                 else build_tokenizer(seed=seed, llama3=family == "llama"))
    shape.setdefault("vocab_size", len(tokenizer))
    config = AutoConfig.for_model(
        family,
        **shape,
        rms_norm_eps=1e-6,
        # Wider than the usual 0.02 so that random logits have clear winners: greedy comparisons against
        # transformers then test the arithmetic, not float noise between near-ties.
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers starts biases at zero, which would leave their loading untested
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
    model.save_pretrained(path)
    if real:
        (path / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION_CONFIG, indent=2))
    else:
        tokenizer.save_pretrained(path)
    (path / "convoq-tiny.json").write_text(json.dumps({"preset": preset, "seed": seed, "qwen3_tokenizer": real,
                                                       **overrides}))
    return path


# Qwen's `*-FP8` checkpoints' quantization_config
FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}


def fp8_quantization(config: dict) -> dict:
    """The quantization_config Qwen writes for a model of `config`: its mixture-of-experts checkpoints
    (Qwen3-30B-A3B-FP8) list every layer's norms and router beside the LM head as left unquantized."""
    if config.get("model_type") != "qwen3_moe":
        return FP8_QUANTIZATION
    layers = [f"model.layers.{i}.{module}" for i in range(config["num_hidden_layers"])
              for module in ("input_layernorm", "mlp.gate", "post_attention_layernorm")]
    return {**FP8_QUANTIZATION, "modules_to_not_convert": ["lm_head", *layers]}


def write_fp8(source: str | Path, path: str | Path, dequantized: str | Path) -> tuple[Path, Path]:
    """An FP8 copy of checkpoint folder `source` in `path`, laid out as Qwen's `*-FP8` checkpoints are (each layer
    projection's weight, and each expert's, in float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 block,
    everything else in bf16), and in `dequantized` the same values as an ordinary float32 checkpoint, for
    transformers to run."""
    from safetensors.torch import load_file, save_file

    from engine.model.families import read_shape
    from engine.model.fp8 import FP8, SCALES, dequantize_weight, quantize_checkpoint

    source, path, dequantized = Path(source), Path(path), Path(dequantized)
    config = json.loads((source / "config.json").read_text())
    quantized = {name: tensor if tensor.dtype == FP8 or name.endswith(SCALES) else tensor.to(torch.bfloat16)
                 for name, tensor in quantize_checkpoint(load_file(source / "model.safetensors").items(),
                                                         read_shape(source).experts_per_layer())}
    plain = {name: dequantize_weight(tensor, quantized[name.replace(".weight", f".{SCALES}")])
             if tensor.dtype == FP8 else tensor.float()
             for name, tensor in quantized.items() if not name.endswith(SCALES)}
    for folder, tensors, extra in ((path, quantized, {"quantization_config": fp8_quantization(config),
                                                      "dtype": "bfloat16"}),
                                   (dequantized, plain, {})):
        shutil.copytree(source, folder, dirs_exist_ok=True)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
    return path, dequantized
