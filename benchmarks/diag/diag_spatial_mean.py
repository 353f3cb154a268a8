"""Does kernels/spatial_mean.py beat aten's mean over H x W of a channels-last tensor?

Device time per call (``triton.testing.do_bench``, CUDA-graph replays of 20 calls) of
``x.mean((2, 3), keepdim=True)`` and of ``spatial_mean(x, True)``, fp16, x channels-last, at
the squeeze-excite shapes of EfficientNet-B0 and MobileNetV3-large (224 x 224 images) and a
ResNet-50 head, batch 1 and 8.

    python benchmarks/diag/diag_spatial_mean.py [--out /tmp/spatial_mean.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from fusebackend.kernels.spatial_mean import spatial_mean

# (channels, side): EfficientNet-B0's SE inputs (stage by stage), MobileNetV3-large's, and
# a ResNet-50 head
SHAPES = [(32, 112), (96, 56), (144, 56), (240, 28), (480, 14), (672, 14), (1152, 7),
          (72, 28), (120, 28), (960, 7), (2048, 7)]  # fmt: skip


def device_us(fn, calls: int = 20, rep_ms: int = 200) -> float:
    """Device time of one ``fn()`` in us: ``calls`` calls captured in one CUDA graph, its
    replays timed by ``triton.testing.do_bench`` for ``rep_ms``."""
    import triton

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile, allocate
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    rows = []
    for batch in (1, 8):
        for channels, side in SHAPES:
            x = torch.randn(batch, channels, side, side, device="cuda", dtype=torch.float16)
            x = x.contiguous(memory_format=torch.channels_last)
            aten = device_us(lambda x=x: x.mean((2, 3), keepdim=True))
            ours = device_us(lambda x=x: spatial_mean(x, True))
            err = (spatial_mean(x, True).float() - x.float().mean((2, 3), keepdim=True)).abs().max()
            row = {"shape": [batch, channels, side, side], "aten_us": round(aten, 2),
                   "spatial_mean_us": round(ours, 2), "ratio": round(ours / aten, 3),
                   "max_abs_err": err.item()}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
