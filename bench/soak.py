"""A live service's slow clients: thousands of idle event streams and slow batch downloads while chats go on.

    python -m bench.soak --json [--streams 2000] [--downloads 50] [--soak-s 120] [--idle-s 30]

Everything runs on loopback: its own Redis and PostgreSQL (`cli.servers`), the API and one worker as processes
(`cli.stack`) on the tiny model, default settings. The worker takes the interactive queue only, so jobs sent at
a bulk priority stay queued and their streams stay quiet, as a customer's idle chat window would.

1. setup: a batch of `--batch-lines` chats at priority 9 runs to completion (its output is what the slow
   clients download); `--streams` jobs at priority 0 are sent and left queued.
2. idle: chats (non-streamed and streamed in turn) at `--chat-rate` for `--idle-s`, nothing else.
3. soak: a client process opens `--streams` event streams on the queued jobs (many per process, raw asyncio
   sockets, spread over four API keys) and `--downloads` downloads of the batch's output read at `--read-kb`
   KB/s each (a small receive window, so the API cannot send ahead); once all are open, chats go on at the same
   rate for `--soak-s`, and every five seconds a probe calls each read route once.

Figures: `chat_p95_ratio` (p95 of a chat's wall time during the soak over idle, same run), `errors_5xx` (every
answer of 500 and up, and every request that failed or timed out: chats, probes, streams and downloads, the
last two also when their connection was dropped), `redis_clients_max` (Redis `INFO clients`, sampled every
second from the API's start to the end; `api_redis_clients_max`: the API process's own connections to Redis,
read from /proc, bounded by `CONVOQ_API_REDIS_CONNECTIONS`), `db_pool_waits` (the API's
`convoq_api_db_pool_waits_total`: requests that waited for a pooled database connection). The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import redis

from bench.common import percentile, report, scraped, tiny_model
from cli.servers import PostgresServer, RedisServer
from cli.stack import Stack
from jobs.priority import LOWEST
from jobs.settings import Settings
from migrations.apply import upgrade

CHAT_KEY = "soak-chat-key-0123456789"
STREAM_KEYS = [f"soak-stream-key-{i}-0123456789" for i in range(4)]  # within CONVOQ_MAX_STREAMS_PER_KEY each
ASK = [{"role": "user", "content": "Where is my parcel? Order {n}."}]
PROBE_EVERY_S = 5.0
TIMEOUT_S = 30.0


def _request(path: str, key: str, netloc: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {netloc}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()


async def _connect(url: str, receive_window: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    sock = socket.socket()
    if receive_window:  # before connecting: the window is agreed on at the handshake
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_window)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    return await asyncio.open_connection(sock=sock, limit=max(receive_window or 0, 2**16))


class Clients:
    """The streams and downloads of one client process, and what went wrong with them."""

    def __init__(self, url: str, stop: ProcessEvent) -> None:
        self.url = url
        self.netloc = urlsplit(url).netloc
        self.stop = stop
        self.open_streams = 0
        self.errors: list[str] = []
        self.downloaded = 0

    async def stream(self, job_id: str, key: str, opened: asyncio.Event) -> None:
        """An event stream held open, read as its keep-alives come; it must not end before it is let go."""
        counted = False
        try:
            reader, writer = await _connect(self.url)
        except OSError as exc:
            self.errors.append(f"stream connect: {exc}")
            opened.set()
            return
        try:
            writer.write(_request(f"/v1/jobs/{job_id}/events", key, self.netloc))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
            if not head.startswith(b"HTTP/1.1 200"):
                self.errors.append(f"stream: {head.splitlines()[0].decode()}")
                return
            seen = b""
            while b"event: status" not in seen:
                seen += await asyncio.wait_for(reader.read(4096), TIMEOUT_S)
            self.open_streams += 1
            counted = True
            opened.set()
            while not self.stop.is_set():
                try:
                    if not await asyncio.wait_for(reader.read(4096), 1.0):
                        self.errors.append("stream: closed by the API")
                        return
                except TimeoutError:
                    continue
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            self.errors.append(f"stream: {type(exc).__name__}")
        finally:
            opened.set()
            if counted and not self.stop.is_set():
                self.open_streams -= 1
            writer.close()

    async def download(self, path: str, key: str, per_s: int, started: asyncio.Event) -> None:
        """Download `path` reading `per_s` bytes a second, again from the start whenever it ends."""
        while not self.stop.is_set():
            try:
                reader, writer = await _connect(self.url, receive_window=per_s)
            except OSError as exc:
                self.errors.append(f"download connect: {exc}")
                started.set()
                return
            try:
                writer.write(_request(path, key, self.netloc))
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
                started.set()
                if not head.startswith(b"HTTP/1.1 200"):
                    self.errors.append(f"download: {head.splitlines()[0].decode()}")
                    return
                while not self.stop.is_set():
                    chunk = await asyncio.wait_for(reader.read(per_s), TIMEOUT_S)
                    if not chunk:
                        break  # the whole file: start again
                    self.downloaded += len(chunk)
                    await asyncio.sleep(1.0)
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                self.errors.append(f"download: {type(exc).__name__}")
                started.set()
                return
            finally:
                writer.close()


def hold(url: str, job_ids: list[str], batch_id: str, downloads: int, read_kb: int, ready, stop, out) -> None:
    """A client process: every stream and download, until `stop`; reports (open streams, errors, bytes read)."""

    async def main() -> None:
        clients = Clients(url, stop)
        opened = [asyncio.Event() for _ in job_ids]
        started = [asyncio.Event() for _ in range(downloads)]
        tasks = []
        for i in range(downloads):
            tasks.append(asyncio.create_task(clients.download(f"/v1/batches/{batch_id}/output", CHAT_KEY,
                                                              read_kb * 1024, started[i])))
        for i, job_id in enumerate(job_ids):
            tasks.append(asyncio.create_task(clients.stream(job_id, STREAM_KEYS[i % len(STREAM_KEYS)], opened[i])))
            if i % 100 == 99:  # within the listen backlog
                await asyncio.gather(*(e.wait() for e in opened[i - 99:i + 1]))
        await asyncio.gather(*(e.wait() for e in opened + started))
        ready.put((clients.open_streams, list(clients.errors)))
        while not stop.is_set():
            await asyncio.sleep(0.5)
        await asyncio.gather(*tasks, return_exceptions=True)
        out.put((clients.open_streams, clients.errors, clients.downloaded))

    asyncio.run(main())


def connections_to(pid: int, port: int) -> int:
    """Established TCP connections of process `pid` to loopback `port` (Linux: its socket descriptors, matched
    by inode in its /proc/PID/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if (target := os.readlink(fd)).startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].rpartition(":")[2], 16) == port and fields[3] == "01" and fields[9] in inodes:
            found += 1
    return found


