"""Constrained decoding: outputs that always validate, at what cost to throughput and to the step loop.

    python -m bench.structured --json [--requests 600]

Five figures, each measured side by side in this run:
- `valid_rate`: of `--requests` requests under 12 JSON schemas (nested objects, bounded arrays, enums, bounded
  integers and numbers, strings with patterns and lengths, anyOf), half of them sampled at temperature 1, mixed
  in the same batches with half as many free requests, the share whose output parses and validates
  (`jsonschema`);
- `throughput_ratio`: generated tokens/s with every request constrained over the same requests free, each
  free request generating exactly as many tokens as its constrained twin did (rounds alternate, pooled);
- `loop_gap_p95_ms` with and without 50 never-seen schemas arriving while a bulk run decodes, on a checkpoint
  with the real Qwen3 vocabulary (151,936 tokens: what a grammar costs to compile for a real model): the step
  loop's idle time between steps (`engine.runtime.loop_gaps`), compiling being the submitting thread's work;
- `cached_compile_ms`: a schema seen before, median of 200 lookups (real vocabulary);
- `hostile_chat_p95_ratio`: chats' p95 latency on an engine in its own process (as a worker runs it, real
  vocabulary) while a never-seen schema at the API's bounds (`jobs.settings`' max_schema_*: the most optional
  properties they allow, the costliest shape to compile) compiles, over the same chats on the idle engine
  (rounds alternate); `hostile_compile_s` is how long that schema took to compile and run, and
  `hostile_chats_during_compile` the share of rounds whose chats all finished before it did.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import jsonschema
from tqdm import tqdm
from transformers import AutoTokenizer

from bench.common import qwen3_vocabulary_model, report, tiny_model
from engine.config import EngineConfig
from engine.interface import GrammarKind, GrammarSpec, Request, SamplingParams
from engine.llm_engine import LLMEngine
from engine.runtime.engine_process import EngineProcess
from engine.runtime.engine_thread import EngineThread
from jobs.settings import Settings
from jobs.structured import SchemaBounds, bounds_problem
from worker.engine_factory import WorkerSettings, load_backend

BUDGET = 256  # output tokens: every schema here completes well within it


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


SCHEMAS = [
    _object({"category": {"enum": ["billing", "shipping", "technical", "other"]}, "resolved": {"type": "boolean"},
             "sentiment": {"enum": ["positive", "neutral", "negative"]},
             "summary": {"type": "string", "minLength": 3, "maxLength": 40}}),
    _object({"items": {"type": "array", "minItems": 1, "maxItems": 4,
                       "items": {"type": "integer", "minimum": -5, "maximum": 500}}}),
    _object({"customer": _object({"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                  "tier": {"enum": ["gold", "silver", "bronze"]}}),
             "score": {"type": "number", "minimum": 0, "maximum": 1}}),
    _object({"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                  {"type": "string", "maxLength": 8}, {"type": "null"}]}}),
    _object({"order": _object({"lines": {"type": "array", "maxItems": 3,
                                         "items": _object({"sku": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
                                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}}),
             "rush": {"type": "boolean"}}),
    _object({"title": {"type": "string", "maxLength": 20}, "tags": {"type": "array", "maxItems": 3,
                                                                    "items": {"enum": ["a", "b", "c", "d"]}}}),
    _object({"from": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
             "nights": {"type": "integer", "minimum": 1, "maximum": 30}}),
    _object({"follow_up": {"anyOf": [_object({"when": {"enum": ["today", "tomorrow", "next week"]},
                                              "who": {"type": "string", "maxLength": 12}}), {"type": "null"}]}}),
    _object({"ratio": {"type": "number", "minimum": -1, "maximum": 1}, "count": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 10000}}),
    _object({"matrix": {"type": "array", "minItems": 1, "maxItems": 2,
                        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "boolean"}}}}),
    _object({"name": {"type": "string", "minLength": 1, "maxLength": 16}, "email": {
        "type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}, "vip": {"type": "boolean"}},
        required=["name", "email"]),
    _object({"status": {"const": "ok"}, "code": {"type": "integer", "enum": [200, 201, 404]},
             "detail": {"type": "string", "maxLength": 10}}),
]


def grammar(schema: dict) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True))


def prompt(i: int) -> list[int]:
    return [(i * 7919 + j * 104729) % 3000 + 10 for j in range(8 + i % 24)]


def run(engine: LLMEngine, requests: list[Request], desc: str) -> tuple[dict, float]:
    """Steps `engine` through `requests`: completions by id and seconds taken."""
    for request in requests:
        engine.add_request(request)
    done, start = {}, time.perf_counter()
    with tqdm(total=len(requests), desc=desc, file=sys.stderr, leave=False) as bar:
        while engine.has_unfinished():
            for completion in engine.step():
                done[completion.request_id] = completion
                bar.update()
    return done, time.perf_counter() - start


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def validity(engine: LLMEngine, count: int) -> dict:
    """`count` constrained requests and `count // 2` free ones in shared batches."""
    requests, schemas = [], {}
    for i in range(count):
        schema = SCHEMAS[i % len(SCHEMAS)]
        sampled = dict(temperature=1.0, seed=i) if i % 2 else {}
        requests.append(Request(f"c{i}", prompt(i), SamplingParams(BUDGET, grammar=grammar(schema), **sampled)))
        schemas[f"c{i}"] = schema
        if i % 2:
            requests.append(Request(f"f{i}", prompt(i), SamplingParams(64, temperature=1.0, seed=i)))
    done, _ = run(engine, requests, "validity")
    good = sum(valid(done[rid].text, schema) for rid, schema in schemas.items())
    return {"valid_rate": round(good / count, 4), "constrained_requests": count, "schemas": len(SCHEMAS),
            "free_requests": len(requests) - count}


def throughput(engine: LLMEngine, count: int, rounds: int) -> dict:
    """Constrained and free rounds, alternating; the free twins generate what the constrained ones did."""
    constrained = [Request(f"c{i}", prompt(i), SamplingParams(BUDGET, grammar=grammar(SCHEMAS[i % len(SCHEMAS)])))
                   for i in range(count)]
    run(engine, constrained[:len(SCHEMAS)], "compile")  # each grammar once: what is timed is decoding
    seconds = {"constrained": 0.0, "free": 0.0}
    tokens = {"constrained": 0, "free": 0}
    lengths = None
    for r in range(rounds):
        requests = [Request(f"{req.request_id}.{r}", req.prompt_ids, req.sampling) for req in constrained]
        done, elapsed = run(engine, requests, f"constrained {r}")
        lengths = lengths or [len(done[q.request_id].token_ids) + (done[q.request_id].finish_reason == "stop")
                              for q in requests]
        seconds["constrained"] += elapsed
        tokens["constrained"] += sum(lengths)
        free = [Request(f"f{i}.{r}", q.prompt_ids, SamplingParams(n, ignore_eos=True))
                for i, (q, n) in enumerate(zip(constrained, lengths, strict=True))]
        done, elapsed = run(engine, free, f"free {r}")
        seconds["free"] += elapsed
        tokens["free"] += sum(len(c.token_ids) for c in done.values())
    rate = {k: tokens[k] / seconds[k] for k in seconds}
    return {"constrained_tokens_per_s": round(rate["constrained"], 1), "free_tokens_per_s": round(rate["free"], 1),
            "throughput_ratio": round(rate["constrained"] / rate["free"], 3)}


def loop_gaps(path: Path, bulk: int, arrivals: int) -> dict:
    """A bulk run, with `arrivals` never-seen schemas submitted during it or the same requests free."""
    def gap_p95(with_schemas: bool, salt: int) -> float:
        thread = EngineThread(LLMEngine(EngineConfig(model=str(path))))
        try:
            futures = [thread.submit(Request(f"b{i}", prompt(i), SamplingParams(96, ignore_eos=True)))
                       for i in range(bulk)]
            time.sleep(0.3)
            for i in range(arrivals):
                # a schema no request had before: its own property names
                schema = _object({f"field_{salt}_{i}_{j}": {"type": "string", "maxLength": 8 + j} for j in range(4)}
                                 | {"kind": {"enum": [f"k{salt}{i}", "other"]}})
                params = SamplingParams(24, grammar=grammar(schema)) if with_schemas else \
                    SamplingParams(24, ignore_eos=True)
                futures.append(thread.submit(Request(f"s{i}", prompt(i), params)))
                time.sleep(0.02)
            for future in futures:
                future.result()
            return thread.stats().loop_gap_p95_ms
        finally:
            thread.close()

    without, with_new = [], []
    for salt in range(2):  # alternated: drift of the machine falls on both
        without.append(gap_p95(False, salt))
        with_new.append(gap_p95(True, salt))
    return {"loop_gap_p95_ms_without_new_schemas": round(statistics.mean(without), 3),
            "loop_gap_p95_ms": round(statistics.mean(with_new), 3),
            "loop_gap_p95_added_ms": round(statistics.mean(with_new) - statistics.mean(without), 3)}


def cached_compile(path: Path) -> dict:
    engine = LLMEngine(EngineConfig(model=str(path)))
    grammars = engine.grammars
    spec = grammar(SCHEMAS[0])
    start = time.perf_counter()
    grammars.compiled(spec)
    first = time.perf_counter() - start
    times = []
    for _ in range(200):
        start = time.perf_counter()
        grammars.compiled(spec)
        times.append(time.perf_counter() - start)
    return {"first_compile_ms": round(first * 1e3, 2), "cached_compile_ms": round(statistics.median(times) * 1e3, 4)}


def schema_at_bounds(salt: int) -> dict:
    """The flat object of optional string properties with as many of them as the API's default bounds allow."""
    bounds = SchemaBounds.of(Settings())

    def flat(n: int) -> dict:
        return {"type": "object", "properties": {f"r{salt}_{i}": {"type": "string"} for i in range(n)}}

    low, high = 1, 2
    while bounds_problem(flat(high), bounds) is None:
        low, high = high, 2 * high
    while high - low > 1:  # flat(low) passes, flat(high) does not
        mid = (low + high) // 2
        low, high = (mid, high) if bounds_problem(flat(mid), bounds) is None else (low, mid)
    return flat(low)


