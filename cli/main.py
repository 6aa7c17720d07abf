"""The `convoq` command."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.batch import KEY, URL
from cli.batch import app as batch_app
from jobs.priority import HIGHEST, LOWEST, RANGE
from jobs.settings import get_settings

if TYPE_CHECKING:
    from uuid import UUID

    from api.http.client import Client
    from api.schemas.jobs import JobOut

app = typer.Typer(help="convoq: queue-fed batch inference for Qwen3, Qwen2, Llama and Mistral models.",
                  no_args_is_help=True)
app.add_typer(batch_app, name="batch")


@app.command()
def api(host: str = "127.0.0.1", port: int = 8000, workers: int = 1) -> None:
    """Run the producer API (it never loads a model)."""
    import uvicorn

    # httptools and uvloop, not the pure-Python h11 parser and asyncio's loop: on a small machine the API's
    # share of a job's CPU is mostly the HTTP round trip (bench.pipeline's cpu_ms_per_job). The client address
    # (what failed authentications are counted by) comes from X-Forwarded-For only when a named proxy sent it.
    uvicorn.run("api.app:serving_app", factory=True, host=host, port=port, workers=workers, log_level="warning",
                http="httptools", loop="uvloop", proxy_headers=True,
                forwarded_allow_ips=get_settings().forwarded_allow_ips)


@app.command()
def worker(
    concurrency: Annotated[int | None, typer.Option(help="Celery threads feeding the engine")] = None,
    queues: Annotated[str | None, typer.Option(help="comma-separated, most urgent first")] = None,
    loglevel: str = "info",
    gpus: Annotated[str | None, typer.Option(
        help="`all` or GPU ids (0,1,...): one worker process per GPU (per CONVOQ_TENSOR_PARALLEL GPUs), each "
             "pinned to its own")] = None,
) -> None:
    """Run a worker: one engine on this process's device, fed by many Celery threads."""
    import logging
    import os

    from broker.affinity import consumed_queues
    from broker.app import worker_node_name
    from cli.doctor import run_checks
    from worker.engine_factory import WorkerSettings
    from worker.exits import REFUSED
    from worker.tasks import worker_app, worker_name

    settings = WorkerSettings()
    if gpus is not None:
        from cli.gpus import Supervisor, gpu_list, placements, visible_gpus

        try:
            places = placements(gpu_list(gpus, visible_gpus), settings.worker_metrics_port, settings.tensor_parallel)
        except ValueError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from exc
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/supervisor] %(message)s")
        passed = [f"--loglevel={loglevel}", *([f"--concurrency={concurrency}"] if concurrency else []),
                  *([f"--queues={queues}"] if queues else [])]
        raise typer.Exit(Supervisor(places, passed).run())
    refused = [c for c in run_checks(settings, engine=False, kernel=False) if not c.ok]
    if refused:
        logging.basicConfig()
        logging.getLogger("convoq.worker").critical("convoq worker refuses to start: %s", "; ".join(
            f"{c.name}: {c.found} (fix: {c.fix})" for c in refused))
        raise typer.Exit(REFUSED)
    name = worker_name()
    listed = queues.split(",") if queues else None
    # the engine is built and the database reached before anything is consumed, or the process exits
    # `worker.exits.NOT_STARTED` (`worker.tasks.Worker.start`)
    worker_app(settings, name, listed).worker_main([
        "worker",
        "--pool=threads",
        f"--concurrency={concurrency or settings.worker_concurrency}",
        # interactive first: on equal broker priority BRPOP serves the first listed queue
        f"--queues={','.join(consumed_queues(settings, name, listed))}",
        "--task-events",
        "--without-mingle",
        "--without-gossip",
        f"--loglevel={loglevel}",
        f"--hostname={worker_node_name(os.getpid())}",
    ])


