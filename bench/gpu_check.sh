#!/usr/bin/env bash
# The GPU check in one command (see bench/gpu_check.py): writes one JSON report, gpu_check.json by default.
# Held under 8 minutes; the report is rewritten after every part, so a run cut short keeps what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout --signal=INT 470 "${PYTHON:-python}" -m bench.gpu_check "$@"
