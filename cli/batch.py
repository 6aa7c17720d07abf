"""`convoq batch ...`: submit a JSONL file, follow it with a progress bar, cancel, retry, download."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from api.http.client import Client, ConvoqError
from api.schemas.batches import BatchOut
from jobs.priority import HIGHEST, LOWEST, RANGE
from jobs.status import BATCH_SETTLED

app = typer.Typer(help="Bulk jobs from JSONL files (OpenAI Batch format or convoq lines).", no_args_is_help=True)

URL = typer.Option("http://127.0.0.1:8000", envvar="CONVOQ_API_URL", help="the convoq API")
KEY = typer.Option("", envvar="CONVOQ_API_KEY", help="an API key")


def _client(url: str, api_key: str) -> Client:
    return Client(url, api_key, timeout=300)


def _show(client: Client, batch: BatchOut) -> None:
    c = batch.request_counts
    typer.echo(f"batch {batch.id}: {batch.status}  total {c.total}  completed {c.completed}  failed {c.failed}  "
               f"cancelled {c.cancelled}  expired {c.expired}  pending {c.pending}  (priority {batch.priority})")
    if c.invalid:
        for e in client.line_errors(batch.id, limit=10):
            typer.echo(f"  line {e.line} ({e.custom_id}): {e.message}", err=True)
    if c.invalid > 10:
        typer.echo(f"  ... and {c.invalid - 10} more bad lines (see `convoq batch download --errors`)", err=True)


def follow(client: Client, batch_id: str, poll: float = 0.5) -> BatchOut:
    """A progress bar until the batch settles: items done, failed count, throughput."""
    batch = client.get_batch(batch_id)
    start = time.monotonic()
    with tqdm(total=batch.request_counts.total or None, unit="item", file=sys.stderr, desc="batch", mininterval=0.5) as bar:
        while True:
            c = batch.request_counts
            bar.total = c.total or bar.total
            done = c.completed + c.failed + c.cancelled + c.expired
            bar.update(done - bar.n)
            rate = c.completed / max(time.monotonic() - start, 1e-9)
            bar.set_postfix(completed=c.completed, failed=c.failed, status=batch.status, per_s=f"{rate:.1f}")
            if batch.status in BATCH_SETTLED:
                return batch
            time.sleep(poll)
            batch = client.get_batch(batch_id)


def _exit_code(batch: BatchOut) -> int:
    return 0 if batch.status == "completed" and batch.request_counts.failed == 0 else 1


def _write(client: Client, batch_id: str, path: Path, errors: bool) -> int:
    n = 0
    with open(path, "w") as out:
        for line in client.batch_lines(batch_id, errors=errors):
            out.write(json.dumps(line) + "\n")
            n += 1
    return n


@app.command()
def submit(
    file: Path,
    wait: Annotated[bool, typer.Option(help="follow progress until the batch settles")] = False,
    priority: Annotated[int | None, typer.Option(min=LOWEST, max=HIGHEST,
                                                 help=f"{RANGE} [default: the API's, low]")] = None,
    out: Annotated[Path | None, typer.Option(help="with --wait: write the output lines here")] = None,
    completion_window: Annotated[str | None, typer.Option(
        help="'24h' form: items unfinished by then end expired [default: the API's, 24h]")] = None,
    url: str = URL,
    api_key: str = KEY,
) -> None:
    """Upload a JSONL file as one batch."""
    if not file.is_file():
        typer.echo(f"no such file: {file}", err=True)
        raise typer.Exit(2)
    with _client(url, api_key) as client:
        try:
            batch = client.create_batch(file.read_bytes(), name=file.name, priority=priority,
                                        completion_window=completion_window)
            typer.echo(f"batch {batch.id} submitted")
            if not wait:
                return
            batch = follow(client, str(batch.id))
            _show(client, batch)
            if out is not None:
                typer.echo(f"{_write(client, str(batch.id), out, errors=False)} results written to {out}")
        except ConvoqError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(1) from exc
    raise typer.Exit(_exit_code(batch))


@app.command()
def status(batch_id: str, url: str = URL, api_key: str = KEY) -> None:
    """Show a batch's status and counts."""
    with _client(url, api_key) as client:
        batch = client.get_batch(batch_id)
        _show(client, batch)
    raise typer.Exit(0 if batch.request_counts.failed == 0 else 1)


@app.command()
def cancel(batch_id: str, url: str = URL, api_key: str = KEY) -> None:
    """Cancel the batch's queued items; finished results stay downloadable."""
    with _client(url, api_key) as client:
        _show(client, client.cancel_batch(batch_id))


@app.command()
def retry(batch_id: str, wait: bool = False, url: str = URL, api_key: str = KEY) -> None:
    """Run the batch's failed items again."""
    with _client(url, api_key) as client:
        batch = client.retry_batch(batch_id)
        if wait:
            batch = follow(client, batch_id)
        _show(client, batch)
    raise typer.Exit(_exit_code(batch) if wait else 0)


@app.command()
def download(
    batch_id: str,
    out: Annotated[Path, typer.Option(help="output lines (OpenAI Batch output format)")] = Path("output.jsonl"),
    errors: Annotated[Path | None, typer.Option(help="also write error lines here")] = None,
    url: str = URL,
    api_key: str = KEY,
) -> None:
    """Download results (and optionally errors) as JSONL."""
    with _client(url, api_key) as client:
        typer.echo(f"{_write(client, batch_id, out, errors=False)} results written to {out}")
        if errors is not None:
            typer.echo(f"{_write(client, batch_id, errors, errors=True)} errors written to {errors}")
