"""`convoq tune`: the sweep measures each setting on real engine runs, and the pick follows the plateau rule."""

from __future__ import annotations

import engine.llm_engine
from cli.tune import Trial, recommend, sweep
from engine import builder
from jobs.schemas import JobIn
from worker.engine_factory import WorkerSettings, engine_options
from worker.runs import RUN_BY_KIND
from worker.summarize import summarize


def test_sweep_measures_every_setting(tiny_model):
    jobs = [JobIn(messages=[{"role": "user", "content": f"Where is order {i}?"}], sampling={"max_new_tokens": 6})
            for i in range(6)]
    trials = sweep(WorkerSettings(model=str(tiny_model), kv_cache_memory=64 * 2**20, device="cpu"), jobs, [2, 8], [256, 4])
    # a token budget below the sequence limit could not decode every sequence: (8, 4) is not tried
    assert [(t.max_num_seqs, t.max_num_batched_tokens) for t in trials] == [(2, 256), (2, 4), (8, 256)]
    for t in trials:
        assert t.tok_s > 0 and 0 < t.latency_p50_s <= t.latency_p95_s and 0 < t.peak_kv_usage < 0.9


def test_recommend_takes_the_smallest_setting_on_the_plateau_under_the_memory_ceiling():
    trials = [Trial(8, 1024, 100, 1, 2, 0.3), Trial(32, 1024, 190, 1, 2, 0.5), Trial(64, 2048, 198, 1, 2, 0.7),
              Trial(256, 8192, 260, 1, 2, 0.95)]  # the fastest passes 90% of the KV budget: not a candidate
    assert (recommend(trials).max_num_seqs, recommend(trials).max_num_batched_tokens) == (32, 1024)
    assert recommend(trials, plateau=0.0).max_num_seqs == 64
    assert recommend([Trial(8, 1024, 100, 1, 2, 0.95)]) is None


def test_tune_runs_the_engine_the_worker_runs_and_map_reduces_long_transcripts(tiny_model, monkeypatch):
    settings = WorkerSettings(model=str(tiny_model), device="cpu", kv_cache_memory=64 * 2**20, attention_policy="sliding:256",
                        enable_prefix_cache=False, host_cache_memory=0)
    configs = []
    engine_class = engine.llm_engine.LLMEngine
    monkeypatch.setattr(engine.llm_engine, "LLMEngine", lambda config: configs.append(config) or engine_class(config))
    long = " ".join(f"turn {i}: my parcel number {i} has not arrived, please check the tracking." for i in range(300))
    summary = JobIn(kind="summarize", messages=[{"role": "user", "content": long}], sampling={"max_new_tokens": 16})
    outcomes = []

    def recording(run):
        outcomes.append(summarize(run))
        return outcomes[-1]

    monkeypatch.setitem(RUN_BY_KIND, "summarize", recording)
    [trial] = sweep(settings, [summary], [8], [512])
    # the engine tune built is the worker's, but for the two limits it sweeps
    [tuned] = configs
    worker = builder.engine_config(settings.model, engine_options(settings))
    assert (tuned.attention_policy, tuned.enable_prefix_cache, tuned.host_cache_memory) == ("sliding:256", False, 0)
    assert (tuned.max_num_seqs, tuned.max_num_batched_tokens) == (8, 512)
    assert {**tuned.__dict__, "max_num_seqs": 0, "max_num_batched_tokens": 0} == \
        {**worker.__dict__, "max_num_seqs": 0, "max_num_batched_tokens": 0}
    [outcome] = outcomes  # a transcript several times the context, map-reduced rather than cut
    assert outcome.completion.ok and outcome.chunks >= 3 and trial.tok_s > 0
