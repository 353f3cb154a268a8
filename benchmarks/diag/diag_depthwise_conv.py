"""Where does a depthwise convnet's first call go among its convolutions, and does a Triton
depthwise convolution (``kernels/depthwise_conv.py``) beat cuDNN's per call?

1. First calls, by kind of convolution: each timm model's 2-d convolution shapes (forward
   hooks on a CPU run) are run once, in fp16 channels-last as the fused graph runs them, in a
   fresh process per model (cuDNN's plans cold), each call timed alone between
   synchronizations; then each again (plans warm). Summed per kind: depthwise, 1 x 1, other
   (dense or grouped).
2. Per call, each depthwise shape: cuDNN's convolution alone, against the Triton kernel with
   a per-channel scale and shift and SiLU in it (what replaces the convolution and the
   elementwise kernel after it); device time per launch from CUDA-graph replays of 20 launches.

    python benchmarks/diag/diag_depthwise_conv.py [--models efficientnet_b0,ghostnet_100]
        [--batch 1] [--sweep] [--commit C] [--out result.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(_BENCHMARKS), _BENCHMARKS]


def conv_shapes(name: str, batch: int) -> list[dict[str, Any]]:
    """Every 2-d convolution of timm's ``name`` (pretrained=False) on a 224 x 224 batch."""
    import timm

    model = timm.create_model(name, pretrained=False).eval()
    found: list[dict[str, Any]] = []

    def hook(module: torch.nn.Conv2d, inputs: tuple[Any, ...], _: Any) -> None:
        found.append({
            "input": [batch, *inputs[0].shape[1:]], "weight": list(module.weight.shape),
            "stride": list(module.stride), "padding": list(module.padding),
            "dilation": list(module.dilation), "groups": module.groups,
        })  # fmt: skip

    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d) and isinstance(module.padding, tuple):
            module.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    return found


def kind(shape: dict[str, Any]) -> str:
    channels, groups = shape["input"][1], shape["groups"]
    if groups == channels and shape["weight"][0] == channels:
        return "depthwise"
    if shape["weight"][2:] == [1, 1] and groups == 1:
        return "1x1"
    return "other"


