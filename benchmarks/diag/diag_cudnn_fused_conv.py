"""Is cuDNN's fused convolution + bias + ReLU (+ residual add) faster than a convolution
followed by one elementwise kernel, at the convolutions of timm's ReLU convnets?

For every ``Conv2d`` of the models named (shapes taken with forward hooks on a 224 x 224
image), fp16 channels-last, batch 1 and 8, device time per call in CUDA-graph replays of:

- ``conv``: ``F.conv2d`` without its bias (what a fused graph runs before its row group);
- ``conv_then_bias_relu``: the same, then ``relu(y + bias)`` as one Triton kernel (Inductor's,
  standing in for the row group that takes the bias and the activation);
- ``cudnn_relu``: ``aten.cudnn_convolution_relu(x, w, bias, ...)``, one cuDNN call;
- ``conv_then_add_bias_relu`` and ``cudnn_add_relu``: the same with a residual ``z`` (a random
  tensor of the output's shape) added before the ReLU (``aten.cudnn_convolution_add_relu``), as
  a bottleneck's last convolution does.

Also each fused call's first-call time (cuDNN builds its plan per shape: a fused plan may
compile a kernel at run time) and its largest difference from the unfused result.

    python benchmarks/diag/diag_cudnn_fused_conv.py [--models resnet50,resnet18] [--out F]

The answer on an H200 (2026-11-30, ``diag_cudnn_fused_conv_h200_1dd1509.json``): yes, at every
one of ResNet-50's convolution shapes, batch 1 and 8; ``kernels/conv.py`` has the sums.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ledger  # noqa: E402  (benchmarks/ledger.py: the environment a result records)
from diag_spatial_mean import device_us  # noqa: E402  (benchmarks/diag/ is sys.path[0])


def conv_shapes(name: str) -> list[dict]:
    """Each distinct (input shape at batch 1, weight shape, stride, padding, dilation, groups)."""
    import timm

    model = timm.create_model(name, pretrained=False).eval()
    seen: dict[tuple, dict] = {}

    def hook(module, inputs, output):
        key = (tuple(inputs[0].shape[1:]), tuple(module.weight.shape), module.stride,
               module.padding, module.dilation, module.groups)  # fmt: skip
        if key not in seen and isinstance(module.padding, tuple):
            seen[key] = dict(zip(("in", "weight", "stride", "padding", "dilation", "groups"), key))
            seen[key]["count"] = 0
        if key in seen:
            seen[key]["count"] += 1

    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    return list(seen.values())


def measure(shape: dict, batch: int, bias_relu, add_bias_relu) -> dict:
    aten, cl = torch.ops.aten, torch.channels_last
    x = torch.randn(batch, *shape["in"], device="cuda", dtype=torch.float16)
    x = x.contiguous(memory_format=cl)
    w = torch.randn(shape["weight"], device="cuda", dtype=torch.float16) * 0.05
    w = w.contiguous(memory_format=cl)
    b = torch.randn(shape["weight"][0], device="cuda", dtype=torch.float16)
    conv_args = (shape["stride"], shape["padding"], shape["dilation"], shape["groups"])
    y = F.conv2d(x, w, None, *conv_args)
    z = torch.randn_like(y).contiguous(memory_format=cl)
    start = time.perf_counter()
    fused = aten.cudnn_convolution_relu(x, w, b, *conv_args)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    fused_add = aten.cudnn_convolution_add_relu(x, w, z, 1.0, b, *conv_args)
    torch.cuda.synchronize()
    first_add_ms = (time.perf_counter() - start) * 1e3
    ref = torch.relu(y.float() + b.float().view(1, -1, 1, 1))
    ref_add = torch.relu(y.float() + z.float() + b.float().view(1, -1, 1, 1))
    timed = {
        "conv_us": lambda: F.conv2d(x, w, None, *conv_args),
        "conv_then_bias_relu_us": lambda: bias_relu(F.conv2d(x, w, None, *conv_args), b),
        "cudnn_relu_us": lambda: aten.cudnn_convolution_relu(x, w, b, *conv_args),
        "conv_then_add_bias_relu_us": lambda: add_bias_relu(F.conv2d(x, w, None, *conv_args), z, b),
        "cudnn_add_relu_us": lambda: aten.cudnn_convolution_add_relu(x, w, z, 1.0, b, *conv_args),
    }
    return {
        **{key: round(device_us(fn, rep_ms=60), 2) for key, fn in timed.items()},
        "cudnn_relu_first_ms": round(first_ms, 2),
        "cudnn_add_relu_first_ms": round(first_add_ms, 2),
        "max_abs_err": (fused.float() - ref).abs().max().item(),
        "max_abs_err_add": (fused_add.float() - ref_add).abs().max().item(),
        "ref_max": ref.abs().max().item(),
        "out_channels_last": fused.is_contiguous(memory_format=cl),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--commit", help="the commit measured, where the checkout has no git")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = False
    torch._dynamo.config.recompile_limit = 1000  # one compile per shape, never eager
    bias_relu = torch.compile(lambda y, b: torch.relu(y + b.view(1, -1, 1, 1)))
    add_bias_relu = torch.compile(lambda y, z, b: torch.relu(y + z + b.view(1, -1, 1, 1)))
    rows, totals = [], {}
    for name in args.models.split(","):
        for shape in conv_shapes(name):
            for batch in map(int, args.batches.split(",")):
                row = {"model": name, "batch": batch, **shape}
                row.update(measure(shape, batch, bias_relu, add_bias_relu))
                for key in [k for k in row if k.endswith("_us")]:
                    total = totals.setdefault((name, batch), {})
                    total[key] = round(total.get(key, 0.0) + row[key] * shape["count"], 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary = [{"model": m, "batch": b, **t} for (m, b), t in totals.items()]
    for line in summary:
        print("summed over the model's convolutions:", json.dumps(line), flush=True)
    if args.out:
        environment = {**ledger.environment(), "commit": args.commit}
        with open(args.out, "w") as f:
            json.dump({"benchmark": "diag_cudnn_fused_conv", "environment": environment,
                       "rows": rows, "summed": summary}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
