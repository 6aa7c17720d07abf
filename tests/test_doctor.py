"""`convoq doctor` passes on this machine, and each failure says what went wrong and what to do; a worker that
fails them refuses to start with one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from cli.doctor import (
    check_broker,
    check_compiler,
    check_database,
    check_device,
    check_engine,
    check_model,
    quantization,
)
from jobs.settings import Settings
from worker.engine_factory import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
NOWHERE = "127.0.0.1:1"  # a port nothing listens on


def convoq(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=timeout)


def test_doctor_passes_on_this_machine(service_env):
    out = convoq("doctor", env=service_env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[1] for line in lines] == [
        "device", "compiler", "kernel", "model", "engine", "broker", "database"]
    assert all(line.startswith("ok") for line in lines)
    assert "rms_norm on cpu" in out.stdout and "at migration" in out.stdout
    assert "(qwen3, 4 layers, " in out.stdout and "not quantized)" in out.stdout  # the family and quantization
    assert "GiB, KV budget " in out.stdout and "sequences at the full context" in out.stdout  # the memory plan


def test_a_mixture_of_experts_folder_gets_its_family_and_a_memory_plan_counting_its_experts(tiny_models):
    settings = WorkerSettings(model=str(tiny_models["tiny-moe"]))
    model = check_model(settings)
    assert model.ok and "(qwen3_moe, 4 layers, float32, not quantized)" in model.found
    engine = check_engine(settings)  # the engine the worker builds, through engine.builder
    assert engine.ok, engine.found
    assert "GiB (0.02 GiB of them experts), KV budget " in engine.found  # 3 layers of 8 experts: 18.9 MB in fp32


def test_an_fp8_mixture_of_experts_folder_is_named_and_its_engine_runs(fp8_moe_models):
    settings = WorkerSettings(model=str(fp8_moe_models["whole"][0]))
    model = check_model(settings)
    assert model.ok and model.found.endswith("(qwen3_moe, 3 layers, bfloat16, fp8 e4m3 blocks 128x128)")
    engine = check_engine(settings)
    assert engine.ok and "GiB of them experts), KV budget " in engine.found, engine.found


def test_each_failure_says_what_to_do(empty_database, tiny_model, tmp_path):
    broker = check_broker(Settings(broker_url=f"redis://:s3cret@{NOWHERE}/0"))
    assert not broker.ok and "cannot reach Redis" in broker.found and "start Redis" in broker.fix
    assert "s3cret" not in broker.line()

    database = check_database(Settings(database_url=f"postgresql+psycopg://convoq:s3cret@{NOWHERE}/convoq"))
    assert not database.ok and "start PostgreSQL" in database.fix and "s3cret" not in database.line()
    unmigrated = check_database(Settings(database_url=empty_database))
    assert not unmigrated.ok and "migration none" in unmigrated.found and unmigrated.fix == "run `convoq migrate`"

    # a model copied without its tokenizer, and with a shard its index names but the folder lacks
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "tokenizer.json").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    model = check_model(Settings(model=str(folder)))
    assert not model.ok and model.found == f"{folder} lacks tokenizer.json, model-00002-of-00002.safetensors"
    assert "hf download" in model.fix
    assert check_model(Settings(model=str(tiny_model))).ok
    other = tmp_path / "phi"  # a family the engine does not load is found before any weight is read
    shutil.copytree(tiny_model, other)
    (other / "config.json").write_text(json.dumps(json.loads((tiny_model / "config.json").read_text())
                                                  | {"model_type": "phi3"}))
    refused = check_model(Settings(model=str(other)))
    assert not refused.ok and "model_type 'phi3' is not supported; supported are" in refused.found
    assert "llama" in refused.fix and "qwen3" in refused.fix
    absent = check_model(Settings(model=str(tmp_path / "nothing-here")))
    assert not absent.ok and "neither an existing folder nor a Hugging Face hub id" in absent.found

    compiler = check_compiler(True, which=lambda name: None)
    assert not compiler.ok and "cannot build a kernel's launcher" in compiler.found
    assert "apt-get install gcc" in compiler.fix
    assert check_compiler(True, which=lambda name: f"/usr/bin/{name}").ok
    assert check_compiler(False, which=lambda name: None).ok  # a CPU compiles no kernel


def test_a_worker_that_fails_the_checks_refuses_to_start_with_one_line(service_env):
    out = convoq("worker", env={**service_env, "CONVOQ_BROKER_URL": f"redis://{NOWHERE}/0"}, timeout=120)
    assert out.returncode == 2
    refusal = [line for line in out.stderr.splitlines() if "refuses to start" in line]
    assert len(refusal) == 1 and "broker: cannot reach Redis" in refusal[0] and "fix: start Redis" in refusal[0]


def test_a_tensor_parallel_worker_needs_as_many_gpus_as_ranks(monkeypatch, tiny_model):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    device = check_device(WorkerSettings(model=str(tiny_model), device="cuda", tensor_parallel=2))
    assert not device.ok and "CONVOQ_TENSOR_PARALLEL=2 splits the model over 2 GPUs; 1 visible here" in device.found
    assert "--gpus" in device.fix


def test_the_quantization_in_a_few_words():
    assert quantization({}) == "not quantized"
    assert quantization({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                                 "activation_scheme": "dynamic"}}) == "fp8 e4m3 blocks 128x128"


def test_an_fp8_checkpoint_is_named_and_a_quantization_the_engine_lacks_is_refused(fp8_models, tmp_path):
    fp8, _ = fp8_models["tiny-blocks"]
    model = check_model(Settings(model=str(fp8)))
    assert model.ok and model.found.endswith("(qwen3, 2 layers, bfloat16, fp8 e4m3 blocks 128x128)")
    other = tmp_path / "int4"
    shutil.copytree(fp8, other)
    (other / "config.json").write_text(json.dumps(json.loads((fp8 / "config.json").read_text())
                                                  | {"quantization_config": {"quant_method": "awq", "bits": 4}}))
    refused = check_model(Settings(model=str(other)))
    assert not refused.ok and "quant_method 'awq' is not supported; only 'fp8'" in refused.found
    assert "FP8 with 128x128 weight blocks" in refused.fix