class RedisClients(threading.Thread):
    """Every second: Redis's connected clients (`INFO clients`, this sampler's own connection aside) and the API
    process's connections to Redis; the most of each."""

    def __init__(self, server: RedisServer, api_pid: int) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(server.url)
        self.port, self.api_pid = server.port, api_pid
        self.most = self.most_api = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            self.most = max(self.most, self.client.info("clients")["connected_clients"] - 1)
            try:
                self.most_api = max(self.most_api, connections_to(self.api_pid, self.port))
            except OSError:  # the API has stopped
                return


async def chats(url: str, model: str, rate: float, seconds: float, errors: list[str]) -> list[float]:
    """Chats at `rate` a second for `seconds` (streamed and not in turn): each one's wall time in ms."""
    latencies: list[float] = []

    async def one(client: httpx.AsyncClient, n: int) -> None:
        body = {"model": model, "messages": [{**ASK[0], "content": ASK[0]["content"].format(n=n)}], "max_tokens": 16,
                "stream": n % 2 == 1}
        start = time.monotonic()
        try:
            if body["stream"]:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    text = "".join([line async for line in response.aiter_lines()])
                    ok = response.status_code == 200 and "[DONE]" in text and '"error"' not in text
            else:
                response = await client.post("/v1/chat/completions", json=body)
                ok = response.status_code == 200
        except httpx.HTTPError as exc:
            errors.append(f"chat: {type(exc).__name__}")
            return
        if not ok:
            errors.append(f"chat: {response.status_code}")
            return
        latencies.append((time.monotonic() - start) * 1e3)

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {CHAT_KEY}"},
                                 timeout=TIMEOUT_S) as client:
        start, tasks = time.monotonic(), []
        for n in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(client, n)))
        await asyncio.gather(*tasks)
    return latencies


