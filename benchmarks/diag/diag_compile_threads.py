"""Do Triton's compiles overlap on threads, as the precompile runs them?

EfficientNet-B0's precompile took 5.42 s for 37 kernels on 16 threads (docs/PERFORMANCE.md,
7cc01a3). That is either the compiles' own work spread over the threads or work they do one
after another. This compiles ``--kernels`` distinct kernels (one small reduction specialised
on a scale and a block size) for a CUDA target, each into an empty Triton cache, one after
another on one thread and on a pool of ``--workers`` threads (what
``triton_api.precompile_all`` uses). No GPU is needed: Triton's LLVM and ptxas compile for a
target given by hand (``--arch``, default 90).

    python benchmarks/diag/diag_compile_threads.py [--kernels 16] [--workers 8] [--out r.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
from typing import Any

_KERNEL = """
import triton.language as tl


def scaled_row_sum(x, out, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    v = tl.load(x + row * n + i, mask=i < n, other=0.0).to(tl.float32)
    v = tl.where(v > 0, v, v * 0.01) * SCALE
    tl.store(out + row, tl.sum(tl.exp(v - tl.max(v, 0)), 0))
"""


def _compiles(count: int, arch: int) -> list[Any]:
    """``count`` compile calls of distinct specialisations (none shares a cache entry)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    directory = tempfile.mkdtemp()
    with open(os.path.join(directory, "diag_kernel.py"), "w") as f:
        f.write(_KERNEL)
    sys.path.insert(0, directory)
    fn = JITFunction(__import__("diag_kernel").scaled_row_sum)
    signature = {"x": "*fp16", "out": "*fp32", "n": "i32", "SCALE": "constexpr",
                 "BLOCK": "constexpr"}  # fmt: skip
    target = GPUTarget("cuda", arch, 32)

    def call(k: int) -> Any:
        constants = {"SCALE": 1.0 + k, "BLOCK": 64 << (k % 4)}
        return lambda: triton.compile(ASTSource(fn, signature, constants), target=target)

    return [call(k) for k in range(count)]


def _timed(way: str, count: int, workers: int, arch: int) -> float:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # cold for every way
    calls = _compiles(count, arch)
    start = time.perf_counter()
    if way == "one thread":
        for c in calls:
            c()
    else:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda c: c(), calls))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", type=int, default=16)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 2))
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    _timed("one thread", 1, 1, args.arch)  # the compiler's one-time set-up, untimed
    for way in ("one thread", "threads"):
        seconds = _timed(way, args.kernels, args.workers, args.arch)
        rows.append({"way": way, "kernels": args.kernels, "workers": args.workers,
                     "seconds": round(seconds, 3)})  # fmt: skip
        print(f"{way:16s} {args.kernels} kernels, {args.workers} workers: {seconds:.2f} s",
              flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "diag_compile_threads", "cpus": os.cpu_count(),
                       "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
