"""Where does a replayed CUDA graph spend its time: in kernels, or between them?

The vision suite (H200, c4a113d) timed GhostNet-100's calls back to back at 0.617 ms (batch 1)
and 1.040 ms (batch 8) under infinifuse, with 408 and 723 us of kernel time in a call without
graphs; reduce-overhead's took 0.456 and 0.759 ms with 398 and 689 us. Other models' loops
ran 30-65 us over their kernel time under both backends. This profiles replays of the
captured graph itself (``torch.profiler`` sees a graph's kernels with their device
timestamps) and, per model (timm, ``pretrained=False``, BatchNorm statistics calibrated as
``vision.py`` does, fp16), batch and backend, prints:

- ``span_us``: the last kernel's end less the first kernel's start, in one replay;
- ``kernel_us``: the kernels' summed durations there; ``gap_us``: the span less that;
- the largest gaps, each with the kernels before and after it;
- the kernels whose in-graph time differs most from the same call's time without graphs
  (infinifuse only: compiled again with ``cudagraphs=False``, as ``vision.py`` counts).

What it found (f2910a5 and 436a774, H200): inside a replay the kernels follow each other
within 0.3-1 us under both backends (GhostNet-100 and ConvNeXt-tiny); the one large gap is
before the graph's first kernel, after the input copy (183-200 us for GhostNet under
infinifuse, 260-300 under reduce-overhead, with the profiler on), and ConvNeXt-tiny's graph
spans 1019.5 us under either backend at batch 8. The suite's GhostNet loop figures came from
two processes sharing the host: alone in a process its calls ran 468 us back to back at batch
1 (``diag_vision_host.py``).

    python benchmarks/diag/diag_replay_gaps.py [--models ghostnet_100,mobilenetv3_large_100]
        [--batches 1,8] [--out F.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kernels_of_last_call(fn, x, step, calls: int = 3) -> list[dict]:
    """The CUDA kernels (name, start, duration in us) of the last of ``calls`` profiled calls,
    in device order; a call's kernels are those after the previous call's last one."""
    for _ in range(3):
        step()
        fn(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
            fn(x)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [
        {"name": e.name, "start": e.time_range.start, "us": e.time_range.end - e.time_range.start}
        for e in events
        if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()
    ]
    kernels.sort(key=lambda k: k["start"])
    per_call = len(kernels) // calls
    return kernels[-per_call:] if per_call else []


def summarize(kernels: list[dict], top: int) -> dict:
    if not kernels:
        return {"kernels": 0}
    span = kernels[-1]["start"] + kernels[-1]["us"] - kernels[0]["start"]
    busy = sum(k["us"] for k in kernels)
    gaps = []
    for before, after in zip(kernels, kernels[1:]):
        gap = after["start"] - (before["start"] + before["us"])
        gaps.append((round(gap, 2), before["name"][:70], after["name"][:70]))
    gaps.sort(reverse=True)
    return {
        "kernels": len(kernels),
        "span_us": round(span, 1),
        "kernel_us": round(busy, 1),
        "gap_us": round(span - busy, 1),
        "largest_gaps": gaps[:top],
    }


def by_name(kernels: list[dict]) -> dict[str, float]:
    total: dict[str, float] = collections.defaultdict(float)
    for k in kernels:
        total[k["name"][:90]] += k["us"]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ghostnet_100,mobilenetv3_large_100")
    parser.add_argument("--backends", default="infinifuse,reduce-overhead")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None, help="JSON results")
    args = parser.parse_args()
    from vision import build_model, calibrate_norms

    results = []
    for name in args.models.split(","):
        model = build_model(name, 0).to("cuda")
        calibrate_norms(model, 224, torch.device("cuda"), 0)
        model.to(torch.float16).train().eval()
        for backend in args.backends.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                torch._dynamo.reset()
                x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16)
                if backend == "reduce-overhead":
                    fn = torch.compile(model, mode="reduce-overhead", dynamic=False)
                    step = torch.compiler.cudagraph_mark_step_begin
                else:
                    fn = torch.compile(model, backend="infinifuse", dynamic=False)
                    step = lambda: None  # noqa: E731
                with torch.no_grad():
                    replayed = kernels_of_last_call(fn, x, step)
                    row = {"model": name, "batch": batch, "backend": backend,
                           "commit": args.commit, **summarize(replayed, args.top)}  # fmt: skip
                    if backend == "infinifuse":
                        torch._dynamo.reset()
                        plain = torch.compile(model, backend="infinifuse", dynamic=False,
                                              options={"cudagraphs": False})  # fmt: skip
                        alone = by_name(kernels_of_last_call(plain, x, step))
                        graph = by_name(replayed)
                        names = set(graph) | set(alone)
                        diffs = [(round(graph.get(k, 0) - alone.get(k, 0), 1), k) for k in names]
                        diffs.sort(reverse=True)
                        row["graph_minus_alone_us"] = diffs[: args.top]
                        row["alone_kernel_us"] = round(sum(alone.values()), 1)
                print(json.dumps(row, indent=1), flush=True)
                results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
