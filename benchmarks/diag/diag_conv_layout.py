"""Does channels-last pay for convnets under infinifuse, and what does each layout launch?

Issue 38 asks for channels-last "per graph where measured faster". This times, per timm model
(fp16, ``pretrained=False``) and batch, one call of: eager and infinifuse with the model and
input as given (NCHW), the same with ``model.to(memory_format=torch.channels_last)`` and a
channels-last input (the layout a user can pick today), and reduce-overhead (NCHW). Each row
gives the median per-call time and the CUDA kernels of one call without CUDA graphs, with the
kernel names that appear most (cuDNN's layout transposes around an NCHW fp16 convolution
show up there as ``nchwToNhwc``/``nhwcToNchw`` kernels).

    python benchmarks/diag/diag_conv_layout.py [--models resnet50 convnext_tiny] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import collections
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


def kernels(fn, x) -> tuple[int, list[tuple[str, int]]]:
    fn(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = collections.Counter(n[:60] for n in names).most_common(6)
    return len(names), top


def run(name: str, batch: int) -> list[dict]:
    import timm

    torch.manual_seed(0)
    base = timm.create_model(name, pretrained=False).eval().to("cuda", torch.float16)
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16)
    rows = []
    with torch.no_grad():
        expected = base(x).float()
        for layout in ("nchw", "channels_last"):
            model, inp = base, x
            if layout == "channels_last":
                model = base.to(memory_format=torch.channels_last)
                inp = x.contiguous(memory_format=torch.channels_last)
            for backend in ("eager", "infinifuse", "reduce-overhead"):
                if backend == "reduce-overhead" and layout != "nchw":
                    continue
                torch._dynamo.reset()
                fusebackend.clear_cache()
                row = {"model": name, "batch": batch, "layout": layout, "backend": backend}
                try:
                    if backend == "eager":
                        fn, plain = model, model
                    elif backend == "infinifuse":
                        fn = torch.compile(model, backend="infinifuse")
                        plain = torch.compile(
                            model, backend="infinifuse", options={"cudagraphs": False}
                        )
                    else:
                        # Inductor's kernels are the vision benchmark's (a second compile)
                        fn, plain = torch.compile(model, mode="reduce-overhead"), None
                    start = time.perf_counter()
                    out = fn(inp)
                    torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - start, 2)
                    row["per_call_ms"] = round(per_call_ms(fn, inp), 4)
                    scale = expected.abs().max().item()
                    err = (fn(inp).float() - expected).abs().max().item()
                    row["err_rel"] = round(err / scale, 5)
                    del out
                    if plain is not None:
                        row["kernels"], row["top_kernels"] = kernels(plain, inp)
                except Exception as exc:  # record and go on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                print(json.dumps(row), flush=True)
                rows.append(row)
            base = base.to(memory_format=torch.contiguous_format)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "convnext_tiny",
                        "efficientnet_b0", "mobilenetv3_large_100"])  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        for batch in args.batches:
            rows += run(name, batch)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
