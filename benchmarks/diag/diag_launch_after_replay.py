"""Does a launch right after a CUDA graph's replay cost the host more than the same launch alone?

In the zoo's 2-layer models timed in turns (H200, 2026-12-01, 2e81c0b) infinifuse spent more
host time than reduce-overhead after the graph replay returned in 19 of 21 families (BERT
98.1 against 27.6 us), though all it does there is copy its outputs out (one
``_foreach_copy_``, 12.92 us of host time in a probe without a graph) and a version check.
Reduce-overhead launches nothing after its replay. This times, per graph size (kernels in the
graph), the host time from before ``replay()`` until the call returns, a synchronize before
each call:

- ``replay``: the replay alone;
- ``replay+clone``: the replay, then one output cloned (one small launch);
- ``replay+foreach``: the replay, then two outputs allocated and copied by one
  ``_foreach_copy_`` (``runtime/outputs.py``'s way);
- ``clone``: the clone alone, no replay (the launch's own cost);
- ``replay+empty``: the replay, then the two allocations only (no launch).

If ``replay+clone`` exceeds ``replay`` by much more than ``clone`` alone costs, a launch queued
behind a graph waits for the graph's submission, and copies made after the replay cost the
host that wait. ``--zoo FAMILY`` times the same steps on the graph infinifuse captured for a
model zoo family (its Triton kernels, programmatic dependent launches included), with its own
outputs and ``runtime/outputs.py``'s ``copy_out``.

    python benchmarks/diag/diag_launch_after_replay.py [--kernels 20 60 150] [--calls 2000]
    python benchmarks/diag/diag_launch_after_replay.py --zoo bert roberta llama
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_graph(kernels: int, device: torch.device) -> tuple[torch.cuda.CUDAGraph, list]:
    """A graph of ``kernels`` small elementwise launches on a 2 x 7 x 64 fp16 tensor, and its
    two outputs (the last value and a 2 x 64 slice of it, as a 2-layer BERT returns)."""
    x = torch.randn(2, 7, 64, device=device, dtype=torch.float16)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up off the capture, as the runtime does
        y = x
        for _ in range(kernels):
            y = y * 1.0001 + 0.0001
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(kernels):
            y = y * 1.0001 + 0.0001
        outputs = [y, y[:, 0].contiguous()]
    return graph, outputs


def host_us(step: Callable[[], object], calls: int) -> float:
    """Median host microseconds of ``step``, the device idle at each start."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 2)


def zoo_graph(family: str, device: torch.device) -> tuple[torch.cuda.CUDAGraph, list]:
    """The CUDA graph infinifuse captured for ``family``'s model (tests/model_zoo.py, fp16)
    after five calls, and its output buffers."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import model_zoo

    import fusebackend

    torch._dynamo.reset()
    model = model_zoo.build(family, dtype=torch.float16, device=str(device))
    kwargs = model_zoo.inputs(family, device=str(device))
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(5):
            compiled(**kwargs)
    torch.cuda.synchronize()
    for graph_report in reversed(fusebackend.reports().graphs):
        cache = graph_report.runtime
        for _, entry in cache.table.captured() if cache is not None else ():
            # the outputs the runtime copies out: graph buffers, not inputs returned
            tensors = [t for t, alias in zip(entry.outputs, entry.aliases, strict=True)
                       if alias is None and isinstance(t, torch.Tensor)]  # fmt: skip
            return entry.graph, tensors
    raise SystemExit(f"{family}: no captured graph")


def measure_zoo(family: str, calls: int, device: torch.device) -> dict[str, float]:
    from fusebackend.runtime.outputs import copy_out

    graph, outputs = zoo_graph(family, device)
    positions = list(range(len(outputs)))

    def replay_copy() -> None:
        graph.replay()
        copy_out(list(outputs), positions)

    return timed_steps(
        {
            "replay": graph.replay,
            "replay+copy_out": replay_copy,
            "copy_out": lambda: copy_out(list(outputs), positions),
            "replay+clone": lambda: (graph.replay(), outputs[0].clone()),
            "clone": outputs[0].clone,
        },
        calls,
    ) | {"outputs": len(outputs)}


def timed_steps(steps: dict[str, Callable[[], object]], calls: int) -> dict[str, float]:
    """Each step's median host microseconds over two passes taken in turns (a shared host's
    drift falls on every step alike)."""
    for step in steps.values():  # warm the allocator and the launch paths
        host_us(step, 20)
    passes = [{name: host_us(step, calls // 2) for name, step in steps.items()} for _ in "ab"]
    return {name: round((passes[0][name] + passes[1][name]) / 2, 2) for name in steps}


def measure(kernels: int, calls: int, device: torch.device) -> dict[str, float]:
    graph, outputs = small_graph(kernels, device)
    first, second = outputs

    def replay_foreach() -> None:
        graph.replay()
        copies = [torch.empty_like(first), torch.empty_like(second)]
        torch._foreach_copy_(copies, outputs)

    def replay_empty() -> None:
        graph.replay()
        [torch.empty_like(first), torch.empty_like(second)]

    steps = {
        "replay": graph.replay,
        "replay+clone": lambda: (graph.replay(), first.clone()),
        "replay+foreach": replay_foreach,
        "clone": first.clone,
        "replay+empty": replay_empty,
    }
    return timed_steps(steps, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, nargs="+", default=[20, 60, 150])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--zoo", nargs="*", default=[], metavar="FAMILY",
                        help="also the captured graphs of these model zoo families")  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON of the rows, as ledger.py reads it")
    parser.add_argument("--commit", default=None, help="the commit measured, where there is no git")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for kernels in args.kernels:
        row = {"kernels": kernels, **measure(kernels, args.calls, device)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    for family in args.zoo:
        row = {"zoo": family, **measure_zoo(family, args.calls, device)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        sys.path.insert(0, os.path.dirname(__file__))
        from diag_vision_host import write_rows

        write_rows(args.out, "diag_launch_after_replay", args.commit, rows)


if __name__ == "__main__":
    main()
