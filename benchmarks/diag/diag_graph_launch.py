"""Does a CUDA graph's launch latency grow with its kernel count, and does launching it as
several smaller graphs start the work sooner?

In the vision suite (H200, c4a113d) a call timed alone (synchronize, call, synchronize) cost
more over its kernel time the more kernels its graph had, under both CUDA-graph backends:
about 90 us for ResNet-18's 27 kernels, 120 for ResNet-50's 61, 310 for EfficientNet-B0's
186 and RegNetY-016's 321. ``diag_replay_gaps.py`` (f2910a5) found GhostNet-100's replayed
graph starting its first kernel 183-200 us after the input copy before it, while
``CUDAGraph.replay`` returned in about 25 us of host time.

This captures a chain of N small kernels of one kind (``--ops``: elementwise adds, cuBLAS
matmuls, cuDNN convolutions; each reads the previous one's output), as one graph or cut into
P graphs replayed one after another, and times per N and P, as medians over ``--calls``:

- ``alone_us``: synchronize, replay, synchronize (a call timed alone);
- ``loop_us``: replays back to back, per replay;
- ``host_us``: the replay calls' own host time.

What it found (53971a9 and 436a774, H200): no. A graph timed alone took longer than back to
back (8-16 us) at every length from 25 to 400 kernels, for adds, cuBLAS matmuls and cuDNN
convolutions alike, and cutting it into 2-8 graphs added about 5 us of host time a part without
starting anything sooner.

    python benchmarks/diag/diag_graph_launch.py [--kernels 25,50,100,200,400] [--parts 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diag_vision_host import per_call  # noqa: E402  (a sibling diag: one timing rule)


def make_op(kind: str, numel: int):
    """(input, one step of the chain) for a kernel kind: ``add`` (an elementwise add over
    ``numel`` fp16 elements), ``mm`` (cuBLAS: [64, 256] @ [256, 256]), ``conv1x1`` and
    ``dwconv3x3`` (cuDNN, channels-last fp16 [1, 64, 56, 56]: a 1x1 convolution, a depthwise
    3 x 3 one)."""
    half = {"device": "cuda", "dtype": torch.float16}
    if kind == "add":
        return torch.randn(numel, **half), lambda y: torch.add(y, 0.0001)
    if kind == "mm":
        w = torch.randn(256, 256, **half) / 16
        return torch.randn(64, 256, **half), lambda y: y @ w
    image = torch.randn(1, 64, 56, 56, **half).to(memory_format=torch.channels_last)
    if kind == "conv1x1":
        w = (torch.randn(64, 64, 1, 1, **half) / 8).to(memory_format=torch.channels_last)
        return image, lambda y: torch.nn.functional.conv2d(y, w)
    if kind == "dwconv3x3":
        w = (torch.randn(64, 1, 3, 3, **half) / 3).to(memory_format=torch.channels_last)
        return image, lambda y: torch.nn.functional.conv2d(y, w, padding=1, groups=64)
    raise ValueError(f"unknown --ops kind {kind!r}")


def capture_chain(x: torch.Tensor, step, kernels: int, parts: int) -> tuple[list, torch.Tensor]:
    """``parts`` graphs that together apply ``step`` ``kernels`` times to ``x``."""
    sizes = [kernels // parts + (i < kernels % parts) for i in range(parts)]
    graphs, y = [], x
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside capture (the caching allocator, lazy init)
            z = x
            for _ in range(kernels):
                z = step(z)
    torch.cuda.current_stream().wait_stream(stream)
    pool = torch.cuda.graph_pool_handle()
    for size in sizes:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            for _ in range(size):
                y = step(y)
        graphs.append(graph)
    return graphs, y


def time_graphs(graphs: list, calls: int) -> dict[str, float]:
    """``alone_us``, ``host_us`` and ``loop_us`` of replaying ``graphs`` in order, timed as
    ``diag_vision_host.per_call`` times a model's call."""

    def replay(_: object) -> None:
        for g in graphs:
            g.replay()

    return per_call(replay, None, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="add", help="kernel kinds: add,mm,conv1x1,dwconv3x3")
    parser.add_argument("--kernels", default="25,50,100,200,400")
    parser.add_argument("--parts", default="1,2,4,8")
    parser.add_argument("--numel", type=int, default=1 * 56 * 56 * 64)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for kind in args.ops.split(","):
        x, step = make_op(kind, args.numel)
        for kernels in (int(k) for k in args.kernels.split(",")):
            for parts in (int(p) for p in args.parts.split(",")):
                if parts > kernels:
                    continue
                graphs, _ = capture_chain(x, step, kernels, parts)
                row = {"op": kind, "kernels": kernels, "parts": parts, "numel": args.numel,
                       "commit": args.commit, **time_graphs(graphs, args.calls)}  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
                del graphs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
