"""No question of its own: a helper of diag_decode_sdpa.py and diag_decode_attention.py (device
time per call of one layer's op, captured as a decode step's layers would be, and
transformers' ``repeat_kv``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

LAYERS = 22  # a TinyLlama decode step's layers: calls captured in one graph


def time_in_graph(fn: Callable[[], object], reps: int = 20) -> float:
    """Device microseconds per call of ``fn``, LAYERS calls captured in one CUDA graph and
    replayed ``reps`` times (launch gaps inside the graph included, as a replayed step sees
    them)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / LAYERS


def repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' ``repeat_kv``: each K/V head ``groups`` times, in a row."""
    b, kv_heads, slots, width = t.shape
    return t[:, :, None].expand(b, kv_heads, groups, slots, width).reshape(b, -1, slots, width)