@app.command()
def doctor(
    engine: Annotated[bool, typer.Option(help="run one engine step on the model (loads it)")] = True,
    services: Annotated[bool, typer.Option(help="reach Redis and PostgreSQL")] = True,
) -> None:
    """Check that this machine can run convoq: device and driver, C compiler, one Triton kernel, the model, one
    engine step, Redis, PostgreSQL. Prints each check, and for each failure what to do; exits 1 on any."""
    from cli.doctor import run_checks
    from worker.engine_factory import WorkerSettings

    checks = run_checks(WorkerSettings(), engine=engine, services=services)
    for check in checks:
        typer.echo(check.line())
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


@app.command()
def flower(port: Annotated[int | None, typer.Option()] = None) -> None:
    """Run Flower on our Celery app, behind basic auth from CONVOQ_FLOWER_USER / CONVOQ_FLOWER_PASSWORD."""
    from broker.app import create_celery

    settings = get_settings()
    celery = create_celery(settings)
    if not settings.flower_password.get_secret_value():
        typer.echo("set CONVOQ_FLOWER_PASSWORD (and CONVOQ_FLOWER_USER): Flower shows every job", err=True)
        raise typer.Exit(2)
    celery.start([
        "flower",
        f"--port={port or settings.flower_port}",
        f"--basic-auth={settings.flower_user}:{settings.flower_password.get_secret_value()}",
    ])


@app.command()
def migrate(revision: str = "head", down: bool = False) -> None:
    """Bring the database schema to `revision` (alembic upgrade head), or down to it with --down."""
    from migrations.apply import downgrade, upgrade

    url = get_settings().database_url.get_secret_value()
    (downgrade if down else upgrade)(url, "base" if down and revision == "head" else revision)
    typer.echo(f"database at {revision if not down else 'downgraded'}")


@app.command()
def reconcile() -> None:
    """One sweep of the reconciler now (unless a worker is sweeping): hand back jobs whose lease expired, end
    those past their deadline, send again queued jobs with no message."""
    from broker.app import create_celery
    from store.connections import make_db_engine, make_sessions
    from worker.sweep import Sweeper

    settings = get_settings()
    sweeper = Sweeper(make_sessions(make_db_engine(settings.database_url.get_secret_value())), create_celery(settings), settings)
    typer.echo(json.dumps(sweeper.sweep(force=True) or {"skipped": "another process holds the sweep's lock"}))


@app.command()
def prune(
    older_than: Annotated[str | None, typer.Option(
        help="a span: 90m, 12h, 30d, 2w (default: CONVOQ_RETENTION_DAYS in days)")] = None,
    dry_run: Annotated[bool, typer.Option(help="count what would go, delete nothing")] = False,
    chunk: Annotated[int, typer.Option(min=1, help="rows deleted per transaction")] = 1000,
) -> None:
    """Delete finished jobs (with results and timings), settled batches and long-silent workers rows older than
    the cut-off, a chunk per transaction; print what went (or would go) as a line and as JSON."""
    from cli.prune import run_prune
    from cli.spans import parse_span
    from store.retention import retention_period

    settings = get_settings()
    span = retention_period(settings) if older_than is None else parse_span(older_than)
    if span is None:
        why = "give a span like 12h, 30d, 2w" if older_than is not None else "CONVOQ_RETENTION_DAYS is 0 (keep forever)"
        raise typer.BadParameter(why, param_hint="--older-than")
    report = run_prune(settings.database_url.get_secret_value(), span, dry_run, chunk)
    typer.echo(report.summary())
    typer.echo(json.dumps({**report.__dict__, "cutoff": report.cutoff.isoformat()}))


@app.command()
def report(
    since: Annotated[str, typer.Option(help="ISO 8601 time, or a span back from now: 30m, 2h, 1d")] = "1d",
    out: Path = Path("report.html"),
) -> None:
    """Write one HTML page: latency per priority, throughput, interactive latency against bulk throughput, queue
    wait vs compute, batch sizes, prefix reuse."""
    from datetime import UTC, datetime

    from cli.report import parse_since, write_report

    try:
        start = parse_since(since, datetime.now(UTC))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from exc
    settings = get_settings()
    typer.echo(str(write_report(settings, start, out)))


