"""Where the host time of one compiled decode call goes, infinifuse against reduce-overhead.

On an H100 (2026-11-25) GPT-2's decode step took 0.868 ms per call with infinifuse against
0.591 ms with reduce-overhead, while infinifuse's captured graph replays in 495 us of device
time: the call is host-bound. This times a loop of calls (one synchronize at the end) and
then profiles the same loop with cProfile, for each backend, so that the functions that
take the host's time per call can be compared.

    python benchmarks/diag/diag_call_host.py [--model gpt2-decode]
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
    from suite import workloads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-decode", help="a suite workload name")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument(
        "--backends",
        default="infinifuse,reduce-overhead",
        help="comma-separated, run in this order in the one process (the suite runs "
        "reduce-overhead before infinifuse)",
    )
    args = parser.parse_args()
    (workload,) = workloads.select(workloads.workloads(False, torch.device("cuda")), args.model)
    case = workload.build(torch.device("cuda"), 3 * args.calls + 20)
    for backend in args.backends.split(","):
        torch._dynamo.reset()
        case.prepare()
        if backend == "infinifuse":
            compiled = torch.compile(case.model, backend="infinifuse")
        else:
            compiled = torch.compile(case.model, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(5):
                compiled(**case.kwargs)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                compiled(**case.kwargs)
            torch.cuda.synchronize()
            per_call = (time.perf_counter() - start) / args.calls * 1e3
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                compiled(**case.kwargs)
            torch.cuda.synchronize()
            profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(f"=== {args.model} / {backend}: {per_call:.3f} ms per call ({args.calls} calls)")
        print(text.getvalue()[-6000:])


if __name__ == "__main__":
    main()
