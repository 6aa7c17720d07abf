"""docker-compose.yml is valid Compose (checked without an engine) and wires every service the service needs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (Compose v1) is not installed")
def test_compose_config_validates():
    # the passwords come from `.env`; the committed example stands in for it
    out = subprocess.run(["docker-compose", "--env-file", str(ROOT / ".env.example"), "-f",
                          str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for service in ("redis", "postgres", "migrate", "api", "worker", "flower"):
        assert f"  {service}:" in out.stdout
    assert "appendonly" in out.stdout and "noeviction" in out.stdout
    assert "requirepass" in out.stdout and "convoq:convoq@" not in out.stdout  # no password in the file itself
    assert "capabilities:\n            - gpu" in out.stdout or "- gpu" in out.stdout
    # compose knows when the API is ready and when a worker's engine is up
    assert "/readyz" in out.stdout and "9464/metrics" in out.stdout


def test_the_image_can_build_tritons_launchers():
    """Triton compiles each kernel's launcher with a C compiler the first time it runs on a GPU."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "apt-get install" in dockerfile and " gcc " in dockerfile


def test_the_api_reads_the_model_folder_the_worker_loads():
    """The API counts a prompt's tokens with the model's tokenizer to refuse one that cannot fit: it needs the
    same folder as the worker, or every too-long prompt is queued and fails only on a worker."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    models = [v for v in services["worker"]["volumes"] if v.endswith(":/models:ro")]
    assert models and models[0] in services["api"]["volumes"]
