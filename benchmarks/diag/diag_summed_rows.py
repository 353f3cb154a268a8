"""Does a matmul group that adds its rows itself (``MatmulGroup.sum_rows``) cost less than
the aten add it replaces? (a tensor-parallel layer's residual + all-reduce before its norm)

For each shape, fp16, one row: a chain of ``--chain`` (x, addend) pairs captured in one CUDA
graph and replayed between CUDA events, three ways:

- ``aten_add``: ``h = x + addend`` (an aten kernel), then the group on ``h`` (norm prologue);
- ``summed``: the group on ``x`` and ``addend`` (``sum_rows``), returning the sum;
- ``summed_unreturned``: the same without returning the sum (the last layer's).

Outputs are checked equal (within fp16's tolerance) before timing. Under 2 H100s (8B TP=2)
the whole step's matmul groups took 3.82 ms of device time with summed rows against
3.31 ms + 0.09 ms of adds without: this measures each launch alone.

    python benchmarks/diag/diag_summed_rows.py [--chain 32] [--out file.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
import triton

from fusebackend.kernels import matmul
from fusebackend.kernels.ir import MatmulGroup

# name: (K, sibling widths, gated)
SHAPES = {
    "llama3-8b-tp2 gate/up": (4096, (7168, 7168), True),
    "llama3-8b-tp2 q/k/v": (4096, (2048, 512, 512), False),
    "llama3-8b-tp1 gate/up": (4096, (14336, 14336), True),
    "tinyllama gate/up": (2048, (5632, 5632), True),
    "llama3-8b lm head (tp2)": (4096, (64128,), False),
}


def variants(k: int, widths: tuple[int, ...], gated: bool, chain: int):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).half()

    norm = rand(k, scale=0.1) + 1.0
    weights = [rand(n, k, scale=k**-0.5) for n in widths]
    pairs = [(rand(1, 1, k), rand(1, 1, k)) for _ in range(chain)]
    base = {"siblings": len(widths), "norm": "rms", "eps": 1e-5, "gate": "silu" if gated else ""}
    plain = matmul.matmul_op(MatmulGroup(**base))
    summed = matmul.matmul_op(MatmulGroup(**base, sum_rows=True, sum_output=True))
    unreturned = matmul.matmul_op(MatmulGroup(**base, sum_rows=True))

    def aten_add():
        return [plain(x + a, norm, None, None, *weights) for x, a in pairs]

    def with_sum():
        return [summed(x, norm, None, None, *weights, a) for x, a in pairs]

    def without_sum():
        return [unreturned(x, norm, None, None, *weights, a) for x, a in pairs]

    return {"aten_add": aten_add, "summed": with_sum, "summed_unreturned": without_sum}


def timed(step, replays: int = 20, repeats: int = 7) -> tuple[float, list]:
    """Median microseconds per replay of ``step`` captured in a CUDA graph, and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=int, default=32, help="launches per captured graph")
    parser.add_argument("--out", help="JSON path")
    args = parser.parse_args()
    results = []
    for name, (k, widths, gated) in SHAPES.items():
        runs = variants(k, widths, gated, args.chain)
        row = {"shape": name, "k": k, "widths": list(widths), "gated": gated}
        outputs = {}
        for label, step in runs.items():
            try:
                us, out = timed(step)
            except Exception as error:  # a launch that does not compile: say which
                row[f"{label}_error"] = f"{type(error).__name__}: {error}"[:300]
                print(f"{name}: {label} failed: {row[f'{label}_error']}", flush=True)
                continue
            row[f"{label}_us_per_launch"] = us / args.chain
            outputs[label] = out
        for label in ("summed", "summed_unreturned"):
            for want, got in zip(outputs.get("aten_add", []), outputs.get(label, []), strict=False):
                torch.testing.assert_close(got[: len(want)], want, rtol=2e-3, atol=2e-3)
        results.append(row)
        timings = [(label, row.get(f"{label}_us_per_launch")) for label in runs]
        line = "".join(f"  {label} {us:7.2f} us" for label, us in timings if us is not None)
        print(f"{name:28s}{line}", flush=True)
    report = {
        "environment": {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "chain": args.chain,
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