@app.command()
def tune(
    jobs: Annotated[Path | None, typer.Option(help="JSONL of batch lines; default: recent jobs from the database")] = None,
    sample: Annotated[int, typer.Option(min=1, help="jobs to replay per setting")] = 64,
    seqs: Annotated[str, typer.Option(help="max_num_seqs values to try")] = "8,16,32,64,128,256",
    tokens: Annotated[str, typer.Option(help="max_num_batched_tokens values to try")] = "1024,2048,4096,8192",
    plateau: Annotated[float, typer.Option(help="throughput within this fraction of the best counts as best")] = 0.05,
) -> None:
    """Sweep the engine's batch limits on real jobs; print throughput, latency, memory and the settings to use."""
    from cli.tune import recommend, sample_from_database, sample_from_file, sweep
    from worker.engine_factory import WorkerSettings

    settings = WorkerSettings()
    sampled = sample_from_file(str(jobs), sample) if jobs else sample_from_database(settings.database_url.get_secret_value(), sample)
    if not sampled:
        typer.echo("no jobs to replay: pass --jobs FILE or run some jobs first", err=True)
        raise typer.Exit(2)
    trials = sweep(settings, sampled, [int(x) for x in seqs.split(",")], [int(x) for x in tokens.split(",")])
    typer.echo(f"{'max_num_seqs':>12} {'max_tokens':>10} {'tok/s':>9} {'p50 s':>7} {'p95 s':>7} {'peak KV':>8}")
    for t in trials:
        typer.echo(f"{t.max_num_seqs:>12} {t.max_num_batched_tokens:>10} {t.tok_s:>9.1f} {t.latency_p50_s:>7.2f} "
                   f"{t.latency_p95_s:>7.2f} {t.peak_kv_usage:>7.0%}{'' if t.fits else '  over 90%'}")
    best = recommend(trials, plateau)
    if best is None:
        typer.echo("every setting took the KV cache past 90% of its budget: raise CONVOQ_KV_CACHE_MEMORY", err=True)
        raise typer.Exit(1)
    typer.echo(f"use: CONVOQ_MAX_NUM_SEQS={best.max_num_seqs} CONVOQ_MAX_NUM_BATCHED_TOKENS={best.max_num_batched_tokens}"
               f"  ({best.tok_s:.0f} tok/s, p95 {best.latency_p95_s:.2f} s, peak KV {best.peak_kv_usage:.0%})")
    typer.echo(json.dumps({"trials": [t.__dict__ for t in trials], "recommended": best.__dict__}))


@app.command("config-docs")
def config_docs(
    check: Annotated[bool, typer.Option(help="only compare: exit 1 when the page is out of date")] = False,
) -> None:
    """Write the configuration reference (docs/configuration.md) from the settings and the engine's knobs."""
    from cli.config_docs import main

    raise typer.Exit(main(["--check"] if check else []))


@app.command("tiny-model")
def tiny_model(
    path: Path,
    preset: str = "tiny",
    seed: int = 0,
    tokenizer: Annotated[Path | None, typer.Option(
        help="a folder with the real Qwen3 tokenizer files (e.g. tests/data/qwen3-tokenizer) instead of a small "
             "trained one")] = None,
    fp8: Annotated[bool, typer.Option(
        help="write it as Qwen's block-FP8 checkpoints are (`Qwen/Qwen3-*-FP8`): `tiny-blocks` and "
             "`tiny-moe-blocks` are the presets made of whole 128x128 blocks")] = False,
) -> None:
    """Write a small random checkpoint folder of a preset (`tiny`, Qwen3; `tiny-moe`, Qwen3-MoE; `tiny-llama`,
    `tiny-mistral`, `tiny-qwen2`, ...), which loads like a real one of its family."""
    from cli.tiny_model import build_tiny_model, write_fp8

    if not fp8:
        typer.echo(str(build_tiny_model(path, preset=preset, seed=seed, tokenizer=tokenizer)))
        return
    with tempfile.TemporaryDirectory(prefix="convoq-fp8-") as scratch:
        source = build_tiny_model(Path(scratch) / "source", preset=preset, seed=seed, tokenizer=tokenizer)
        typer.echo(str(write_fp8(source, path, Path(scratch) / "dequantized")[0]))


