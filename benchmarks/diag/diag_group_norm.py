"""Does kernels/group_norm.py beat aten's GroupNorm and the activation after it?

Device time per call (``diag_spatial_mean.device_us``: CUDA-graph replays of 20 calls timed
by ``triton.testing.do_bench``) of ``F.relu(F.group_norm(x, 32, w, b))`` (aten: the norm's
kernels, then the activation's) and of ``group_norm(x, 32, w, b, eps, "relu")``, fp16, at
the GroupNorm inputs of ResNet-V2-50 (BiT, 224 x 224 images: one per stage) at batch 1 and
8 and of a diffusion UNet's first resolution, NCHW and channels-last, and the kernel's launch
plan for each (rows held whole, or split into how many parts); where a channels-last input
is read several groups a program, the one-group-a-program kernels' time too.

``--sweep``: instead, at every channels-last GroupNorm input of ResNet-V2-50 (BiT) at batch 1
and 8 (``BIT_SHAPES``), Inductor's kernels for the same norm + ReLU (``torch.compile``, default
mode) and the kernel under each of ``VARIANTS`` (which channels-last groups are read
several a program, how many bytes of each position a program reads): what the grouped
pair's rule and span rest on.

    python benchmarks/diag/diag_group_norm.py [--sweep] [--out /tmp/group_norm.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from diag_spatial_mean import device_us

from fusebackend.kernels import group_norm as group_norm_module
from fusebackend.kernels.group_norm import group_norm

# (batch, channels, side): BiT's norms by stage (the widest of each), a UNet's 64 x 64 latent
SHAPES = [(b, c, s) for b in (1, 8) for c, s in ((256, 56), (512, 28), (1024, 14), (2048, 7))]
SHAPES += [(2, 320, 64)]
# (channels, side) of BiT's channels-last norms, every stage's
BIT_SHAPES = [(64, 56), (128, 56), (256, 56), (128, 28), (256, 28), (512, 28), (256, 14),
              (512, 14), (1024, 14), (512, 7), (2048, 7)]  # fmt: skip
# name -> (_GROUPED_BELOW_BYTES, _GROUPED_FROM_IMAGE_BYTES, _GROUPED_SPAN_BYTES); None:
# the launcher's own rule
VARIANTS = {
    "the launcher's rule": None,
    "one group a program": (0, 0, 256),
    "grouped, 64-byte spans": (1 << 30, 0, 64),
    "grouped, 256-byte spans": (1 << 30, 0, 256),
}
_KNOBS = ("_GROUPED_BELOW_BYTES", "_GROUPED_FROM_IMAGE_BYTES", "_GROUPED_SPAN_BYTES")


def plan(x: torch.Tensor) -> str:
    out = torch.empty_like(x)
    launches = group_norm_module._launches(x, 32, None, None, 1e-5, "relu", out)
    grid = launches[-1][1]
    return (
        "whole rows"
        if launches[-1][3]["WHOLE_ROW"]
        else f"{grid[1]} part(s), {len(launches)} launch(es)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the rows here as JSON")
    parser.add_argument("--sweep", action="store_true", help="BiT's shapes, every variant")
    args = parser.parse_args()
    rows = sweep() if args.sweep else compare()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)  # fmt: skip


def sweep() -> list[dict]:
    rows = []
    for batch in (1, 8):
        for channels, side in BIT_SHAPES:
            rows.append(_sweep_row(batch, channels, side))
    return rows


def _inputs(batch: int, channels: int, side: int, channels_last: bool) -> tuple:
    """A random fp16 input (NCHW or channels-last), weight and bias."""
    x = torch.randn(batch, channels, side, side, device="cuda", dtype=torch.float16)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.rand(channels, device="cuda", dtype=torch.float16) + 0.5
    b = torch.randn(channels, device="cuda", dtype=torch.float16)
    return x, w, b


@contextlib.contextmanager
def _rule(values: tuple[int, int, int] | None):
    """The launcher's grouped rule set to ``values`` (``_KNOBS``' order; None: its own) for
    the duration, then restored."""
    saved = [getattr(group_norm_module, knob) for knob in _KNOBS]
    try:
        for knob, value in zip(_KNOBS, values or saved):
            setattr(group_norm_module, knob, value)
        yield
    finally:
        for knob, value in zip(_KNOBS, saved):
            setattr(group_norm_module, knob, value)


def _sweep_row(batch: int, channels: int, side: int) -> dict:
    x, w, b = _inputs(batch, channels, side, channels_last=True)
    torch._dynamo.reset()
    inductor = torch.compile(lambda x, w, b: F.relu(F.group_norm(x, 32, w, b, 1e-5)))
    row = {"shape": [batch, channels, side, side], "layout": "channels_last",
           "inductor_us": round(device_us(lambda: inductor(x, w, b)), 2)}  # fmt: skip
    for name, values in VARIANTS.items():
        with _rule(values):
            row[name] = round(device_us(lambda: group_norm(x, 32, w, b, 1e-5, "relu")), 2)
    print(json.dumps(row), flush=True)
    return row


def compare() -> list[dict]:
    rows = []
    for batch, channels, side in SHAPES:
        for layout in ("nchw", "channels_last"):
            x, w, b = _inputs(batch, channels, side, layout == "channels_last")
            aten = device_us(lambda: F.relu(F.group_norm(x, 32, w, b, 1e-5)))  # noqa: B023
            kernel = device_us(lambda: group_norm(x, 32, w, b, 1e-5, "relu"))  # noqa: B023
            row = {"shape": [batch, channels, side, side], "layout": layout,
                   "aten_us": round(aten, 2), "kernel_us": round(kernel, 2),
                   "ratio": round(kernel / aten, 3), "plan": plan(x)}  # fmt: skip
            if "GPP" in group_norm_module._launches(x, 32, w, b, 1e-5, "relu", x)[-1][3]:
                # the same launch with a group a program, as before the several-groups
                # kernels: what their rule rests on
                with _rule(VARIANTS["one group a program"]):
                    one = device_us(lambda: group_norm(x, 32, w, b, 1e-5, "relu"))  # noqa: B023
                row["one_group_a_program_us"] = round(one, 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
