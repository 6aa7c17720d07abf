"""The service as real processes (API + workers) on given URLs: used by the demo, tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cli.servers import free_port, port_open


class Stack:
    def __init__(self, env: dict[str, str], logdir: Path, api_port: int | None = None) -> None:
        self.env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.api_port = api_port or free_port()
        self.api: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.others: list[subprocess.Popen] = []

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def _spawn(self, args: list[str], log_name: str) -> tuple[subprocess.Popen, Path]:
        log = self.logdir / log_name
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", *args],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return proc, log

    def start_api(self, timeout: float = 60.0) -> None:
        self.api, log = self._spawn(["api", "--port", str(self.api_port)], "api.log")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.api.poll() is not None:
                raise RuntimeError(f"API exited ({self.api.returncode}); see {log}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.api_url}/healthz", timeout=1).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"API not healthy within {timeout}s; see {log}")

    def start_worker(self, *args: str, timeout: float = 120.0) -> subprocess.Popen:
        n = len(self.workers)
        proc, log = self._spawn(["worker", *args], f"worker{n}.log")
        self.workers.append(proc)
        start = log.stat().st_size if log.exists() else 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            text = log.read_text(errors="replace")[start:] if log.exists() else ""
            if " ready." in text:
                return proc
            time.sleep(0.1)
        raise RuntimeError(f"worker not ready within {timeout}s; see {log}")

    def start_flower(self, timeout: float = 60.0) -> str:
        """Start Flower; returns its base URL (basic auth from the environment's CONVOQ_FLOWER_*)."""
        port = free_port()
        proc, log = self._spawn(["flower", "--port", str(port)], "flower.log")
        self.others.append(proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"flower exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            if port_open("127.0.0.1", port):
                return f"http://127.0.0.1:{port}"
            time.sleep(0.1)
        raise RuntimeError(f"flower did not listen within {timeout}s; see {log}")

    def kill_worker(self, index: int = -1, sig: int = signal.SIGKILL) -> None:
        proc = self.workers[index]
        os.killpg(proc.pid, sig)
        proc.wait(60)

    def stop(self) -> None:
        for proc in [*self.workers, *self.others, self.api]:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in [*self.workers, *self.others, self.api]:
            if proc is None:
                continue
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
