"""Where the first call of a compiled decode step goes: which Triton kernels compile at their
launch instead of in the backend's concurrent precompile.

On an H100 (2026-11-25) the suite's TinyLlama decode row took 9.85 s to its first call
with the decode attention kernel against 6.94 s in an earlier run without it. This records
every Triton compile (Triton's ``jit_cache_hook``) with its time and whether it was a
warm-up (the precompile) or a launch, during the first call of the suite's workload.

    python benchmarks/diag/diag_first_call.py [--model llama-decode]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import triton
    from suite import measure, workloads

    import fusebackend

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-decode", help="a suite workload name")
    parser.add_argument(
        "--without-decode-attention",
        action="store_true",
        help="leave SDPA and repeat_kv as traced (for an A/B in two processes)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the first call; print the top functions by cumulative time",
    )
    args = parser.parse_args()
    if args.without_decode_attention:
        import fusebackend.backend

        fusebackend.backend.use_decode_attention = lambda graph, attend: []
    device = torch.device("cuda")
    (workload,) = workloads.select(workloads.workloads(False, device), args.model)
    case = workload.build(device, 20)
    compiles: list[tuple[float, str, bool]] = []
    start = time.perf_counter()

    def hook(*, fn, is_manual_warmup, **_):
        compiles.append((time.perf_counter() - start, fn.name, is_manual_warmup))
        return False  # compile as usual

    with torch.no_grad():
        measure.prewarm(case, device)  # as the suite does: Dynamo's one-time costs first
        case.prepare()
        torch.cuda.synchronize()
        triton.knobs.runtime.jit_cache_hook = hook
        profile = cProfile.Profile() if args.profile else None
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        torch.compile(case.model, backend="infinifuse")(**case.kwargs)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        if profile is not None:
            profile.disable()
        triton.knobs.runtime.jit_cache_hook = None
    graphs = fusebackend.last_report().graphs
    backend_s = sum(g.compile_seconds for g in graphs)
    summary = f"first call {first:.2f} s; backend {backend_s:.2f} s over {len(graphs)} graphs"
    variant = " without decode attention" if args.without_decode_attention else ""
    print(f"{args.model}{variant}: {summary}")
    at_launch = [c for c in compiles if not c[2]]
    print(f"{len(compiles)} Triton compiles, {len(at_launch)} at a launch (not precompiled):")
    for t, name, warmup in compiles:
        print(f"  {t:7.2f} s  {'warm-up' if warmup else 'LAUNCH '}  {name}")
    if profile is not None:
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("cumulative").print_stats("fusebackend", 40)  # the backend, runtime
        stats.sort_stats("tottime").print_stats(30)  # where the time is spent
        print(text.getvalue())


if __name__ == "__main__":
    main()
