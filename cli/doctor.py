"""`convoq doctor`: can this machine run convoq? Each check says what it found and, when it fails, what to do.

    convoq doctor [--no-engine]

The checks, in order: the device (and on CUDA its driver), a C compiler where Triton needs one (it builds its
launcher with one the first time a kernel runs on a GPU), one Triton kernel against its PyTorch reference
(compiled on a GPU; in Triton's interpreter on a CPU), the model folder, one engine step on that model, the
broker and the database (reachable, migrated). `convoq worker` runs the same checks, but for the engine step
(its own start is one) and for the kernel where the engine will not run the kernels (a CPU), before it consumes
anything, and refuses to start with one line saying what failed and what to do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jobs.settings import Settings, redact

KERNEL_TIMEOUT_S = 300.0  # a first compile on a GPU takes seconds; the interpreter on a slow CPU, a few more


@dataclass
class Check:
    name: str
    ok: bool
    found: str  # what was found, or what went wrong
    fix: str = ""  # what to do about a failure

    def line(self) -> str:
        head = f"{'ok  ' if self.ok else 'FAIL'}  {self.name:<10} {self.found}"
        return head if self.ok or not self.fix else f"{head}\n      fix: {self.fix}"


def device_kind(settings: Settings) -> str:
    """Where the engine will run: `cuda` or `cpu` (`CONVOQ_DEVICE`, `auto` by default)."""
    import torch

    wanted = getattr(settings, "device", "auto")
    return ("cuda" if torch.cuda.is_available() else "cpu") if wanted == "auto" else wanted.split(":")[0]


def uses_kernels(settings: Settings) -> bool:
    """Whether the engine will run the Triton kernels (`EngineConfig.attention_backend`)."""
    backend = getattr(settings, "attention_backend", "auto")
    return settings.backend == "engine" and (backend == "triton" or (backend == "auto" and
                                                                       device_kind(settings) == "cuda"))


def check_device(settings: Settings) -> Check:
    import torch

    kind = device_kind(settings)
    if kind == "cpu":
        return Check("device", True, f"cpu (torch {torch.__version__}, {os.cpu_count()} cores): the engine runs on "
                     "the CPU")
    if not torch.cuda.is_available():
        return Check("device", False, f"CONVOQ_DEVICE asks for {kind}, but torch {torch.__version__} sees no CUDA "
                     f"device (built for CUDA {torch.version.cuda})",
                     "check `nvidia-smi` on the host and that the container is given the GPU (compose: "
                     "deploy.resources.reservations.devices), or set CONVOQ_DEVICE=cpu")
    ranks, visible = getattr(settings, "tensor_parallel", 1), torch.cuda.device_count()
    if visible < ranks:
        return Check("device", False, f"CONVOQ_TENSOR_PARALLEL={ranks} splits the model over {ranks} GPUs; "
                     f"{visible} visible here (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                     f"give the worker {ranks} GPUs (`convoq worker --gpus` groups them), or lower "
                     "CONVOQ_TENSOR_PARALLEL")
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    return Check("device", True, f"{name} (compute capability {major}.{minor}, {torch.cuda.device_count()} visible, "
                 f"torch {torch.__version__}, CUDA {torch.version.cuda}, driver {driver_version()})")


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def check_compiler(kernels_compiled: bool, which: Callable[[str], str | None] = shutil.which) -> Check:
    """Triton compiles the launcher of a kernel with the C compiler `$CC` names, else `cc`, `gcc` or `clang`."""
    if not kernels_compiled:
        return Check("compiler", True, "not needed: no Triton kernel is compiled here (CPU)")
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    found = next((path for name in names if (path := which(name))), None)
    if found is None:
        return Check("compiler", False, f"no C compiler ({', '.join(names)}): Triton cannot build a kernel's "
                     "launcher, so the worker would fail at its first kernel",
                     "install one (Debian: `apt-get install gcc libc6-dev`; the convoq image has it) or set CC")
    return Check("compiler", True, found)


def check_kernel(settings: Settings) -> Check:
    cpu = device_kind(settings) == "cpu"
    env = {**os.environ, "TRITON_INTERPRET": "1"} if cpu else dict(os.environ)
    try:
        out = subprocess.run([sys.executable, "-m", "engine.kernel_probe"],
                             capture_output=True, text=True, env=env, timeout=KERNEL_TIMEOUT_S,
                             cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return Check("kernel", False, f"a Triton kernel did not finish within {KERNEL_TIMEOUT_S:.0f} s",
                     "see `python -m kernels.compile_check` and the Triton cache (TRITON_CACHE_DIR)")
    found = (out.stdout.strip().splitlines() or out.stderr.strip().splitlines() or ["no output"])[-1]
    if out.returncode != 0:
        return Check("kernel", False, found, "a C compiler (see above), a Triton that matches torch "
                     "(`pip install torch` brings its own), or a GPU Triton supports")
    return Check("kernel", True, found + (" (Triton's interpreter: no GPU)" if cpu else ""))


def check_model(settings: Settings) -> Check:
    """The model folder has what the worker loads: config, tokenizer with its chat template, every weight shard."""
    import json

    from jobs.model_source import ModelNotFound, resolve_model

    try:
        folder = resolve_model(settings.model)
    except ModelNotFound as exc:
        return Check("model", False, str(exc), "set CONVOQ_MODEL to a complete model folder or a hub id")
    fetch = f"copy the complete model folder (e.g. `hf download Qwen/Qwen3-8B --local-dir {folder}`)"
    missing = [name for name in ("config.json", "tokenizer_config.json") if not (folder / name).is_file()]
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        missing.append("tokenizer.json")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing += [shard for shard in shards if not (folder / shard).is_file()]
    elif not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        return Check("model", False, f"{folder} lacks {', '.join(missing)}", fetch)
    from engine.model.families import FAMILIES, read_shape

    try:
        shape = read_shape(folder)
    except ValueError as exc:  # a family or a field the engine refuses, by name
        return Check("model", False, str(exc), f"use a checkpoint of a supported family ({', '.join(sorted(FAMILIES))})"
                     " in bf16, fp32 or FP8 with 128x128 weight blocks (as Qwen's *-FP8)")
    config = json.loads((folder / "config.json").read_text())
    return Check("model", True, f"{folder} ({shape.family}, {shape.num_layers} layers, "
                 f"{config.get('torch_dtype', config.get('dtype', '?'))}, {quantization(config)})")


def quantization(config: dict) -> str:
    """The checkpoint's quantization in a few words: `none`, or its method, format and block."""
    quant = config.get("quantization_config")
    if not quant:
        return "not quantized"
    block = "x".join(str(n) for n in quant.get("weight_block_size") or ())
    return " ".join(str(part) for part in (quant.get("quant_method"), quant.get("fmt"),
                                           f"blocks {block}" if block else None) if part)


