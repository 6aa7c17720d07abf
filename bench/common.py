"""What every benchmark here shares: the tiny model it runs on and how it prints its result."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from cli.tiny_model import build_tiny_model
from engine.interface import Request, SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from jobs.schemas import JobIn

# The data folder's models (`jobs.settings.DATA_DIR / "models"`, where the service's default model is), not
# imported: the GPU check runs these benchmarks where only the engine's dependencies are installed.
MODELS_DIR = Path(".convoq") / "models"
QWEN3_TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "data" / "qwen3-tokenizer"


def tiny_model(preset: str = "tiny") -> Path:
    """The `cli.tiny_model` preset's checkpoint (random weights) under the data folder, built on first use."""
    path = MODELS_DIR / preset
    if not (path / "config.json").exists():
        print(f"building the {preset} checkpoint in {path}", file=sys.stderr)
        build_tiny_model(path, preset=preset)
    return path


def qwen3_vocabulary_model() -> Path:
    """The `qwen3-small` checkpoint around the real Qwen3 tokenizer and chat template, built on first use."""
    path = MODELS_DIR / "qwen3-small"
    if not (path / "config.json").exists():
        print(f"building the qwen3-small checkpoint in {path}", file=sys.stderr)
        build_tiny_model(path, preset="qwen3-small", tokenizer=QWEN3_TOKENIZER)
    return path


def prompt(i: int) -> list[int]:
    """The i-th of a fixed set of prompts of 16 to 63 ordinary token ids."""
    return [(i * 7919 + j * 104729) % 3000 + 10 for j in range(16 + i % 48)]


def tokens_per_s(engine: LLMEngine, requests: int, new_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """Generated tokens/s of the requests run together, and their outputs."""
    for i in range(requests):
        engine.add_request(Request(f"{tag}{i}", prompt(i), SamplingParams(new_tokens, ignore_eos=True)))
    done, start = {}, time.perf_counter()
    with tqdm(total=requests, desc=tag, file=sys.stderr, leave=False) as bar:
        while engine.has_unfinished():
            for completion in engine.step():
                done[completion.request_id] = completion
                bar.update()
    elapsed = time.perf_counter() - start
    outputs = [done[f"{tag}{i}"].token_ids for i in range(requests)]
    return sum(map(len, outputs)) / elapsed, outputs


def batch_of(jobs: list[JobIn]) -> bytes:
    """The jobs as the lines of one OpenAI Batch upload (bulk work: its lines travel in grouped messages)."""
    return b"".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "bench", "max_tokens": job.sampling.max_new_tokens,
                                         "messages": [m.model_dump(exclude_none=True) for m in job.messages]}})
                    .encode() + b"\n" for i, job in enumerate(jobs))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def chat_figures(e2e_ms: list[float], ttft_ms: list[float], tpot_ms: list[float]) -> dict[str, float]:
    """Chats' latency: end to end (p50, p95), time to first token (p95), time per output token (p50, p95)."""
    return {"p50": statistics.median(e2e_ms), "p95": percentile(e2e_ms, 0.95), "ttft_p95": percentile(ttft_ms, 0.95),
            "tpot": statistics.median(tpot_ms), "tpot_p95": percentile(tpot_ms, 0.95)}


def chat_comparison(idle: dict[str, float], mixed: dict[str, float] | None) -> dict[str, float | None]:
    """The chat fields of a mixed-load result: figures idle and under bulk load (None: no chat ran under
    load), and the ratios the targets are stated in."""
    def value(figures: dict[str, float] | None, key: str, digits: int) -> float | None:
        return None if figures is None else round(figures[key], digits)

    def ratio(key: str) -> float | None:
        return None if mixed is None else round(mixed[key] / idle[key], 2)

    return {
        "chat_p50_idle_ms": value(idle, "p50", 1), "chat_p50_mixed_ms": value(mixed, "p50", 1),
        "chat_p95_idle_ms": value(idle, "p95", 1), "chat_p95_mixed_ms": value(mixed, "p95", 1),
        "chat_p95_ratio": ratio("p95"),
        "chat_tpot_idle_ms": value(idle, "tpot", 2), "chat_tpot_mixed_ms": value(mixed, "tpot", 2),
        "chat_tpot_ratio": ratio("tpot"), "chat_tpot_p95_mixed_ms": value(mixed, "tpot_p95", 2),
        "chat_ttft_p95_idle_ms": value(idle, "ttft_p95", 1), "chat_ttft_p95_mixed_ms": value(mixed, "ttft_p95", 1),
    }


def report(result: dict, json_only: bool) -> None:
    """A readable table unless `json_only`; the last line is always the result as one JSON object."""
    if not json_only:
        width = max(len(k) for k in result)
        for k, v in result.items():
            print(f"{k:>{width}}: {v}")
    print(json.dumps(result))


def scraped(url: str, sample: str, timeout: float = 10.0) -> dict[tuple[tuple[str, str], ...], float]:
    """The values a Prometheus endpoint serves for the sample `sample` (its whole name: `..._total` for a
    counter), by their labels, sorted; {} when it serves none. Imported here, not above: the GPU check runs these
    benchmarks where the service's dependencies are not installed."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(httpx.get(url, timeout=timeout).text)
            for s in family.samples if s.name == sample}
