"""Content keys of full KV blocks: a hash chain over the tokens of a block and every block before it."""

from __future__ import annotations

from typing import NamedTuple

ROOT = 0  # the parent key of a sequence's first block


class BlockKey(NamedTuple):  # a named tuple: a long prompt makes hundreds of them, and a frozen dataclass's
    key: int                 # constructor costs several times a tuple's
    parent: int
    tokens: tuple[int, ...]


def extend_keys(keys: list[BlockKey], token_ids: list[int], block_size: int) -> None:
    """Append the key of every full block of `token_ids` that `keys` lacks (tokens are only ever appended)."""
    for i in range(len(keys), len(token_ids) // block_size):
        parent = keys[-1].key if keys else ROOT
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        keys.append(BlockKey(hash((parent, tokens)), parent, tokens))
