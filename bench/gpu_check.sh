#!/usr/bin/env bash
# The GPU check in one command (see bench/gpu_check.py): first `convoq doctor` on this machine (device, driver,
# compiler, one compiled Triton kernel, the tiny model, one engine step; no Redis or PostgreSQL), then the check,
# which writes one JSON report, gpu_check.json by default. Held under 9 minutes; the report is rewritten after
# every part, so a run cut short keeps what it measured. A failing doctor is reported and the check goes on.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
model="$("$PY" -c 'from bench.common import tiny_model; print(tiny_model())' 2>/dev/null || true)"
CONVOQ_MODEL="${model:-.convoq/models/tiny}" timeout 60 "$PY" -m cli.main doctor --no-services \
  || echo "convoq doctor failed (above); the GPU check goes on"
exec timeout --signal=INT 470 "$PY" -m bench.gpu_check "$@"