def chat_latencies(engine: EngineProcess, count: int, every_s: float, tag: str) -> list[float]:
    """`count` short free chats, one every `every_s`: each one's seconds from submit to completion."""
    latencies: list[float] = []
    futures: list[Future] = []
    for i in range(count):
        started = time.perf_counter()
        future = engine.submit(Request(f"{tag}.{i}", prompt(i), SamplingParams(16, ignore_eos=True)))
        future.add_done_callback(lambda _, started=started: latencies.append(time.perf_counter() - started))
        futures.append(future)
        time.sleep(every_s)
    for future in futures:
        future.result()
    return latencies


def hostile(path: Path, chats: int, rounds: int) -> dict:
    """Chats on an engine process, idle and while a schema at the API's bounds compiles, rounds alternating."""
    # no compile limit: what is measured is the chats beside the whole compile, however long a loaded machine
    # makes it
    settings = WorkerSettings(model=str(path), device="cpu", grammar_compile_s=3600)
    engine = EngineProcess(functools.partial(load_backend, settings), AutoTokenizer.from_pretrained(path))
    idle, loaded, compile_s, during = [], [], [], []
    try:
        chat_latencies(engine, 8, 0.05, "warm")
        for r in range(rounds):
            idle += chat_latencies(engine, chats, 0.05, f"idle{r}")
            start = time.perf_counter()
            big = engine.submit(Request(f"hostile{r}", prompt(r), SamplingParams(8, grammar=grammar(
                schema_at_bounds(r)))))
            big.add_done_callback(lambda _, start=start: compile_s.append(time.perf_counter() - start))
            time.sleep(0.2)  # its compile has begun
            loaded += chat_latencies(engine, chats, 0.05, f"loaded{r}")
            during.append(0.0 if big.done() else 1.0)
            if big.result().error:
                raise RuntimeError(f"the schema at the bounds failed: {big.result().error}")
    finally:
        engine.close()

    def p95(values: list[float]) -> float:
        return statistics.quantiles(values, n=20)[-1]

    return {"hostile_chat_p95_ms_idle": round(1e3 * p95(idle), 1), "hostile_chat_p95_ms": round(1e3 * p95(loaded), 1),
            "hostile_chat_p95_ratio": round(p95(loaded) / p95(idle), 3),
            "hostile_compile_s": round(statistics.mean(compile_s), 2),
            "hostile_chats_during_compile": round(statistics.mean(during), 2),
            "hostile_schema_properties": len(schema_at_bounds(0)["properties"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600, help="constrained requests of the validity run")
    parser.add_argument("--throughput-requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bulk", type=int, default=64, help="bulk requests decoding while new schemas arrive")
    parser.add_argument("--hostile-chats", type=int, default=40, help="chats per round beside a hostile schema")
    parser.add_argument("--only-hostile", action="store_true", help="measure the hostile part alone")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    real = qwen3_vocabulary_model()
    result: dict = {}
    if not args.only_hostile:
        engine = LLMEngine(EngineConfig(model=str(tiny_model())))
        result |= validity(engine, args.requests)
        result |= throughput(engine, args.throughput_requests, args.rounds)
        result |= loop_gaps(real, args.bulk, 50)
        result |= cached_compile(real)
    result |= hostile(real, args.hostile_chats, args.rounds)
    report(result, args.json)


if __name__ == "__main__":
    main()
