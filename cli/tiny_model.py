"""Deterministic small Qwen3 checkpoints for tests, the demo and CPU benchmarks.

A folder written here is a normal Hugging Face model folder (config.json, model.safetensors, tokenizer files
with a chat template) and loads through exactly the path a real `Qwen/Qwen3-*` folder does. The weights are
random, so the text it writes is gibberish; speed and correctness against transformers are what it is for.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen's ChatML layout, without the tool-calling and thinking branches.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Shapes: `tiny` is the demo/benchmark model; the others exercise loader paths (untied head, sliding window);
# `0.6b` has Qwen3-0.6B's shapes (vocab included) with this tokenizer.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True),
    "tiny-untied": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, head_dim=48, max_position_embeddings=1024,
                        tie_word_embeddings=False, rope_theta=10000.0),
    "tiny-swa": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                     use_sliding_window=True, sliding_window=64, max_window_layers=2),
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


def build_tokenizer(vocab_size: int = 4096, seed: int = 0) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(path: str | Path, preset: str = "tiny", seed: int = 0, **overrides) -> Path:
    """Write a checkpoint folder; the same preset, seed and overrides give the same bytes."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed=seed)
    shape = {**PRESETS[preset], **overrides}
    shape.setdefault("vocab_size", len(tokenizer))
    config = Qwen3Config(
        **shape,
        rms_norm_eps=1e-6,
        # Wider than the usual 0.02 so that random logits have clear winners: greedy comparisons against
        # transformers then test the arithmetic, not float noise between near-ties.
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "convoq-tiny.json").write_text(json.dumps({"preset": preset, "seed": seed, **overrides}))
    return path
