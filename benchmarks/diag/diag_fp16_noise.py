"""Is a fused graph's distance from eager within the model's own half-precision noise?

Validation accepts a fused graph whose outputs are within 1% (fp16, by norm) of the unfused
graph's. timm RegNetY-016 (fp16, calibrated BatchNorms, H200, 2026-11-28) was refused at 1.7%
and ran unfused. This measures, per timm model (``benchmarks/vision.py``'s build and
calibrated init) and batch, the relative norm distance ``||a - b|| / ||b||`` of the logits:

- ``eager16_vs_eager32``: eager fp16 against eager fp32 (cuDNN TF32 off): the rounding noise
  of the model in half precision;
- ``eager16_ulp_vs_eager16``: eager fp16 on the image with each element moved by about an
  ulp (random sign) against eager fp16: how much one rounding of the input moves the logits;
- ``fused_vs_eager16``, ``fused_vs_eager32``: infinifuse with ``validate=False`` (the fused
  graph, replayed) against each;
- ``inductor_vs_eager16``, ``inductor_vs_eager32``: Inductor's default mode against each.

    python benchmarks/diag/diag_fp16_noise.py --models regnety_016 resnet50 --batches 1 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vision import build_model, calibrate_norms  # noqa: E402

import fusebackend  # noqa: E402


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return round(((a - b).norm() / b.norm()).item(), 5)


def run(name: str, batches: list[int]) -> list[dict]:
    model = build_model(name, 0).to("cuda")
    calibrate_norms(model, 224, "cuda", 0)
    images = {b: torch.randn(b, 3, 224, 224, generator=torch.Generator().manual_seed(b))
              for b in batches}  # fmt: skip
    rows = []
    with torch.no_grad():
        torch.backends.cudnn.allow_tf32 = False
        refs32 = {b: model(x.cuda()).float() for b, x in images.items()}
        torch.backends.cudnn.allow_tf32 = True
        model.half().train().eval()
        fused = torch.compile(model, backend="infinifuse", options={"validate": False})
        for b, x in images.items():
            x = x.cuda().half()
            eager = model(x).float()
            ulp = torch.finfo(torch.float16).eps * torch.randint_like(x, 0, 2).mul(2).sub(1)
            moved = model(x * (1 + ulp)).float()
            row = {"model": name, "batch": b, "eager16_vs_eager32": distance(eager, refs32[b]),
                   "eager16_ulp_vs_eager16": distance(moved, eager)}  # fmt: skip
            for _ in range(3):  # capture, replay
                out = fused(x).float()
            row["fused_vs_eager16"] = distance(out, eager)
            row["fused_vs_eager32"] = distance(out, refs32[b])
            row["modes"] = sorted({e["mode"] for g in fusebackend.reports().graphs[-2:]
                                   for e in g.runtime_modes()})  # fmt: skip
            rows.append(row)
        torch._dynamo.reset()
        inductor = torch.compile(model)
        for row in rows:
            x = images[row["batch"]].cuda().half()
            out = inductor(x).float()
            row["inductor_vs_eager16"] = distance(out, model(x).float())
            row["inductor_vs_eager32"] = distance(out, refs32[row["batch"]])
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["regnety_016", "resnet50"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    rows = [row for name in args.models for row in run(name, args.batches)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
