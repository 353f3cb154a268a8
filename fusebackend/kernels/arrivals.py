"""Arrival counters: how the programs of one launch that share a piece of output learn
which of them finishes last.

Split-K matmuls (kernels/matmul_triton.py) and split decode attention
(kernels/decode_attention.py, ``FOLD_COMBINE``) divide one output tile's work between
programs; each stores its partial result, then adds 1 to the tile's counter (an acq_rel
atomic after a CTA barrier), and the one that counts the last arrival combines the
partials and sets the counter back to 0. One launch instead of a second "combine" kernel.

The counters are one zeroed int32 buffer per device, shared by every such launch: each
launch leaves it zeroed, and launches on one stream run one after another. Two launches
running at once on two streams of one device would share counters: not supported.
"""

from __future__ import annotations

import torch

__all__ = ["arrival_counters"]

_MIN_COUNTERS = 4096
_counters: dict[torch.device, torch.Tensor] = {}
# Buffers a larger one replaced: captured CUDA graphs keep their addresses, so they are
# never freed (a few KB each).
_replaced: list[torch.Tensor] = []


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` zeroed int32 counters on ``device``. A larger buffer replaces a
    smaller one (allocated, and zeroed, when a launch first needs it: inside a CUDA graph's
    capture, the capture records the zeroing too)."""
    have = _counters.get(device)
    if have is None or have.numel() < count:
        if have is not None:
            _replaced.append(have)
        size = max(count, _MIN_COUNTERS)
        have = _counters[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return have
