"""Does channels-last pay for convnets under infinifuse, and which kernels take the time?

Issue 38 asks for channels-last "per graph where measured faster". This times, per timm model
(fp16, ``pretrained=False``) and batch, one call of: eager on the model and input as given
(NCHW) and made channels-last by hand; infinifuse with ``channels_last`` False and True (the
backend's own layout pass); reduce-overhead (NCHW, with ``--reduce-overhead``). Each row gives
the median per-call time and, over one call without CUDA graphs (reduce-overhead: Inductor's
default mode, the same kernels), the CUDA kernel count and the ``--top`` kernels taking the most
device time (name, launches, microseconds), where a slow layout shows: cuDNN's transposes around
an NCHW fp16 convolution (``nchwToNhwc``/``nhwcToNchw``), a convolution kernel slower in one
layout.

    python benchmarks/diag/diag_conv_layout.py [--models convnext_tiny] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import time

import torch

import fusebackend


def per_call_ms(fn, x, calls: int = 50) -> float:
    for _ in range(10):
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(x)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernels(fn, x, top: int) -> tuple[int, list[tuple[str, int, float]]]:
    """(CUDA kernels in one call, the top taking the most device time: name, launches, us)."""
    fn(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    launches, times = collections.Counter(), collections.Counter()
    for e in events:
        launches[e.name[:70]] += 1
        times[e.name[:70]] += e.device_time
    top = [(n, launches[n], round(t, 1)) for n, t in times.most_common(top)]
    return len(events), top


def run(
    name: str, batch: int, reduce_overhead: bool, only: list[str] | None, top: int
) -> list[dict]:
    import timm

    torch.manual_seed(0)
    base = timm.create_model(name, pretrained=False).eval().to("cuda", torch.float16)
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16)
    variants = [
        ("eager", None),
        ("eager-cl-by-hand", None),
        ("infinifuse-nchw", False),
        ("infinifuse-cl", True),
    ] + [("reduce-overhead", None)] * reduce_overhead
    variants = [v for v in variants if only is None or v[0] in only]
    rows = []
    with torch.no_grad():
        expected = base(x).float()
        for variant, channels_last in variants:
            model, inp = base, x
            if variant == "eager-cl-by-hand":
                # (a copy: .to(memory_format=...) converts a module in place)
                model = copy.deepcopy(base).to(memory_format=torch.channels_last)
                inp = x.contiguous(memory_format=torch.channels_last)
            torch._dynamo.reset()
            fusebackend.clear_cache()
            row = {"model": name, "batch": batch, "variant": variant}
            try:
                if variant.startswith("eager"):
                    fn, plain = model, model
                elif channels_last is not None:
                    fn = torch.compile(model, backend="infinifuse",
                                       options={"channels_last": channels_last})  # fmt: skip
                    plain = torch.compile(model, backend="infinifuse",
                                          options={"cudagraphs": False,
                                                   "channels_last": channels_last})  # fmt: skip
                else:  # its kernels are Inductor default mode's (a second compile)
                    fn = torch.compile(model, mode="reduce-overhead")
                    plain = torch.compile(model)
                start = time.perf_counter()
                fn(inp)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - start, 2)
                row["per_call_ms"] = round(per_call_ms(fn, inp), 4)
                err = (fn(inp).float() - expected).abs().max().item()
                row["err_rel"] = round(err / expected.abs().max().item(), 5)
                if plain is not None:
                    row["kernels"], row["top_kernels"] = kernels(plain, inp, top)
            except Exception as exc:  # record and go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "convnext_tiny",
                        "efficientnet_b0", "mobilenetv3_large_100"])  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reduce-overhead", action="store_true", help="add its row")
    parser.add_argument("--only", nargs="+", help="these variants only (names as in the rows)")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per row (default 8)")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        for batch in args.batches:
            rows += run(name, batch, args.reduce_overhead, args.only, args.top)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