@app.command()
def submit(
    text: Annotated[str, typer.Argument(help="the user message (or transcript with --kind summarize)")],
    url: str = URL,
    api_key: str = KEY,
    kind: str = "chat",
    priority: Annotated[int | None, typer.Option(min=LOWEST, max=HIGHEST, help=f"{RANGE} [default: the API's]")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="[default: the API's]")] = None,
    deadline_s: Annotated[float | None, typer.Option(help="seconds: unfinished by then, the job ends expired")] = None,
    wait: Annotated[float, typer.Option(help="seconds to wait for the result")] = 60.0,
    stream: Annotated[bool, typer.Option(help="print the text as it is generated, then the job's status")] = False,
) -> None:
    """Submit one job over the HTTP API and print it as JSON once it finishes (or its text as it comes)."""
    from api.http.client import Client, ConvoqError
    from jobs.schemas import JobIn

    try:
        given = {} if priority is None else {"priority": priority}
        if max_new_tokens is not None:
            given["sampling"] = {"max_new_tokens": max_new_tokens}
        if deadline_s is not None:
            given["deadline_s"] = deadline_s
        job = JobIn.model_validate({"messages": [{"role": "user", "content": text}], "kind": kind, **given})
    except ValueError as exc:
        typer.echo(f"invalid job: {exc}", err=True)
        raise typer.Exit(2) from exc
    with Client(url, api_key) as client:
        try:
            accepted = client.submit(job)
            if stream:
                out = _print_stream(client, accepted.id)
            else:
                out = client.wait(accepted.id, timeout=wait) if wait > 0 else client.get(accepted.id)
        except ConvoqError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(1) from exc
    if not stream:
        typer.echo(json.dumps(out.model_dump(mode="json"), indent=2))
    if out.status != "succeeded" and (stream or out.status == "failed"):
        raise typer.Exit(1)


def _print_stream(client: Client, job_id: UUID) -> JobOut:
    """Print a job's text as it grows (events carry all of it so far), then its status; returns the job."""
    shown = ""
    for event in client.stream(job_id):
        if event.event == "text" and event.text.startswith(shown):
            sys.stdout.write(event.text[len(shown):])
            sys.stdout.flush()
            shown = event.text
        elif event.event == "result":
            job = event.job
            final = job.result.text if job.result is not None else ""
            if final.startswith(shown):  # the stored text (stop strings cut) may end before what streamed
                sys.stdout.write(final[len(shown):])
            sys.stdout.write("\n")
            sys.stdout.flush()
            reason = job.result.finish_reason if job.result is not None else job.error
            typer.echo(f"[{job.id} {job.status.value}: {reason}]", err=True)
            return job
        elif event.event == "error":  # the job ran again and wrote another text: what was printed is void
            typer.echo(f"\n[{event.error}]", err=True)
            job = client.wait(job_id)
            typer.echo(job.result.text if job.result is not None else "")
            return job
    typer.echo("the event stream ended before the job did; see `GET /v1/jobs/ID`", err=True)
    raise typer.Exit(1)


@app.command()
def cancel(job_id: str, url: str = URL, api_key: str = KEY) -> None:
    """Cancel a job: queued, it never runs; running, it stops within an engine step and keeps its text so far."""
    from api.http.client import Client, ConvoqError

    with Client(url, api_key) as client:
        try:
            job = client.cancel(job_id)
        except ConvoqError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(1) from exc
    state = "cancel requested (it stops within an engine step)" if job.status == "running" else job.status.value
    typer.echo(f"job {job.id}: {state}")


@app.command()
def demo(max_new_tokens: int = 160) -> None:
    """Summarize the bundled transcripts into JSON records end to end on embedded defaults, with urgent chats
    overtaking. `max_new_tokens`: each summary's budget (a record takes up to about 120 with the tiny model)."""
    from cli.demo import run_demo

    sys.exit(run_demo(max_new_tokens))


if __name__ == "__main__":
    app()
