"""What every benchmark here shares: the tiny model it runs on and how it prints its result."""

from __future__ import annotations

import json
from pathlib import Path

from cli.tiny_model import build_tiny_model
from jobs.settings import DATA_DIR


def tiny_model(preset: str = "tiny") -> Path:
    """The preset's checkpoint under the data folder, built on first use."""
    path = DATA_DIR / "models" / preset
    if not (path / "config.json").exists():
        build_tiny_model(path, preset=preset)
    return path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(result: dict, json_only: bool) -> None:
    """A readable table unless `json_only`; the last line is always the result as one JSON object."""
    if not json_only:
        width = max(len(k) for k in result)
        for k, v in result.items():
            print(f"{k:>{width}}: {v}")
    print(json.dumps(result))