async def probes(url: str, paths: list[str], until: float, errors: list[str]) -> list[float]:
    """Every read route once per `PROBE_EVERY_S` until `until` (monotonic): each answer's time in ms."""
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {CHAT_KEY}"},
                                 timeout=TIMEOUT_S) as client:
        while time.monotonic() < until:
            for path in paths:
                start = time.monotonic()
                try:
                    status = (await client.get(path)).status_code
                except httpx.HTTPError as exc:
                    errors.append(f"probe {path}: {type(exc).__name__}")
                    continue
                if status >= 500:
                    errors.append(f"probe {path}: {status}")
                latencies.append((time.monotonic() - start) * 1e3)
            await asyncio.sleep(PROBE_EVERY_S)
    return latencies


def setup(url: str, batch_lines: int, streams: int) -> tuple[str, str, list[str]]:
    """A batch run to completion, and `streams` queued jobs: (batch id, one chat's job id, the queued ids)."""
    headers = {"Authorization": f"Bearer {CHAT_KEY}"}
    lines = "\n".join(json.dumps({"custom_id": f"q-{i:06d}", "messages": [
        {"role": "user", "content": f"Ticket {i}: my parcel is late, where is it?"}], "max_new_tokens": 48})
        for i in range(batch_lines)).encode()
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        r = client.post("/v1/batches", files={"file": ("soak.jsonl", lines)}, headers={**headers, "X-Convoq-Priority": "9"})
        r.raise_for_status()
        batch_id = r.json()["id"]
        deadline = time.monotonic() + 900
        while (batch := client.get(f"/v1/batches/{batch_id}", headers=headers).json())["status"] != "completed":
            if time.monotonic() > deadline or batch["status"] in ("failed", "cancelled", "expired"):
                raise RuntimeError(f"the batch did not complete: {batch}")
            print(f"batch: {batch['request_counts']}", file=sys.stderr)
            time.sleep(5)
        job = client.post("/v1/jobs", json={"messages": ASK, "priority": LOWEST}, headers=headers).json()["id"]

    async def queue_all() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
            gate = asyncio.Semaphore(16)

            async def one(i: int) -> str:
                async with gate:
                    r = await client.post("/v1/jobs", json={"messages": ASK, "priority": LOWEST}, headers={
                        "Authorization": f"Bearer {STREAM_KEYS[i % len(STREAM_KEYS)]}"})
                    r.raise_for_status()
                    return r.json()["id"]

            return await asyncio.gather(*(one(i) for i in range(streams)))

    return batch_id, job, asyncio.run(queue_all())


def pool_waits(url: str) -> int:
    if (waits := scraped(f"{url}/metrics", "convoq_api_db_pool_waits_total", TIMEOUT_S).get(())) is None:
        raise RuntimeError("the API does not report convoq_api_db_pool_waits_total")
    return int(waits)


