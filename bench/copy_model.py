"""A tiny Qwen3 that really copies from its prompt, for the speculative decoding benchmark.

Random weights copy nothing, so a benchmark of drafts copied from the prompt needs a model that does. Training one
to copy on this project's 2-core CPU did not get there in reasonable time (the `tiny` shape, spans of made-up call
transcripts quoted in the answer: after 225 steps, 15 minutes, its loss had not left the plateau where copying
starts), so this one is built instead, its weights written to be the mechanism such training finds: an
induction head. It has `cli.tiny_model`'s `tiny` shape and tokenizer, and:

- each token its prompts use has a 28-dimensional code (unit vectors spread apart by a few hundred steps of
  repulsion on the sphere, so that two codes' dot product stays low), the embedding's first dimensions, and a
  constant in its last; every other token embeds as 0, so that it is never predicted;
- layer 0 is a sliding-window layer of width 2 with one head that attends to the previous token (its query and
  key are constant, rotated by RoPE to prefer the key one position back) and writes that token's code beside the
  current one's;
- layer 1 has an induction head, which attends to the positions whose previous token is the current one and
  writes their token's code, four times over, and a head that takes the current token's own code back out; RoPE's
  base is 1e30, so that the dimensions these heads match on rotate by under 0.1 radian over the context;
- layers 2 and 3 and every MLP are zero.

So at each step it predicts the token that followed the current one where it appeared before (where it
appeared several times, one of those continuations): it quotes its prompt, jumping between lines at tokens that
start many of them, and stops once it quotes the prompt's `<|im_end|>`. Prompts are made-up call transcripts
(`example`), and the benchmark's are ones this module's generator makes with seeds of their own. The build is
deterministic (seeded) and takes seconds; the folder is written once under `.convoq/models/` and reused while its
recipe is unchanged (`RECIPE`, stored beside the weights).

    python -m bench.copy_model   # build it (if needed) and print a prompt and the model's answer
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import MODELS_DIR
from cli.tiny_model import build_tiny_model

RECIPE = {"preset": "tiny", "seed": 0, "id_dims": 28, "match_dims": 14, "copy_weight": 8.0, "match_scale": 4.0,
          "version": 3}
SHAPE = dict(use_sliding_window=True, sliding_window=3, rope_theta=1e30,
             layer_types=["sliding_attention", "full_attention", "full_attention", "full_attention"])
INSTRUCTION = "Summarize the call, quoting what matters:\n"
WORDS = ("order refund account password shipping delivery invoice charge card billing plan upgrade cancel agent "
         "customer ticket number address email phone login error app update payment package tracking return "
         "replace damaged credit balance fee discount store manager tomorrow today week month").split()
SYLLABLES = "ka lo mi nu pe ra si to vu ze ba de fi go hu ja ke li mo ny pa qu re sa te".split()
# the residual's dimensions: a token's identity code (what the head predicts from) and its match code, the match
# codes of the token one and two back (written by layer 0), and a constant
ID, MATCH, BACK1, BACK2, CONSTANT = 0, 32, 64, 96, 255


def sentence(rng: random.Random) -> str:
    """A line of a made-up call: an invented name first (lines do not start alike), then common words,
    invented names and numbers (what a summary quotes)."""
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))]
    for _ in range(rng.randint(5, 14)):
        roll = rng.random()
        if roll < 0.45:
            words.append(rng.choice(WORDS))
        elif roll < 0.9:
            words.append("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))))
        else:
            words.append(f"#{rng.randint(100, 99999)}")
    return " ".join(words)


def example(rng: random.Random, tokenizer, lines: tuple[int, int] = (8, 14)) -> list[int]:
    """A chat prompt asking for a quoting summary of a transcript of `lines` lines."""
    transcript = "\n".join(sentence(rng) for _ in range(rng.randint(*lines)))
    text = f"<|im_start|>user\n{INSTRUCTION}{transcript}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


def used_tokens(tokenizer, seed: int) -> list[int]:
    """The tokens prompts like `example`'s hold: those of many of its lines, and of the chat around them."""
    rng = random.Random(seed)
    text = "\n".join(sentence(rng) for _ in range(20_000)) + " 0123456789#" + INSTRUCTION
    ids = set(tokenizer.encode(text, add_special_tokens=False))
    ids |= set(tokenizer.encode("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))
    return sorted(ids)


def spread_codes(count: int, dims: int, seed: int, rounds: int = 300) -> torch.Tensor:
    """`count` unit vectors in `dims` dimensions pushed apart: each round moves every vector away from the others
    in proportion to how close they are (a softened maximum of the dot products)."""
    rng = np.random.default_rng(seed)
    codes = rng.standard_normal((count, dims))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    for _ in range(rounds):
        dots = codes @ codes.T
        np.fill_diagonal(dots, -1.0)
        push = np.exp(8.0 * dots) @ codes
        codes -= 0.5 * push / np.linalg.norm(push, axis=1, keepdims=True)
        codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    return torch.from_numpy(codes).float()


def look_back(attention, hidden: int, head: int, match: int) -> None:
    """Layer 0 (a window of 3): head 0 writes the match code of the token one back, head 1 of the token two back.
    Their queries and their shared key are constant, turned in RoPE's first plane (a radian a position) so that
    head 0 scores the key one position back highest and head 1 the key two back."""
    half = head // 2
    for h, back in ((0, 1.0), (1, 2.0)):
        attention.q_proj.weight[h * head, CONSTANT] = math.cos(-back)
        attention.q_proj.weight[h * head + half, CONSTANT] = math.sin(-back)
    attention.k_proj.weight[0, CONSTANT] = 1.0
    attention.q_norm.weight.fill_(4.0)
    attention.k_norm.weight.fill_(4.0)
    attention.v_proj.weight[:match, MATCH:MATCH + match] = torch.eye(match) * math.sqrt(3 / hidden)  # input's norm
    attention.o_proj.weight[BACK1:BACK1 + match, :match] = torch.eye(match)
    attention.o_proj.weight[BACK2:BACK2 + match, head:head + match] = torch.eye(match)


def induction(attention, hidden: int, head: int, kv_group: int, ids: int, match: int, recipe: dict) -> None:
    """Layer 1: head 0 attends where the two tokens before match the current token and the one before it (its
    query the current and previous match codes, its key the codes one and two back) and writes the identity code
    found there, `copy_weight` times; the first head of the second KV group attends where the token is the
    current one and takes its identity code back out. Both match in the RoPE planes that barely turn (2..15 of 16
    at base 1e30: under 0.1 radian over the context)."""
    still = [*range(2, head // 2), *range(head // 2 + 2, head)]
    first, second = still[:match], still[match:2 * match]
    eye, scale = torch.eye(match), math.sqrt(5 / hidden)
    attention.q_proj.weight[first, MATCH:MATCH + match] = eye
    attention.q_proj.weight[second, BACK1:BACK1 + match] = eye
    attention.k_proj.weight[first, BACK1:BACK1 + match] = eye
    attention.k_proj.weight[second, BACK2:BACK2 + match] = eye
    attention.v_proj.weight[:ids, ID:ID + ids] = torch.eye(ids) * scale
    attention.o_proj.weight[ID:ID + ids, :ids] = torch.eye(ids) * recipe["copy_weight"]
    own = kv_group * head  # the second KV group's first query head
    attention.q_proj.weight[[own + d for d in first], MATCH:MATCH + match] = eye
    attention.k_proj.weight[[head + d for d in first], MATCH:MATCH + match] = eye
    attention.v_proj.weight[head:head + ids, ID:ID + ids] = torch.eye(ids) * scale
    attention.o_proj.weight[ID:ID + ids, own:own + ids] = -torch.eye(ids)
    attention.q_norm.weight.fill_(recipe["match_scale"])
    attention.k_norm.weight.fill_(recipe["match_scale"])


def write_weights(model, tokenizer, recipe: dict) -> None:
    """Every weight of `model` (the `tiny` shape with `SHAPE`) set as the module docstring says."""
    config, ids, match = model.config, recipe["id_dims"], recipe["match_dims"]
    used = used_tokens(tokenizer, recipe["seed"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if "norm" in name else 0.0)
        embedding = model.model.embed_tokens.weight
        embedding[used, ID:ID + ids] = spread_codes(len(used), ids, recipe["seed"])
        embedding[used, MATCH:MATCH + match] = spread_codes(len(used), match, recipe["seed"] + 1)
        embedding[used, CONSTANT] = 1.0
        look_back(model.model.layers[0].self_attn, config.hidden_size, config.head_dim, match)
        group = config.num_attention_heads // config.num_key_value_heads
        induction(model.model.layers[1].self_attn, config.hidden_size, config.head_dim, group, ids, match, recipe)


def copy_model(recipe: dict = RECIPE) -> Path:
    """The copying checkpoint's folder, built on first use (or when its recipe changed)."""
    path = MODELS_DIR / "copy-tiny"
    stamp = path / "convoq-copy.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    print(f"building the copying model in {path}", file=sys.stderr)
    build_tiny_model(path, preset=recipe["preset"], seed=recipe["seed"], **SHAPE)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    write_weights(model, AutoTokenizer.from_pretrained(path), recipe)
    model.save_pretrained(path)
    stamp.write_text(json.dumps(recipe))
    return path


def main() -> int:
    path = copy_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = example(random.Random(1), tokenizer)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=96, do_sample=False, pad_token_id=0)
    print(tokenizer.decode(prompt), "\n---\n", tokenizer.decode(out[0, len(prompt):]), sep="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
