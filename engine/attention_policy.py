"""`EngineConfig.attention_policy`: which keys the full-attention layers of a model see.

"dense" (the default), "sliding:W" (the last W keys), "streaming:W:S" (the last W keys plus the first S, the
attention sinks) or "strided:L:S" (the last L keys plus every S-th key). Layers the model itself gives a sliding
window keep it. A layer under a plain sliding window keeps only the blocks its window can still read (its pool
recycles blocks as a ring); sinks and strided keys can reach back to any block, so those layers keep them all.
"""

from __future__ import annotations

from kernels.sparse import AttentionPolicy

_PARAMS = {"dense": 0, "sliding": 1, "streaming": 2, "strided": 2}


def parse_policy(text: str) -> AttentionPolicy:
    kind, *params = text.split(":")
    if _PARAMS.get(kind) != len(params) or not all(p.isdigit() and int(p) > 0 for p in params):
        raise ValueError(f"attention_policy {text!r} is not one of 'dense', 'sliding:W', 'streaming:W:S', "
                         "'strided:L:S' with positive integers")
    numbers = [int(p) for p in params]
    if kind == "sliding":
        return AttentionPolicy.sliding(*numbers)
    if kind == "streaming":
        return AttentionPolicy.streaming(*numbers)
    if kind == "strided":
        return AttentionPolicy.local_strided(*numbers)
    return AttentionPolicy.dense()


def layer_policies(windows: tuple[int, ...], policy: AttentionPolicy) -> list[AttentionPolicy]:
    """Per layer of a model with these sliding `windows` (0: full attention): the pattern it attends with."""
    return [policy if w == 0 else AttentionPolicy.sliding(w) for w in windows]


def ring_window(policy: AttentionPolicy) -> int:
    """The window whose blocks a layer may recycle as a ring: 0 (keep every block) unless the pattern is a
    plain sliding window."""
    return policy.window if policy.sinks == 0 and policy.stride == 0 else 0
