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
from layer_graph import repeat_kv, time_in_graph  # benchmarks/diag/
from torch.nn.attention import SDPBackend, sdpa_kernel


def _measure(fn, backend, reference) -> str:
    try:
        if backend is None:
            us, out = time_in_graph(fn), fn()
        else:
            with sdpa_kernel(backend):
                us, out = time_in_graph(fn), fn()
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
    k_rep, v_rep = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    packed_q, packed_mask = q.reshape(1, kv_heads, n_rep, width), mask.expand(1, 1, n_rep, -1)
    reference = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)

    def packed():
        return F.scaled_dot_product_attention(packed_q, k, v, attn_mask=packed_mask)

    def repeated():
        return F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)

    rows = [("packed [1,4,8,64]", packed, b, reference) for b in backends]
    rows += [("repeated K/V (copies not timed)", repeated, b, reference) for b in backends]
    rows += [("repeat_kv copy of K alone", lambda: repeat_kv(k, n_rep), None, None)]
    for name, fn, backend, ref in rows:
        label = "default" if backend is None else backend.name
        print(f"slots {slots:5d} | {name:32s} | {label:20s} | {_measure(fn, backend, ref)}")


def main() -> None:
    torch.manual_seed(0)
    for slots in (176, 4096):
        _compare(slots)


if __name__ == "__main__":
    main()
