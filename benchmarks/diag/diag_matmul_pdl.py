"""Does programmatic dependent launch pay for a decode step's matmul groups? (Hopper)

A chain of TinyLlama-shape MLP blocks, each three ``matmul_group`` launches as the fused
graph runs them (o projection + residual; RMSNorm + gate/up + SiLU-mul; down projection +
residual), fp16, one row, 22 blocks captured in one CUDA graph, replayed between CUDA
events: with ``kernels.dependent_launch.USE_PDL`` off, then on (each launch may begin while the
previous kernel runs and waits inside the kernel before its first read), each also with
``kernels.matmul.PREFETCH_K`` weight elements per tile row asked of L2 before that wait.
Outputs of all must be equal (the same kernels, the same order of sums).

    python benchmarks/diag/diag_matmul_pdl.py [--blocks 22] [--prefetch 512 1024] [--out f.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch
import triton

from fusebackend.kernels import dependent_launch, matmul
from fusebackend.kernels.ir import MatmulGroup


def build(blocks: int, hidden: int = 2048, inner: int = 5632):
    """Weights and the step function: x -> x after ``blocks`` MLP-like blocks."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5).half()

    layers = [
        (rand(hidden, hidden), rand(hidden), rand(inner, hidden), rand(inner, hidden),
         rand(hidden, inner))
        for _ in range(blocks)
    ]  # fmt: skip
    o = matmul.matmul_op(MatmulGroup(residual=True))
    gate_up = matmul.matmul_op(MatmulGroup(siblings=2, norm="rms", eps=1e-5, gate="silu"))
    down = matmul.matmul_op(MatmulGroup(residual=True))

    def step(x: torch.Tensor) -> torch.Tensor:
        for w_o, norm, w_gate, w_up, w_down in layers:
            (h,) = o(x, None, None, x, w_o)
            (a,) = gate_up(h, norm, None, None, w_gate, w_up)
            (x,) = down(a, None, None, h, w_down)
        return x

    return step


def timed(step, x: torch.Tensor, replays: int = 50, repeats: int = 7) -> tuple[float, torch.Tensor]:
    """Median microseconds per replay of ``step`` captured in a CUDA graph, and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x)
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / replays)
    return statistics.median(samples), out.clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=22)
    parser.add_argument("--out")
    parser.add_argument(
        "--prefetch", type=int, nargs="*", default=[128, 256, 512],
        help="weight elements per tile row asked of L2 before the wait",
    )  # fmt: skip
    args = parser.parse_args()
    step = build(args.blocks)
    x = torch.randn(1, 1, 2048, device="cuda").half()
    results = {}
    outputs = {}
    variants = [("off", False, 0), ("on", True, 0)]
    for prefetch in args.prefetch:
        variants += [(f"off, prefetch {prefetch}", False, prefetch),
                     (f"on, prefetch {prefetch}", True, prefetch)]  # fmt: skip
    variants.append(("off again", False, 0))
    defaults = dependent_launch.USE_PDL, matmul.PREFETCH_K
    for label, pdl, prefetch in variants:
        dependent_launch.USE_PDL, matmul.PREFETCH_K = pdl, prefetch
        try:
            results[label], outputs[label] = timed(step, x)
        except Exception as exc:  # a driver or Triton without PDL in graphs: say so
            results[label] = f"failed: {type(exc).__name__}: {exc}"[:300]
        finally:
            dependent_launch.USE_PDL, matmul.PREFETCH_K = defaults
    reference = outputs.get("off")  # absent where the plain launch failed
    same = {label: reference is not None and torch.equal(reference, out)
            for label, out in outputs.items()}  # fmt: skip
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "blocks": args.blocks,
        "launches": 3 * args.blocks,
        "us_per_step": results,
        "outputs_equal": same,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
