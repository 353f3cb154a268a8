"""Why the suite's GPT-2 decode row is slower for infinifuse than a plain loop of calls.

On an H100 (2026-11-25) the suite (benchmarks/run.py) timed GPT-2's decode step at 0.638 ms
per call with infinifuse against 0.534 ms with reduce-overhead, while diag_call_host.py's
loop of calls timed 0.51 against 0.53 ms. This runs, in one process, each backend through
the suite's own ``measure.measure`` (suite warm-up, rounds, output kept between calls) and
then a plain loop of calls on the same compiled function, at the suite's cache length and
at diag_call_host's, with and without the suite's process warm-up.

    python benchmarks/diag/diag_suite_host.py [--model gpt2-decode]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loop(fn, kwargs, calls: int) -> float:
    """ms per call of a plain loop (one synchronize at the end)."""
    for _ in range(5):
        fn(**kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(**kwargs)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    from suite import measure, workloads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-decode", help="a suite workload name")
    parser.add_argument("--backends", default="reduce-overhead,infinifuse")
    args = parser.parse_args()
    device = torch.device("cuda")
    (workload,) = workloads.select(workloads.workloads(False, device), args.model)
    backends = args.backends.split(",")
    suite_calls = 1 + measure.WARMUP + workload.rounds * workload.loop
    with torch.no_grad():
        for warm in (False, True):
            if warm:
                measure.warm_process(device, backends)
            for calls in (suite_calls, 620):
                case = workload.build(device, calls)
                refs = measure.references(case, device)
                for backend in backends:
                    measure.fresh_state(device)
                    row = measure.measure(workload, case, backend, device, refs)
                    measure.fresh_state(device)
                    fn = measure.make_fn(case.model, backend)  # compiled anew, then looped
                    case.prepare()
                    loop_ms = _loop(fn, case.kwargs, 100)
                    rounds = ", ".join(f"{r:.3f}" for r in row["per_call_ms_rounds"])
                    print(f"process warm-up {warm!s:5s} build calls {calls:4d} {backend:16s}: "
                          f"suite {row['per_call_ms']:.3f} ms (rounds {rounds}); plain loop "
                          f"{loop_ms:.3f} ms", flush=True)  # fmt: skip
                    measure.fresh_state(device)
                del case, refs


if __name__ == "__main__":
    main()
