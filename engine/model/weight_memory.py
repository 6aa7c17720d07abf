"""How much memory the model's weights take, and how much of it is experts."""

from __future__ import annotations

from torch import nn

from engine.model.experts import Experts


def weights_bytes(model: nn.Module) -> int:
    """Parameters and buffers, each storage counted once (tied embeddings are one tensor); every expert of a
    mixture-of-experts model counts, however few of them a token uses."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def expert_bytes(model: nn.Module) -> int:
    """The experts' share of `weights_bytes` (0 for a dense model)."""
    return sum(weights_bytes(m) for m in model.modules() if isinstance(m, Experts))
