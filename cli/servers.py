"""Throwaway Redis and PostgreSQL servers started from the installed server binaries.

Tests use them so that no run depends on another run's leftovers; `convoq demo` uses a throwaway Redis
when no broker is reachable. Each server lives in its own temporary folder on a free port and is removed
on `stop()`.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

INSTALL_HINT = "install the server binaries (Debian: apt-get install redis-server postgresql)"


class ServerUnavailable(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerUnavailable(f"{what} exited with code {proc.returncode} while starting")
        if port_open("127.0.0.1", port):
            return
        time.sleep(0.05)
    raise ServerUnavailable(f"{what} did not open port {port} within {timeout:.0f}s")


class RedisServer:
    """`redis-server` with append-only persistence, so a restart keeps queued messages (like production)."""

    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise ServerUnavailable(f"redis-server not found; {INSTALL_HINT}")
        self.dir = Path(tempfile.mkdtemp(prefix="convoq-redis-"))
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction",
             "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_for_port(self.port, self.proc, "redis-server")
        return self

    def stop(self, remove: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL: what the append-only file had not synced yet (up to a second of writes) is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _pg_bindir() -> Path:
    pg_config = shutil.which("pg_config")
    candidates = []
    if pg_config:
        candidates.append(subprocess.run([pg_config, "--bindir"], capture_output=True, text=True).stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    if shutil.which("initdb"):
        candidates.append(str(Path(shutil.which("initdb")).resolve().parent))
    for c in candidates:
        if c and (Path(c) / "initdb").exists() and (Path(c) / "postgres").exists():
            return Path(c)
    raise ServerUnavailable(f"PostgreSQL server binaries (initdb, postgres) not found; {INSTALL_HINT}")


class PostgresServer:
    """A private cluster (`initdb` + `postgres`); as root it runs as the `postgres` user, which it requires."""

    def __init__(self) -> None:
        self.bindir = _pg_bindir()
        self.dir = Path(tempfile.mkdtemp(prefix="convoq-pg-"))
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.dir, "postgres", "postgres")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/convoq"

    def start(self) -> PostgresServer:
        """Create the cluster on first start; later starts (after `stop(remove=False)`) reuse it."""
        data = self.dir / "data"
        fresh = not (data / "PG_VERSION").exists()
        if fresh:
            subprocess.run(
                [*self._as, str(self.bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                 "-E", "UTF8", "--no-sync", "--no-instructions"],
                check=True, capture_output=True,
            )
        with open(self.dir / "postgres.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*self._as, str(self.bindir / "postgres"), "-D", str(data), "-p", str(self.port),
                 "-k", str(self.dir), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                 "-c", "max_connections=300"],
                stdout=subprocess.DEVNULL, stderr=log,
            )
        _wait_for_port(self.port, self.proc, "postgres")
        if fresh:
            self._create_database("convoq")
        return self

    def _create_database(self, name: str) -> None:
        import psycopg

        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                                     autocommit=True) as conn:
                    conn.execute(f'CREATE DATABASE "{name}"')
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, remove: bool = True, immediate: bool = False) -> None:
        """`immediate`: abort at once, clients cut off mid-transaction, as a crash would (recovery on restart)."""
        if immediate and self.proc is not None and self.proc.poll() is None:
            subprocess.run([*self._as, str(self.bindir / "pg_ctl"), "-D", str(self.dir / "data"), "stop",
                            "-m", "immediate"], check=True, capture_output=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # smart shutdown; fast enough with no clients left
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
