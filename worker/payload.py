"""A job's payload in engine terms, and what the engine's answer becomes for the job."""

from __future__ import annotations

from dataclasses import dataclass

from engine.interface import Completion, SamplingParams


def sampling_from(payload: dict) -> SamplingParams:
    s = payload.get("sampling", {})
    return SamplingParams(
        max_new_tokens=s.get("max_new_tokens", 256),
        temperature=s.get("temperature", 0.0),
        top_p=s.get("top_p", 1.0),
        top_k=s.get("top_k", 0),
        stop=tuple(s.get("stop", ())),
        seed=s.get("seed"),
    )


@dataclass
class Outcome:
    completion: Completion
    engine_ms: float  # first request submitted -> last completion back
    chunks: int = 1  # transcript chunks summarized (map-reduce)
    levels: int = 1  # summarization levels, the final combine included
