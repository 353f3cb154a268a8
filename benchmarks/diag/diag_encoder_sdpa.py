"""What does a padded encoder's attention cost at a length seen for the first time, per SDPA
kernel?

The sentence-transformers benchmark's single queries (``benchmarks/sentence_embeddings.py``)
had a p90 of 49-60 ms in every backend, eager included, on an H100, where a query at a
length seen before took 2-5 ms: SDPA ran cuDNN's fused kernel, which builds an execution
plan for each new shape. This times, for BERT-shaped attention with a key padding mask
(``[B, 1, L, L]`` boolean, expanded from ``[B, 1, 1, L]`` as transformers passes it) at a
series of new lengths, the first call (host + device, synchronized) and the steady call of
each SDPA kernel: cuDNN's, the memory-efficient one, and SDPA's default choice.

    python benchmarks/diag/diag_encoder_sdpa.py [--out results.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "default": None,
}


def inputs(batch: int, heads: int, dim: int, length: int) -> tuple[torch.Tensor, ...]:
    q, k, v = (
        torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.float16) for _ in range(3)
    )
    keep = torch.ones(batch, 1, 1, length, dtype=torch.bool, device="cuda")
    keep[1:, ..., length // 2 :] = False  # padded rows, as a batch of a sorted corpus has
    return q, k, v, keep.expand(batch, 1, length, length)


def call(kernel: str, q, k, v, mask) -> torch.Tensor:
    if KERNELS[kernel] is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel(KERNELS[kernel]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def timed_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    # (heads, head dim): MiniLM-L6 and BERT-base; each kernel gets its own unseen lengths
    for heads, dim in ((12, 32), (12, 64)):
        for batch in (1, 32):
            for offset, kernel in enumerate(KERNELS):
                lengths = [11 + 7 * i + offset for i in range(10)]
                first, steady = [], []
                for length in lengths:
                    one = functools.partial(call, kernel, *inputs(batch, heads, dim, length))
                    first.append(timed_ms(one))
                    steady.append(statistics.median(timed_ms(one) for _ in range(10)))
                row = {
                    "heads": heads,
                    "head_dim": dim,
                    "batch": batch,
                    "kernel": kernel,
                    "lengths": lengths,
                    "first_ms_median": statistics.median(first),
                    "first_ms_max": max(first),
                    "steady_ms_median": statistics.median(steady),
                }
                rows.append(row)
                print(
                    f"heads {heads} dim {dim} batch {batch:2d} {kernel:9s}: first call "
                    f"median {row['first_ms_median']:7.3f} ms (max {row['first_ms_max']:7.3f}), "
                    f"steady {row['steady_ms_median']:6.3f} ms"
                )
    if args.out:
        env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
