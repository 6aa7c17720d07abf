"""`bench.cpu`: the CPU time the pipeline benchmark attributes to each process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.cpu import CpuMeter, per_item_ms, processes

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_process_is_charged_the_cpu_it_spent_and_an_idle_one_nothing():
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)  # past the child's start-up
        me = os.getpid()
        meter = CpuMeter({"busy": lambda p: p.pid == me, "idle": lambda p: p.pid == idle.pid})
        meter.start()
        burn(0.3)
        spent = meter.stop()
    finally:
        idle.kill()
        idle.wait()
    assert 0.25 <= spent["busy"] <= 1.0
    assert spent["idle"] < 0.05
    assert per_item_ms(spent, 10)["busy"] == round(spent["busy"] * 100, 2)
    assert per_item_ms(spent, 10)["total"] == round((spent["busy"] + spent["idle"]) * 100, 2)


def test_a_name_with_spaces_and_parentheses_is_read_whole():
    # a process may rename itself; then its name is what /proc shows, in parentheses
    rename = "open('/proc/self/comm', 'w').write('a (b) c'); print(flush=True); import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", rename], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        assert processes()[child.pid].name == "a (b) c"
        assert processes()[child.pid].session == os.getsid(child.pid)
    finally:
        child.kill()
        child.wait()
