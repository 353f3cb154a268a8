"""Is a reduction over a dim other than the last cheaper in the group after it, or as aten's
own kernel before that group? (GPU diag)

``passes/axis_reductions.py`` reads ``x.mean(d)`` along the rows of a permuted view, so that
the reduction joins the elementwise ops after it: one kernel where aten's reduction and a
group were two, but the kernel's loads of a row (the reduced elements, ``stride(d)`` apart)
do not coalesce. Per shape and dtype this compiles ``m = x.mean(1)`` followed by a
per-channel scale and shift in fp32 (a BatchNorm1d made a scale and shift, as LeViT's head
has it) twice, with the rewrite and without it (``MAX_ELEMENTS`` 0), and reports the device
time of the kernels of one call (``torch.profiler``, mean over ``--calls`` replays) and the
kernels per call; then sentence-transformers' mean pooling as written (the masked product,
both sums, the clamp and the division) in fp16, one query's and two corpus batches' shapes.

What it found (H200, fp16): at aa6313a the one group was faster at every shape, 1.18-4.33
us against 3.24-6.91 for aten's mean then the group, up to 32 x 128 x 384 (1.6M elements);
fp32 alike (2.86-12.51 against 4.86-14.09). At d628af3 the pooling took 3.71 and 6.70 us
against 6.59 and 15.07 at 1 x 12 x 384 and 32 x 57 x 384, and 23.09 against 15.45 at 32 x
128 x 768 (3.1M elements), so the pass takes tensors up to 32 x 128 x 384 (``MAX_ELEMENTS``).

    python benchmarks/diag/diag_axis_reductions.py [--calls 50] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(1, 16, 384), (8, 16, 384), (8, 49, 768), (4, 256, 256), (32, 128, 384)]
POOLING_SHAPES = [(1, 12, 384), (32, 57, 384), (32, 128, 768)]  # a query; corpus batches


def _kernel_time(fn, args: tuple, calls: int) -> tuple[float, float]:
    """(device microseconds of the kernels of one call, kernels per call)."""
    for _ in range(3):  # the 2nd call captures, the 3rd replays
        fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.startswith("Memcpy")]  # fmt: skip
    return sum(e.device_time for e in events) / calls, len(events) / calls


def _mean_and_affine(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, tuple]:
    scale = torch.rand(shape[-1], device="cuda") + 0.5
    shift = torch.randn(shape[-1], device="cuda")

    def fn(x):
        return ((x.mean(1).float() - 0.25) * scale + shift).to(x.dtype)

    return fn, (torch.randn(shape, device="cuda").to(dtype),)


def _mean_pooling(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, tuple]:
    """sentence-transformers' mean pooling as written, over a mask of ~70% ones."""

    def fn(h, mask):
        expanded = mask.unsqueeze(-1).expand(h.size()).to(h.dtype)
        return torch.sum(h * expanded, 1) / torch.clamp(expanded.sum(1), min=1e-9)

    mask = (torch.rand(shape[:2], device="cuda") > 0.3).to(torch.int64)
    return fn, (torch.randn(shape, device="cuda").to(dtype), mask)


def measure(shape: tuple[int, ...], dtype: torch.dtype, calls: int,
            case: str = "mean_affine") -> dict[str, object]:  # fmt: skip
    import fusebackend.passes.axis_reductions as pass_module

    fn, args = (_mean_pooling if case == "pooling" else _mean_and_affine)(shape, dtype)
    row: dict[str, object] = {"case": case, "shape": list(shape),
                              "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    default = pass_module.MAX_ELEMENTS
    for name, limit in (("in_group", 1 << 30), ("aten_then_group", 0)):
        pass_module.MAX_ELEMENTS = limit
        torch._dynamo.reset()
        try:
            compiled = torch.compile(fn, backend="infinifuse")
            with torch.no_grad():
                us, kernels = _kernel_time(compiled, args, calls)
                error = (compiled(*args).float() - fn(*args).float()).abs().max().item()
        finally:
            pass_module.MAX_ELEMENTS = default
        row[f"{name}_us"], row[f"{name}_kernels"] = round(us, 2), kernels
        row[f"{name}_max_abs_err"] = error
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = [measure(shape, dtype, args.calls) for shape in SHAPES
            for dtype in (torch.float16, torch.float32)]  # fmt: skip
    rows += [measure(shape, torch.float16, args.calls, "pooling") for shape in POOLING_SHAPES]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        from ledger import environment

        with open(args.out, "w") as f:
            json.dump({"benchmark": "diag_axis_reductions", "environment": environment(),
                       "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