def run(streams: int, downloads: int, soak_s: float, idle_s: float, chat_rate: float, read_kb: int,
        batch_lines: int) -> dict:
    model = tiny_model()
    redis_server, postgres = RedisServer().start(), PostgresServer().start()
    sampler = None
    try:
        upgrade(postgres.url)
        env = {"CONVOQ_DATABASE_URL": postgres.url, "CONVOQ_BROKER_URL": redis_server.url, "CONVOQ_MODEL": str(model),
               "CONVOQ_API_KEYS": ",".join([CHAT_KEY, *STREAM_KEYS])}
        settings = Settings(**{k.removeprefix("CONVOQ_").lower(): v for k, v in env.items()})
        with Stack(env, Path(tempfile.mkdtemp(prefix="convoq-soak-"))) as stack:
            stack.start_worker("--queues", settings.interactive_queue)  # bulk jobs stay queued: quiet streams
            stack.start_api()
            sampler = RedisClients(redis_server, stack.api.pid)
            sampler.start()
            url = stack.api_url
            print("setup: the batch, then the queued jobs", file=sys.stderr)
            batch_id, job_id, queued = setup(url, batch_lines, streams)
            waits_before = pool_waits(url)

            errors: list[str] = []
            print(f"idle: chats for {idle_s:.0f} s", file=sys.stderr)
            idle = asyncio.run(chats(url, str(model), chat_rate, idle_s, errors))

            print(f"soak: {streams} streams, {downloads} downloads, chats for {soak_s:.0f} s", file=sys.stderr)
            context = multiprocessing.get_context("spawn")
            ready, out, stop = context.Queue(), context.Queue(), context.Event()
            holder = context.Process(target=hold, args=(url, queued, batch_id, downloads, read_kb, ready, stop, out))
            holder.start()
            opened, open_errors = ready.get(timeout=600)
            paths = ["/healthz", "/readyz", "/metrics", "/v1/models", f"/v1/jobs/{job_id}", f"/v1/batches/{batch_id}",
                     "/v1/batches?limit=5", f"/v1/batches/{batch_id}/line_errors", "/v1/files"]

            async def soak() -> tuple[list[float], list[float]]:
                until = time.monotonic() + soak_s
                return await asyncio.gather(chats(url, str(model), chat_rate, soak_s, errors),
                                            probes(url, paths, until, errors))

            loaded, probed = asyncio.run(soak())
            waits = pool_waits(url)
            stop.set()
            still_open, hold_errors, downloaded = out.get(timeout=120)
            holder.join(60)
        sampler.halt.set()
        errors += hold_errors
    finally:
        if sampler is not None:
            sampler.halt.set()
        redis_server.stop()
        postgres.stop()
    ratio = percentile(loaded, 0.95) / percentile(idle, 0.95) if loaded and idle else None
    return {
        "streams": streams, "streams_open": opened, "streams_open_at_end": still_open, "downloads": downloads,
        "downloaded_kb": round(downloaded / 1024), "soak_s": soak_s,
        "chats_idle": len(idle), "chats_soak": len(loaded),
        "chat_p95_idle_ms": round(percentile(idle, 0.95), 1) if idle else None,
        "chat_p95_soak_ms": round(percentile(loaded, 0.95), 1) if loaded else None,
        "chat_p95_ratio": None if ratio is None else round(ratio, 2),
        "probe_p95_ms": round(percentile(probed, 0.95), 1) if probed else None,
        "errors_5xx": len(errors), "first_errors": (open_errors + errors)[:5],
        "redis_clients_max": sampler.most, "api_redis_clients_max": sampler.most_api,
        "api_redis_connections": settings.api_redis_connections, "db_pool_waits": waits - waits_before,
        "db_pool_waits_setup": waits_before,
        "targets_met": {"chat_p95_ratio": ratio is not None and ratio <= 2.0, "errors_5xx": not errors,
                        "api_redis_clients": sampler.most_api <= settings.api_redis_connections,
                        "streams": opened == streams == still_open},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=2000, help="idle event streams held open")
    parser.add_argument("--downloads", type=int, default=50, help="slow downloads of the batch's output")
    parser.add_argument("--read-kb", type=int, default=4, help="KB/s each download reads")
    parser.add_argument("--soak-s", type=float, default=120.0)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--chat-rate", type=float, default=2.0, help="chats per second, idle and during the soak")
    parser.add_argument("--batch-lines", type=int, default=1000, help="lines of the batch the clients download")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    report(run(args.streams, args.downloads, args.soak_s, args.idle_s, args.chat_rate, args.read_kb,
               args.batch_lines), args.json)


if __name__ == "__main__":
    main()