def _tensors(shape: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(shape["input"], device="cuda", dtype=torch.float16)
    w = torch.randn(shape["weight"], device="cuda", dtype=torch.float16)
    layout = torch.channels_last
    return x.contiguous(memory_format=layout), w.contiguous(memory_format=layout)


def _conv(shape: dict[str, Any], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, None, shape["stride"], shape["padding"], shape["dilation"],
                    shape["groups"])  # fmt: skip


def first_calls(name: str, batch: int) -> dict[str, Any]:
    """Part 1 for one model (run in a fresh process)."""
    shapes = conv_shapes(name, batch)
    torch.zeros(1, device="cuda")
    cold: dict[str, float] = collections.defaultdict(float)
    warm: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for round_, totals in ((0, cold), (1, warm)):
        for shape in shapes:
            x, w = _tensors(shape)
            torch.cuda.synchronize()
            start = time.perf_counter()
            _conv(shape, x, w)
            torch.cuda.synchronize()
            totals[kind(shape)] += time.perf_counter() - start
            if round_ == 0:
                counts[kind(shape)] += 1
    return {"model": name, "batch": batch, "convolutions": dict(counts),
            "cold_s": {k: round(v, 4) for k, v in cold.items()},
            "warm_s": {k: round(v, 4) for k, v in warm.items()}}  # fmt: skip


def _graph_us(fn: Any, launches: int = 20, replays: int = 20) -> float:
    """Device time of one ``fn()`` from replays of a CUDA graph of ``launches`` calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (launches * replays)


_SWEEP = [(p, c, w) for p in (16, 32, 64, 128) for c in (16, 32, 64) for w in (2, 4)]


def _inputs(shape: dict[str, Any]) -> tuple[Any, ...]:
    x, w = _tensors(shape)
    channels = shape["input"][1]
    scale = torch.rand(channels, device="cuda") + 0.5
    shift = torch.randn(channels, device="cuda")
    stride, padding, dilation = (tuple(shape[k]) for k in ("stride", "padding", "dilation"))
    return x, w, stride, padding, dilation, None, scale, shift, "silu"


def _sweep(shape: dict[str, Any]) -> dict[str, Any]:
    """The kernel's time at each launch configuration of ``_SWEEP``: the best one."""
    from fusebackend.kernels import depthwise_conv as dw

    inputs = _inputs(shape)
    out = dw._empty_output(inputs[0], dw._output_shape(*inputs[:5]))
    times = {}
    for config in _SWEEP:
        args, grid, meta = dw._launch(*inputs, None, out, config=config)
        times[config] = _graph_us(lambda: dw._kernel()[grid](*args, **meta))  # noqa: B023
    best = min(times, key=times.get)
    return {"best_config": list(best), "best_us": round(times[best], 2)}


def _precompile_sweep(shapes: list[dict[str, Any]]) -> None:
    """Compile every (shape, configuration) of the sweep at once, over the CPU's cores."""
    import functools

    from fusebackend.kernels import depthwise_conv as dw
    from fusebackend.kernels.triton_api import precompile_all, warmup_launch

    def job(shape: dict[str, Any], config: tuple[int, int, int]) -> None:
        inputs = _inputs(shape)
        out = dw._empty_output(inputs[0], dw._output_shape(*inputs[:5]))
        args, grid, meta = dw._launch(*inputs, None, out, config=config)
        warmup_launch(dw._kernel(), grid, args, meta, out.device)

    precompile_all([functools.partial(job, s, c) for s in shapes for c in _SWEEP])


def _compare(shape: dict[str, Any], sweep: bool) -> dict[str, Any]:
    """cuDNN's convolution alone against the Triton kernel with scale, shift and SiLU."""
    from fusebackend.kernels.depthwise_conv import depthwise_conv2d

    x, w, stride, padding, dilation, _, scale, shift, _ = _inputs(shape)

    def ours() -> torch.Tensor:
        return depthwise_conv2d(x, w, stride, padding, dilation, None, scale, shift, "silu")

    expected = F.silu(_conv(shape, x, w).float() * scale.view(-1, 1, 1) + shift.view(-1, 1, 1))
    return {
        "cudnn_us": round(_graph_us(lambda: _conv(shape, x, w)), 2),
        "triton_us": round(_graph_us(ours), 2),
        "max_abs_err": (ours().float() - expected).abs().max().item(),
        **(_sweep(shape) if sweep else {}),
    }


def per_call(names: list[str], batch: int, sweep: bool) -> list[dict[str, Any]]:
    """Part 2: each distinct depthwise shape of the models (``sweep``: and the kernel's best
    launch configuration)."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for name in names:
        for shape in conv_shapes(name, batch):
            if kind(shape) == "depthwise":
                found.setdefault(json.dumps(shape, sort_keys=True), (name, shape))
    if sweep:
        _precompile_sweep([shape for _, shape in found.values()])
    rows = []
    for name, shape in found.values():
        rows.append({"model": name, **shape, **_compare(shape, sweep)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="efficientnet_b0,ghostnet_100,mobilenetv3_large_100")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--first-calls-of", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--sweep", action="store_true", help="the kernel's launch sweep too")
    parser.add_argument("--no-first-calls", action="store_true", help="part 2 alone")
    parser.add_argument("--commit", help="the commit measured, where the checkout has no git")
    args = parser.parse_args()
    if args.first_calls_of:
        print(json.dumps(first_calls(args.first_calls_of, args.batch)))
        return
    names = args.models.split(",")
    from ledger import environment  # (benchmarks/ledger.py: its rows_of reads this file)

    result: dict[str, Any] = {"benchmark": "diag_depthwise_conv",
                              "environment": environment(),
                              "first_calls": [], "per_call": []}  # fmt: skip
    if args.commit:
        result["environment"]["commit"] = args.commit
    for name in [] if args.no_first_calls else names:
        child = subprocess.run(
            [sys.executable, __file__, "--first-calls-of", name, "--batch", str(args.batch)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        result["first_calls"].append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(json.dumps(result["first_calls"][-1]), flush=True)
    result["per_call"] = per_call(names, args.batch, args.sweep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
