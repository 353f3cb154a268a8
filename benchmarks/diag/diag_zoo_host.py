"""Where does a model-zoo family's call spend its host time under infinifuse?

The zoo's 2-layer models (tests/model_zoo.py) run in 0.13-0.35 ms a call with CUDA graphs,
which is host time; some families (MPNet, GPT-NeoX) took 1.5-2x reduce-overhead's where
others took less. For each family named this times calls back to back and after a
synchronize (host time), then profiles a run of calls with cProfile and prints the
functions with the most own time, so the extra work of one family against another shows.

    python benchmarks/diag/diag_zoo_host.py --families mpnet,roberta [--calls 300]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import model_zoo  # noqa: E402

import fusebackend  # noqa: E402


def _host_us(call, calls: int) -> tuple[float, float]:
    """(median us per call back to back, median us of one call's host part)."""
    back, alone = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        back.append((time.perf_counter() - start) / calls * 1e6)
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        alone.append((time.perf_counter() - start) * 1e6)
    return statistics.median(back), statistics.median(alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="mpnet,roberta")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for family in args.families.split(","):
        torch.manual_seed(0)
        model = model_zoo.build(family, dtype=torch.float16, device="cuda")
        kwargs = model_zoo.inputs(family, device="cuda")
        for backend in ("infinifuse", "reduce-overhead"):
            torch._dynamo.reset()
            fusebackend.clear_cache()
            if backend == "infinifuse":
                compiled = torch.compile(model, backend="infinifuse")
            else:
                compiled = torch.compile(model, mode="reduce-overhead")

            def call(compiled=compiled, kwargs=kwargs):
                with torch.no_grad():
                    return compiled(**kwargs)

            for _ in range(10):
                call()
            back, alone = _host_us(call, args.calls)
            print(f"{family} {backend}: {back:.1f} us a call back to back, "
                  f"{alone:.1f} us alone (median)", flush=True)  # fmt: skip
            if backend != "infinifuse":
                continue
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                call()
            profile.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
            print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main()
