"""`convoq worker --gpus`: one worker per GPU, each pinned to its own, with its own node name and metrics port;
placement checked with fake GPU ids on the CPU."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from cli.gpus import gpu_list, placements
from tests.test_metrics import two_free_ports
from tests.waits import until

ROOT = Path(__file__).resolve().parent.parent


def test_gpus_name_all_or_a_list_and_each_worker_gets_a_port():
    assert gpu_list("all", lambda: 4) == ["0", "1", "2", "3"]
    assert gpu_list("2, 5", lambda: 0) == ["2", "5"]
    for bad in ("0,0", "0,,1", ""):
        with pytest.raises(ValueError, match="distinct GPU ids"):
            gpu_list(bad, lambda: 4)
    with pytest.raises(ValueError, match="no GPU is visible"):
        gpu_list("all", lambda: 0)
    assert [(p.gpu, p.metrics_port) for p in placements(["2", "5"], 9464)] == [("2", 9464), ("5", 9465)]
    assert [p.metrics_port for p in placements(["0", "1"], 0)] == [0, 0]
    # tensor-parallel groups: eight GPUs, two ranks per engine
    eight = gpu_list("all", lambda: 8)
    assert [(p.gpu, p.metrics_port) for p in placements(eight, 9464, 2)] == [
        ("0,1", 9464), ("2,3", 9465), ("4,5", 9466), ("6,7", 9467)]
    assert [p.gpu for p in placements(eight, 9464, 8)] == ["0,1,2,3,4,5,6,7"]
    with pytest.raises(ValueError, match="names 3 GPUs, which CONVOQ_TENSOR_PARALLEL=2 does not split"):
        placements(["0", "1", "2"], 9464, 2)


def children(pid: int) -> dict[int, str]:
    """The worker processes `pid` started -> their CUDA_VISIBLE_DEVICES."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    found = {}
    for child in map(int, out):
        try:
            env = dict(line.split("=", 1) for line in
                       Path(f"/proc/{child}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in line)
        except OSError:
            continue
        found[child] = env.get("CUDA_VISIBLE_DEVICES", "")
    return found


def serving(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_one_worker_per_gpu_each_pinned_restarted_when_it_dies_and_stopped_together(service_env, tmp_path):
    port = two_free_ports()  # the second worker serves on the next port, or moves on if it is taken
    env = {**os.environ, **service_env, "CONVOQ_DEVICE": "cpu", "CONVOQ_WORKER_METRICS_PORT": str(port),
           "CONVOQ_HEARTBEAT_S": "0.5"}
    with open(tmp_path / "supervisor.log", "wb") as log:
        supervisor = subprocess.Popen([sys.executable, "-m", "cli.main", "worker", "--gpus", "3,5",
                                       "--concurrency", "4"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        until(lambda: serving(port) and serving(port + 1), 180, every=0.5)
        workers = children(supervisor.pid)
        assert sorted(workers.values()) == ["3", "5"]  # each pinned to its GPU
        db = sa.create_engine(service_env["CONVOQ_DATABASE_URL"])
        with db.connect() as conn:
            rows = until(lambda: conn.execute(sa.text("SELECT pid FROM workers WHERE stopped_at IS NULL")).all()
                         if len(conn.execute(sa.text("SELECT pid FROM workers")).all()) == 2 else None, 180, every=0.5)
        db.dispose()
        assert sorted(r.pid for r in rows) == sorted(workers)  # each its own worker, named after its pid
        # its own Celery node name, which a worker may log after its row is written
        assert until(lambda: all(f"convoq-{pid}@" in (tmp_path / "supervisor.log").read_text(errors="replace")
                                 for pid in workers), 60, every=0.5)

        # the worker on GPU 5 dies: the supervisor starts another on GPU 5
        dead = next(pid for pid, gpu in workers.items() if gpu == "5")
        os.kill(dead, signal.SIGKILL)
        again = until(lambda: {p: g for p, g in children(supervisor.pid).items() if p not in workers} or None, 180,
                      every=0.5)
        assert list(again.values()) == ["5"]

        supervisor.send_signal(signal.SIGTERM)  # a deploy: every worker leaves as it would alone, then it does
        assert supervisor.wait(120) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in [*workers, *again])
    finally:
        if supervisor.poll() is None:
            left = children(supervisor.pid)
            supervisor.kill()
            supervisor.wait()
            for pid in left:  # a killed supervisor stops none of its workers: they would outlive the test
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_a_worker_that_cannot_start_is_started_again_ever_later_with_the_reason(monkeypatch, caplog):
    from cli import gpus
    from worker.exits import NOT_STARTED

    assert [gpus.restart_delay(n, 5.0, 300.0) for n in (1, 2, 3, 7, 8)] == [5.0, 10.0, 20.0, 300.0, 300.0]
    monkeypatch.setattr(gpus, "POLL_S", 0.02)
    starts: list[float] = []
    supervisor = gpus.Supervisor(placements(["0"], 0), [], [sys.executable, "-c", f"raise SystemExit({NOT_STARTED})"],
                                 first_delay_s=0.3)
    spawn = supervisor.spawn
    monkeypatch.setattr(supervisor, "spawn", lambda i: (starts.append(time.monotonic()), spawn(i)))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stopper = threading.Timer(4.0, supervisor.stop, args=(signal.SIGTERM,))
    stopper.start()
    try:
        with caplog.at_level("WARNING", logger="cli.gpus"):
            assert supervisor.run() == 1  # its last exit was a failure
    finally:
        stopper.cancel()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # Each wait is at least its doubled delay; a start's own time under load only adds to it, so no upper bound.
    assert len(gaps) >= 2 and all(gap >= 0.3 * 2**n for n, gap in enumerate(gaps)), gaps
    assert "could not start: its engine could not be built or its database not reached" in caplog.text
    assert "1 in a row" in caplog.text and "2 in a row" in caplog.text