def check_engine(settings: Settings) -> Check:
    """One request through the backend the worker would load, step by step until it finishes."""
    from engine.interface import Request, SamplingParams
    from worker.engine_factory import load_backend

    try:
        backend = load_backend(settings)
        try:
            backend.add_request(Request("doctor", [1, 2, 3, 4], SamplingParams(max_new_tokens=4, ignore_eos=True)))
            done = []
            while backend.has_unfinished():
                done += backend.step()
            report = getattr(backend, "memory_report", None)  # our engine's; transformers' has none
            plan = f"; {memory_plan(report())}" if report is not None else ""
        finally:
            if (close := getattr(backend, "close", None)) is not None:
                close()  # what the engine holds beyond this process (a tensor-parallel engine's other ranks)
    except Exception as exc:  # anything the engine raises is what the worker would die of
        return Check("engine", False, f"{type(exc).__name__}: {exc}", "see the message; CONVOQ_DEVICE, "
                     "CONVOQ_DTYPE and the engine's CONVOQ_* settings must suit this device and model")
    if not done or not done[0].ok:
        return Check("engine", False, f"the step ended {done[0].finish_reason if done else 'with nothing'}"
                     f": {done[0].error if done else ''}", "see the worker's log for the engine's error")
    return Check("engine", True, f"{settings.backend}: one request of 4 tokens generated {len(done[0].token_ids)}"
                 f"{plan}")


def memory_plan(report: dict[str, int]) -> str:
    """An engine's `memory_report` as an operator reads it: the weights, the KV cache and the work it holds."""
    gib = 1 << 30
    experts = f" ({report['expert_bytes'] / gib:.2f} GiB of them experts)" if report["expert_bytes"] else ""
    return (f"weights {report['weights_bytes'] / gib:.2f} GiB{experts}, "
            f"KV budget {report['kv_budget_bytes'] / gib:.2f} GiB ({report['kv_bytes_per_token']:,} B a token): "
            f"{report['max_tokens']:,} tokens in all, {report['max_batch_at_max_len']} sequences at the full context")


def check_broker(settings: Settings) -> Check:
    import redis

    from broker.redis_layout import is_redis

    url = settings.broker_url.get_secret_value()
    if not is_redis(settings):
        return Check("broker", True, f"{redact(url)} (not Redis: not checked here)")
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        info = client.info("server")
        client.close()
    except redis.RedisError as exc:
        return Check("broker", False, f"cannot reach Redis at {redact(url)}: {exc}",
                     "start Redis (compose's redis service, or `redis-server`) or set CONVOQ_BROKER_URL")
    return Check("broker", True, f"Redis {info.get('redis_version', '?')} at {redact(url)}")


def check_database(settings: Settings) -> Check:
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine
    from sqlalchemy.exc import SQLAlchemyError

    from migrations.apply import alembic_config

    url = settings.database_url.get_secret_value()
    shown = redact(url)
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3} if url.startswith("postgresql") else {})
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
        engine.dispose()
    except SQLAlchemyError as exc:
        return Check("database", False, f"cannot reach {shown}: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                     "start PostgreSQL (compose's postgres service) or set CONVOQ_DATABASE_URL")
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    if current != head:
        return Check("database", False, f"{shown} is at migration {current or 'none'}, not {head}",
                     "run `convoq migrate`")
    return Check("database", True, f"{shown} at migration {head}")


def run_checks(settings: Settings, engine: bool = True, kernel: bool = True, services: bool = True) -> list[Check]:
    """The checks, each run whatever the others found; `engine=False` leaves the engine step out, `kernel=False`
    the Triton kernel unless the engine will run the kernels, `services=False` the broker and the database."""
    checks = [check_device(settings)]
    if checks[0].ok:
        kernels = uses_kernels(settings)
        checks.append(check_compiler(kernels and device_kind(settings) == "cuda"))
        if (kernel or kernels) and checks[-1].ok:
            checks.append(check_kernel(settings))
    checks.append(check_model(settings))
    if engine and all(c.ok for c in checks):
        checks.append(check_engine(settings))
    if services:
        checks += [check_broker(settings), check_database(settings)]
    return checks
