"""`convoq tune`: the sweep measures each setting on real engine runs, and the pick follows the plateau rule."""

from __future__ import annotations

from cli.tune import Trial, recommend, sweep
from engine.config import EngineConfig


def test_sweep_measures_every_setting(tiny_model):
    payloads = [{"kind": "chat", "priority": 5, "messages": [{"role": "user", "content": f"Where is order {i}?"}],
                 "sampling": {"max_new_tokens": 6}} for i in range(6)]
    trials = sweep(EngineConfig(model=str(tiny_model), kv_cache_memory=64 * 2**20), payloads, [2, 8], [256, 4])
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
