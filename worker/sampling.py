"""A job's sampling as the engine takes it.

What a job leaves unset comes from the model folder's `generation_config.json` when CONVOQ_GENERATION_CONFIG is
`auto` (as transformers and vLLM do: Qwen3 samples at temperature 0.6, top_p 0.95, top_k 20), else from
convoq's defaults (greedy, no filters, no penalties).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

from engine.interface import SamplingParams
from jobs.schemas import JobIn, Sampling
from worker.grammar_spec import grammar_spec

log = logging.getLogger(__name__)

# convoq's defaults for the fields a job may leave unset (None, and a seed left unset is no seed) are the
# engine's own
OURS = {f.name: f.default for f in fields(SamplingParams)
        if f.name != "seed" and f.name in Sampling.model_fields and Sampling.model_fields[f.name].default is None}
# what a model's generation_config.json may state (it has no presence penalty, nor a word on speculation)
FROM_MODEL = tuple(name for name in OURS if name not in ("presence_penalty", "speculative"))


def model_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling defaults a model folder's generation_config.json states (empty without one)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    stated = {k: config[k] for k in FROM_MODEL if config.get(k) is not None}
    if not config.get("do_sample", False):
        # transformers decodes greedily then, whatever temperature and filters say
        stated = {k: v for k, v in stated.items() if k == "repetition_penalty"} | {"temperature": 0.0}
    if stated.get("top_k", 0) < 0:  # some configs say -1 for "off"
        stated["top_k"] = 0
    return stated


def sampling_defaults(model_dir: Path, mode: str) -> dict[str, float]:
    """Defaults for unset fields: the model's (`auto`) over ours, or ours alone (`none`)."""
    if mode == "none":
        return dict(OURS)
    defaults = OURS | model_defaults(model_dir)
    log.info("sampling defaults for unset fields (%s): %s", mode, defaults)
    return defaults


def sampling_params(job: JobIn, defaults: Mapping[str, float] = OURS, thinking: bool = False) -> SamplingParams:
    """The engine's sampling for `job`, which runs with `thinking` or not: its answer constrained by its
    `response_format` or its `tool_choice` (after the reasoning, with thinking), with log-probabilities if it asked for them."""
    given = job.sampling.model_dump(exclude_none=True)  # every field the job set, by the schema's names
    given["stop"] = tuple(given["stop"])
    grammar = grammar_spec(job)
    return SamplingParams(**(OURS | dict(defaults) | given), max_thinking_tokens=job.max_thinking_tokens,
                          grammar=grammar, grammar_after_think=thinking and grammar is not None,
                          logprobs=(job.top_logprobs or 0) if job.logprobs else None)
