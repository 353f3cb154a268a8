"""Where does a suite workload's call spend its time: on the host, in kernels, or between them?

On an H200 at 1c42a4c the one-row GEMV along N (GPT-2's Conv1D weights) took 3.9 us for
c_attn where it had taken 6.2, and GPT-2's one-token forward (``run.py --only gpt2-token``)
went from 386 to 286 us of kernel time a call without graphs, but from only 0.407 to 0.388
ms a call with graphs. This times one ``benchmarks/suite`` workload per backend, in one
process, once its graphs are captured:

- ``rel_error``: the steady call's main output against eager's (the suite's measure);
- ``host_us``: from the call until it returns, after a synchronize (the launch path);
- ``alone_us``: the call and a synchronize (the suite's ``per_call_ms``);
- ``loop_us``: calls back to back between two synchronizations, per call;
- from ``torch.profiler`` over one call (a replay's kernels included): ``span_us`` from the
  first kernel's start to the last one's end, ``kernel_us`` their summed durations (kernels
  launched as programmatic dependents overlap, so it can exceed the span), the largest gaps
  and the kernels with the most time.

Backends: those of ``suite/measure.py``, its flag variants included (``infinifuse-nopdl``
runs without programmatic dependent launch). A backend named twice is measured twice,
compiled afresh, to show the spread between two measurements of one build. ``--profile N``
adds, for infinifuse's backends, a cProfile of the timed calls' host side (the N functions
with the most own time).

``--workload`` takes several names or prefixes (``zoo``: the model zoo's 21 families, one
after another). ``--interleave R`` keeps every backend's build alive and times R rounds of
``--loop`` calls with the backends taking turns (``interleaved_us``, the median round): the
zoo's 2-layer calls are host time, and in ``run.py``, which times one backend after another,
a row's level moved between processes while its rounds agreed (RoBERTa at 2.07x
reduce-overhead's at 3218872, XLM-R, the same architecture, level with it). Taking turns puts
a shared machine's load on both backends alike.

What it found (H200, 2026-12-01, 8dd2a69, GPT-2's one-token forward, two builds each):
infinifuse's call returned after 200-249 us of host time (reduce-overhead's: 525), the call
and a synchronize took 459-482 us (905), back to back 282-298 us (440). In the profiled
call the replay's first kernel came 84-134 us after the input copy, and its kernels ran
282-297 us after it. One-step GEMV tiles along N read before the wait on the previous
kernel (an A/B flag, removed after) spanned 433-487 us against 381-415.

    python benchmarks/diag/diag_suite_call.py --workload gpt2-token \
        [--backends infinifuse,reduce-overhead] [--profile 25] [--out F.json]
    python benchmarks/diag/diag_suite_call.py --workload zoo --interleave 7 --reps 50
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from diag_replay_gaps import by_name, kernels_of_last_call, summarize  # noqa: E402
from diag_vision_host import (  # noqa: E402
    add_interleave_arguments,
    interleaved,
    per_call,
    profile,
    write_rows,
)
from suite import measure, workloads  # noqa: E402


def make_call(case: workloads.Case, backend: str) -> Callable[..., object]:
    """The compiled call of ``case`` under ``backend`` (reduce-overhead's: after marking a
    step begun, as its cudagraph trees ask), taking and ignoring one argument: the ``x`` of
    the (fn, x) helpers it is timed with."""
    fn = measure.make_fn(case.model, backend)
    step = torch.compiler.cudagraph_mark_step_begin if backend == "reduce-overhead" else None

    def call(_: object = None) -> object:
        if step is not None:
            step()
        with torch.no_grad():
            return fn(**case.kwargs)

    return call


def replay_phases(call: Callable[..., object], calls: int) -> dict[str, float]:
    """Median host microseconds of a call before its first graph replay starts
    (``pre_replay_us``), inside the replays (``replay_us``: the graph launches) and after the
    last one returns (``post_replay_us``), with ``torch.cuda.CUDAGraph.replay`` timed (both
    backends replay through it); ``replays``: graph replays a call."""
    graph_class = torch.cuda.CUDAGraph
    original = graph_class.replay
    marks: list[float] = []

    def timed(self: torch.cuda.CUDAGraph) -> None:
        marks.append(time.perf_counter())
        original(self)
        marks.append(time.perf_counter())

    phases: dict[str, list[float]] = {"pre": [], "in": [], "post": [], "replays": []}
    graph_class.replay = timed
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            marks.clear()
            start = time.perf_counter()
            call()
            end = time.perf_counter()
            if not marks:
                continue
            phases["pre"].append(marks[0] - start)
            phases["in"].append(sum(b - a for a, b in zip(marks[::2], marks[1::2])))
            phases["post"].append(end - marks[-1])
            phases["replays"].append(len(marks) // 2)
    finally:
        graph_class.replay = original
    if not phases["pre"]:
        return {"replays": 0}
    us = {f"{k}_replay_us": round(statistics.median(phases[k]) * 1e6, 1) for k in ("pre", "post")}
    return {**us, "replay_us": round(statistics.median(phases["in"]) * 1e6, 1),
            "replays": statistics.median(phases["replays"])}  # fmt: skip


def measure_workload(
    workload: workloads.Workload, backends: list[str], args: argparse.Namespace
) -> list[dict]:
    """One row per backend: the call's host, device and replay figures; with
    ``--interleave R`` every backend's build stays alive and R rounds take turns."""
    device = torch.device("cuda")
    rows, calls, cases = [], {}, []
    measure.fresh_state(device)
    for backend in backends:
        if not args.interleave:
            measure.fresh_state(device)
        # A decode case's cache holds the calls between two resets (``case.prepare``, run
        # before each phase and each round here): the longest stretch is per_call's.
        case = workload.build(device, 10 + max(2 * args.reps, args.loop))
        with torch.no_grad():
            eager = measure.references(case, device)[-1]
        case.prepare()
        call = make_call(case, backend)
        # compile, capture, steady: as many calls as eager's references, so that a decode
        # step is compared with eager's at the same cache position (five calls against the
        # fourth reference read 0.69 for GPT-2's decode under both backends, H200, 2026-12-02)
        for _ in range(measure.WARMUP + 1):
            out = measure._grab(case, call())
        row = {
            "workload": workload.name,
            "backend": backend,
            "commit": args.commit,
            "rel_error": measure.rel_error(out, eager),
        }
        del out
        case.prepare()
        row.update(per_call(call, None, args.reps))
        case.prepare()
        row.update(replay_phases(call, args.reps))
        case.prepare()
        kernels = kernels_of_last_call(call, None, lambda: None)
        row.update(summarize(kernels, args.top))
        top = sorted(by_name(kernels).items(), key=lambda kv: -kv[1])[: args.top]
        row["top_kernels"] = [(round(us, 1), name) for name, us in top]
        if args.profile and backend.startswith("infinifuse"):
            case.prepare()
            row["host_profile"] = profile(call, None, args.reps, args.profile)
        print(json.dumps({k: v for k, v in row.items() if k != "host_profile"}), flush=True)
        print(row.get("host_profile", ""), flush=True)
        rows.append(row)
        if args.interleave:
            calls[backend if backend not in calls else f"{backend}#{len(rows)}"] = call
            cases.append(case)
        del case, call
    if args.interleave:
        prepares = dict(zip(calls, (case.prepare for case in cases), strict=True))
        timed_rows = interleaved(calls, args.interleave, args.loop, prepares).values()
        for row, timed in zip(rows, timed_rows, strict=True):
            row.update(timed)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        default="gpt2-token",
        help="comma-separated names or prefixes (zoo: its 21 families)",
    )
    parser.add_argument("--backends", default="infinifuse,reduce-overhead")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--reps", type=int, default=200)
    add_interleave_arguments(parser)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None, help="JSON results, rewritten per workload")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    for workload in workloads.select(workloads.workloads(False, device), args.workload):
        results += measure_workload(workload, args.backends.split(","), args)
        if args.out:
            write_rows(args.out, "diag_suite_call", args.commit, results)
    print(f"{'workload':18} {'backend':20} {'host us':>8} {'alone us':>9} {'loop us':>8} "
          f"{'turns us':>8} {'span us':>8} {'kernel us':>9} {'kernels':>7} "
          f"{'pre/in/post replay us':>22}")  # fmt: skip
    for r in results:
        phases = f"{r.get('pre_replay_us')}/{r.get('replay_us')}/{r.get('post_replay_us')}"
        print(f"{r['workload']:18} {r['backend']:20} {r['host_us']:8.1f} {r['alone_us']:9.1f} "
              f"{r['loop_us']:8.1f} {r.get('interleaved_us', 0):8.1f} {r.get('span_us', 0):8.1f} "
              f"{r.get('kernel_us', 0):9.1f} {r['kernels']:7} {phases:>22}")  # fmt: skip


if __name__ == "__main__":
    main()
