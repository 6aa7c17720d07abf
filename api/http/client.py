"""The producer client: submit jobs, read them, wait for them, follow them, cancel them. Sync and async,
same pydantic models."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from uuid import UUID

import httpx

from api.schemas.batches import BatchLineError, BatchOut
from api.schemas.jobs import JobAccepted, JobEvent, JobOut
from jobs.schemas import JobIn
from jobs.status import TERMINAL


class ConvoqError(RuntimeError):
    def __init__(self, status_code: int, detail: object) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


def _check(response: httpx.Response) -> dict:
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = response.text
        raise ConvoqError(response.status_code, detail)
    return response.json()


def _headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


class SSEParser:
    """Server-Sent Events, fed line by line: each complete event comes out as a `JobEvent`."""

    def __init__(self) -> None:
        self.data: list[str] = []

    def feed(self, line: str) -> JobEvent | None:
        if line.startswith("data:"):
            self.data.append(line[5:].lstrip())
        elif not line and self.data:
            event, self.data = JobEvent.model_validate_json("\n".join(self.data)), []
            return event
        return None  # `event:` repeats the event's own name; `:` lines keep the connection alive


def _events(lines: Iterable[str]) -> Iterator[JobEvent]:
    parser = SSEParser()
    for line in lines:
        if (event := parser.feed(line)) is not None:
            yield event


class Client:
    def __init__(self, base_url: str, api_key: str, timeout: float = 30.0) -> None:
        self.http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout)

    def submit(self, job: JobIn) -> JobAccepted:
        return JobAccepted.model_validate(_check(self.http.post("/v1/jobs", json=job.model_dump(mode="json"))))

    def get(self, job_id: UUID | str, wait: float = 0.0) -> JobOut:
        response = self.http.get(f"/v1/jobs/{job_id}", params={"wait": wait}, timeout=wait + 30.0)
        return JobOut.model_validate(_check(response))

    def stream(self, job_id: UUID | str) -> Iterator[JobEvent]:
        """The job's events as it runs: `status` changes, `text` (everything so far), and last its `result`."""
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", timeout=httpx.Timeout(30.0, read=None)) as response:
            if response.status_code >= 400:
                response.read()
                _check(response)
            yield from _events(response.iter_lines())

    def cancel(self, job_id: UUID | str) -> JobOut:
        """Cancel a job: queued, it never runs; running, it stops and keeps the text it had."""
        return JobOut.model_validate(_check(self.http.post(f"/v1/jobs/{job_id}/cancel")))

    def wait(self, job_id: UUID | str, timeout: float = 300.0, poll: float = 30.0) -> JobOut:
        """Long-poll until the job is terminal or `timeout` passes (then the last state is returned)."""
        remaining = timeout
        while True:
            job = self.get(job_id, wait=min(poll, max(remaining, 0.0)))
            remaining -= poll
            if job.status in TERMINAL or remaining <= 0:
                return job

    def create_batch(self, data: bytes, name: str = "batch.jsonl", priority: int | None = None,
                     metadata: dict[str, str] | None = None, completion_window: str | None = None) -> BatchOut:
        """`priority` and `completion_window` None leave them to the API (low: bulk work; 24h)."""
        form = {} if priority is None else {"priority": str(priority)}
        if metadata is not None:
            form["metadata"] = json.dumps(metadata)
        if completion_window is not None:
            form["completion_window"] = completion_window
        response = self.http.post("/v1/batches", files={"file": (name, data, "application/jsonl")}, data=form)
        return BatchOut.model_validate(_check(response))

    def get_batch(self, batch_id: UUID | str) -> BatchOut:
        return BatchOut.model_validate(_check(self.http.get(f"/v1/batches/{batch_id}")))

    def cancel_batch(self, batch_id: UUID | str) -> BatchOut:
        return BatchOut.model_validate(_check(self.http.post(f"/v1/batches/{batch_id}/cancel")))

    def retry_batch(self, batch_id: UUID | str) -> BatchOut:
        return BatchOut.model_validate(_check(self.http.post(f"/v1/batches/{batch_id}/retry")))

    def line_errors(self, batch_id: UUID | str, limit: int | None = None) -> Iterator[BatchLineError]:
        """The batch's lines that could not become jobs, in line order (at most `limit`), fetched a page at a time."""
        after, left = None, limit  # from line 0: the batch's own error, when its ingest failed
        while left is None or left > 0:
            size = 1000 if left is None else min(left, 1000)
            params = {"limit": size} if after is None else {"after": after, "limit": size}
            page = _check(self.http.get(f"/v1/batches/{batch_id}/line_errors", params=params))
            for item in page["data"]:
                yield BatchLineError.model_validate(item)
            if not page["has_more"] or not page["data"]:
                return
            after = page["data"][-1]["line"]
            left = None if left is None else left - len(page["data"])

    def batch_lines(self, batch_id: UUID | str, errors: bool = False) -> Iterator[dict]:
        """The batch's output lines (or error lines), streamed."""
        with self.http.stream("GET", f"/v1/batches/{batch_id}/{'errors' if errors else 'output'}") as response:
            if response.status_code >= 400:
                response.read()
                _check(response)
            for line in response.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    def __init__(self, base_url: str, api_key: str, timeout: float = 30.0) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=timeout)

    async def submit(self, job: JobIn) -> JobAccepted:
        response = await self.http.post("/v1/jobs", json=job.model_dump(mode="json"))
        return JobAccepted.model_validate(_check(response))

    async def get(self, job_id: UUID | str, wait: float = 0.0) -> JobOut:
        response = await self.http.get(f"/v1/jobs/{job_id}", params={"wait": wait}, timeout=wait + 30.0)
        return JobOut.model_validate(_check(response))

    async def stream(self, job_id: UUID | str) -> AsyncIterator[JobEvent]:
        async with self.http.stream("GET", f"/v1/jobs/{job_id}/events",
                                    timeout=httpx.Timeout(30.0, read=None)) as response:
            if response.status_code >= 400:
                await response.aread()
                _check(response)
            parser = SSEParser()
            async for line in response.aiter_lines():
                if (event := parser.feed(line)) is not None:
                    yield event

    async def cancel(self, job_id: UUID | str) -> JobOut:
        return JobOut.model_validate(_check(await self.http.post(f"/v1/jobs/{job_id}/cancel")))

    async def wait(self, job_id: UUID | str, timeout: float = 300.0, poll: float = 30.0) -> JobOut:
        remaining = timeout
        while True:
            job = await self.get(job_id, wait=min(poll, max(remaining, 0.0)))
            remaining -= poll
            if job.status in TERMINAL or remaining <= 0:
                return job

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
