"""`CONVOQ_MODEL` as a local folder: a folder as given, or a Hugging Face hub id through the hub's cache.

huggingface_hub reads HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported; they are read here on
every call instead, so that what the environment says now (a test, a process that sets them late) is what counts.
"""

from __future__ import annotations

import os
from pathlib import Path

# Only what the API reads (prompt checks): the config, the tokenizer and its chat template, never the weights.
LIGHT_FILES = ["config.json", "generation_config.json", "tokenizer*", "vocab*", "merges.txt",
               "special_tokens_map.json", "added_tokens.json", "chat_template*"]


class ModelNotFound(ValueError):
    """The model is neither a local folder nor a hub id that can be had from here."""


def hub_cache() -> Path:
    """The hub cache folder the environment names now, in huggingface_hub's order of precedence."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model(name: str, weights: bool = True) -> Path:
    """The local folder for `name`: an existing folder as is, else the hub id's snapshot in the hub cache,
    downloaded unless offline. `weights=False` fetches only config, tokenizer and chat template files."""
    if Path(name).is_dir():
        return Path(name)
    # imported here: the API imports this module and should not pay for the hub client unless it needs it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
        if name.count("/") != 1:  # the hub also takes bare names (`gpt2`), too easily a mistyped folder
            raise ValueError(name)
    except ValueError:
        raise ModelNotFound(f"model {name!r} is neither an existing folder nor a Hugging Face hub id "
                            "(owner/name, e.g. Qwen/Qwen3-8B): set CONVOQ_MODEL to one of those") from None

    cache, offline = hub_cache(), hub_offline()
    try:
        folder = snapshot_download(name, cache_dir=cache, local_files_only=offline,
                                   allow_patterns=None if weights else LIGHT_FILES)
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if offline else f"the hub could not be reached ({exc.__cause__ or exc})"
        raise ModelNotFound(
            f"model {name!r} is not a local folder and is not (completely) in the Hugging Face cache at {cache}, "
            f"and {why}. Download it where the hub is reachable with the same cache: `hf download {name} "
            f"--cache-dir {cache}` (or `huggingface-cli download {name}` with HF_HOME set to the same place), "
            "copying the cache folder over if that was another machine; or set CONVOQ_MODEL to a local model "
            "folder.") from exc
    return Path(folder)
