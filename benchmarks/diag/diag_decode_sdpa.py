"""Which SDPA kernel is fastest for a decode step's attention, packed or not?

passes/attention.py packs a grouped-query decode step's query heads into query rows of
their K/V head ([1, 32, 1, 64] -> [1, 4, 8, 64] for TinyLlama), which removes transformers'
repeat_kv copies. On an H100 (2026-11-23) cuDNN then picked an sm90 kernel plus a memset
(180 us per 22-layer step) where Inductor's unpacked call got an sm80 kernel (140 us). This
times each SDPA backend on both spellings, captured in a CUDA graph of 22 calls (a decode
step's layers), with the additive mask the graph passes, at cache lengths 176 and 4096.

    python benchmarks/diag/diag_decode_sdpa.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

LAYERS = 22


def _time_graph(fn, reps: int = 20) -> float:
    """Device microseconds per call of ``fn`` (LAYERS calls captured in one graph)."""
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


def _repeat(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, kv_heads, slots, width = t.shape
    return t[:, :, None].expand(b, kv_heads, n_rep, slots, width).reshape(b, -1, slots, width)


def _measure(fn, backend, reference) -> str:
    try:
        if backend is None:
            us, out = _time_graph(fn), fn()
        else:
            with sdpa_kernel(backend):
                us, out = _time_graph(fn), fn()
    except RuntimeError as e:
        return f"unavailable: {str(e)[:120]}"
    err = (
        ""
        if reference is None
        else f", max err {(out.reshape(reference.shape) - reference).abs().max():.1e}"
    )
    return f"{us:7.2f} us per layer{err}"


def _compare(slots: int, heads: int = 32, kv_heads: int = 4, width: int = 64) -> None:
    n_rep = heads // kv_heads
    backends = [None, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    q = torch.randn(1, heads, 1, width, device="cuda", dtype=torch.float16)
    k = torch.randn(1, kv_heads, slots, width, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    allowed = torch.zeros(1, 1, 1, slots, dtype=torch.bool, device="cuda")
    allowed[..., : slots // 2] = True  # half the cache filled
    mask = torch.full(allowed.shape, float("-inf"), device="cuda", dtype=torch.float16)
    mask = mask.masked_fill(allowed, 0.0)
    k_rep, v_rep = _repeat(k, n_rep), _repeat(v, n_rep)
    packed_q, packed_mask = q.reshape(1, kv_heads, n_rep, width), mask.expand(1, 1, n_rep, -1)
    reference = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)

    def packed():
        return F.scaled_dot_product_attention(packed_q, k, v, attn_mask=packed_mask)

    def repeated():
        return F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)

    rows = [("packed [1,4,8,64]", packed, b, reference) for b in backends]
    rows += [("repeated K/V (copies not timed)", repeated, b, reference) for b in backends]
    rows += [("repeat_kv copy of K alone", lambda: _repeat(k, n_rep), None, None)]
    for name, fn, backend, ref in rows:
        label = "default" if backend is None else backend.name
        print(f"slots {slots:5d} | {name:32s} | {label:20s} | {_measure(fn, backend, ref)}")


def main() -> None:
    torch.manual_seed(0)
    for slots in (176, 4096):
        _compare(slots)


if __name__ == "__main__":
    main()
