"""How much memory the model's weights take."""

from __future__ import annotations

from torch import nn


def weights_bytes(model: nn.Module) -> int:
    """Parameters and buffers, each storage counted once (tied embeddings are one tensor)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
