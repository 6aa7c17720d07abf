"""Content keys of full KV blocks: a hash chain over the tokens of a block and every block before it, rooted in
the request's cache salt, so that requests of different salts never share a block."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from engine.interface import RequestError

ROOT = 0  # the parent key of an unsalted sequence's first block


class BlockKey(NamedTuple):  # a named tuple: a long prompt makes hundreds of them, and a frozen dataclass's
    key: int                 # constructor costs several times a tuple's
    parent: int
    tokens: tuple[int, ...]
    root: int  # its chain's first parent (`salt_root`)

    def __hash__(self) -> int:
        # Indexes are keyed by the whole entry, hashed by its key alone: entries of equal keys but different
        # contents are different entries, never one taking the other's place. So a key crafted to collide with
        # another salt's block is a miss that tells nothing (not a block that failed to be cached), and two chains
        # whose keys collide at some block do not meet after it, their roots differing.
        return self.key


def salt_root(salt: bytes | str | None) -> int:
    """The parent key of the first block of a sequence with this cache salt (str as its UTF-8 bytes), never
    ROOT. Every block's entry holds it and the prefix cache compares a hit's whole entry, so a block is only
    found under the salt that computed it; a 128-bit digest, where `hash()` would give 64 bits, for two salts'
    roots never to be equal."""
    if salt is None:
        return ROOT
    if isinstance(salt, str):
        salt = salt.encode()
    if not isinstance(salt, bytes):
        raise RequestError(f"cache_salt must be bytes or str, not {type(salt).__name__}")
    return int.from_bytes(hashlib.blake2b(salt, digest_size=16, person=b"convoq-salt").digest()) | 1


def extend_keys(keys: list[BlockKey], token_ids: list[int], block_size: int, root: int) -> None:
    """Append the key of every full block of `token_ids` that `keys` lacks (tokens are only ever appended);
    `root` is the first block's parent (`salt_root`)."""
    for i in range(len(keys), len(token_ids) // block_size):
        parent = keys[-1].key if keys else root
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        keys.append(BlockKey(hash((parent, tokens)), parent, tokens, root))
