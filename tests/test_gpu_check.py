"""The GPU check's wiring, on CPU: its dry run builds every model and engine it would on a GPU, at tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import gpu_check
from bench.common import MODELS_DIR
from jobs.settings import DATA_DIR

pytestmark = pytest.mark.usefixtures("single_thread")


def test_dry_run_writes_one_report_with_every_part(tmp_path):
    out = tmp_path / "gpu_check.json"
    # the slow parts (transformers' generate, the mixed-load phases) run in `--dry-run` without `--parts`
    chosen = ["kernels", "decode_floor", "step_overhead", "graphs_identity", "memory", "fp8", "moe_graphs", "speculative"]
    assert gpu_check.main(["--dry-run", "--parts", ",".join(chosen), str(out)]) == 0
    parts = json.loads(out.read_text())["parts"]
    assert list(parts) == chosen
    assert "skipped" in parts["kernels"]
    for shape in ("8b", "32b"):
        assert parts["decode_floor"][shape]["ms_per_token"] > 0 and parts["decode_floor"][shape]["weights_bytes"] > 0
    overhead = parts["step_overhead"]
    assert overhead["seqs"] == 32 and overhead["greedy_host_ms_per_step"] > 0 and overhead["sampled_sample_ms"] > 0
    identity = parts["graphs_identity"]
    assert identity["ok"] and identity["requests"] == 6 and identity["differing_requests"] == []
    assert 0 < identity["piece_graph_steps"] <= identity["steps"]  # the dry run's pieces are plain calls
    memory = parts["memory"]
    assert memory["pool_bytes_end"] > memory["pool_bytes_start"]  # the load made the pool grow
    assert memory["ok"] and memory["pool_bytes_end"] <= memory["kv_budget_bytes"]
    fp8 = parts["fp8"]
    assert fp8["identical"] and fp8["fp8_linear"] == "dequant_linear" and fp8["projections_fp8_over_bf16"] < 0.51
    assert fp8["decode_8b"]["fp8"]["weights_bytes"] < fp8["decode_8b"]["bf16"]["weights_bytes"]
    moe_fp8 = fp8["moe"]
    assert moe_fp8["identical"] and moe_fp8["experts_fp8_over_bf16"] < 0.51
    assert moe_fp8["fp8_experts"] == "kernels.torch_ops.fp8_fused_moe" and fp8["moe_graphs"]["ok"]
    moe = parts["moe_graphs"]
    assert moe["ok"] and moe["requests"] == 6 and 0 < moe["piece_graph_steps"] <= moe["steps"]
    for batch in (1, 16):
        drafts = parts["speculative"][f"batch_{batch}"]
        assert drafts["off_tok_s"] > 0 and drafts["ngram_tok_s"] > 0 and drafts["identical"]


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(check):
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(gpu_check.PARTS, "kernels", broken)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--parts", "kernels,memory", str(out)]) == 1
    parts = json.loads(out.read_text())["parts"]
    assert "no such kernel" in parts["kernels"]["error"] and parts["kernels"]["ok"] is False
    assert parts["memory"]["ok"]


def test_the_check_imports_nothing_of_the_service():
    """A GPU machine may have only the engine's dependencies: with the service's settings hidden, the check and
    every part's benchmark still import, and their checkpoints are where the service's default model is."""
    hide = ("import sys; sys.modules['pydantic_settings'] = None; "
            "import bench.gpu_check, bench.mixed, bench.step_overhead, bench.speculative, bench.copy_model; "
            "print(bench.gpu_check.tiny_model.__module__)")
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "bench.common"
    assert MODELS_DIR == DATA_DIR / "models"
