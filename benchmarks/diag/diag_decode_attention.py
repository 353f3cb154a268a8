"""Is the decode attention kernel faster than what the traced graph runs (repeat_kv + SDPA),
and at which launch parameters? Its launch parameters swept.

Each variant is captured in a CUDA graph of 22 calls (a 22-layer decode step) and timed by
replays: device microseconds per call, launch gaps included, as a replayed step sees them.
The baseline is the traced graph's attention: transformers' ``repeat_kv`` copies of K and V,
then SDPA with the additive mask the fused graph passes (passes/attention.py makes it once
per step), with SDPA's own choice of kernel. Kernel variants: keys per block
(``_BLOCK_S``), one program per (batch, K/V head) over the whole cache ("single") or the
cache split into blocks of one program each, combined by a second kernel ("split") or by
the last program of each K/V head (``FOLD_COMBINE``, "folded"); and the kernel's own choice
("default"; "folded" alone: with the combine folded).

    python benchmarks/diag/diag_decode_attention.py --out decode_attention.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from layer_graph import repeat_kv, time_in_graph  # noqa: E402  (benchmarks/diag/)

from fusebackend.kernels import decode_attention as kernel  # noqa: E402

SHAPES = {  # name: (query heads, K/V heads, head width)
    "tinyllama": (32, 4, 64),
    "llama3-8b": (32, 8, 128),
    "gpt2": (12, 12, 64),
}
SLOTS = (128, 176, 512, 1024, 4096)
BLOCKS_S = (32, 64, 128)


def _case(heads: int, kv_heads: int, width: int, slots: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.float16
    q = torch.randn(1, 1, heads, width, device="cuda", generator=g, dtype=dtype).transpose(1, 2)
    k = torch.randn(1, kv_heads, slots, width, device="cuda", generator=g, dtype=dtype)
    v = torch.randn(1, kv_heads, slots, width, device="cuda", generator=g, dtype=dtype)
    allowed = torch.arange(slots, device="cuda") < slots * 3 // 4  # a cache 3/4 full
    bool_mask = allowed.view(1, 1, 1, slots)
    additive = torch.full((1, 1, 1, slots), float("-inf"), device="cuda", dtype=dtype)
    additive = additive.masked_fill(bool_mask, 0.0)
    groups = heads // kv_heads

    def baseline():
        return F.scaled_dot_product_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), additive
        )

    reference = baseline()
    row = {"heads": heads, "kv_heads": kv_heads, "width": width, "slots": slots,
           "baseline_us": time_in_graph(baseline), "variants": []}  # fmt: skip
    stride = reference.stride()
    defaults = (kernel._MIN_BLOCK_S, kernel._MAX_BLOCK_S, kernel._MAX_PROGRAMS)
    variants = [("default", None), ("folded", None)]
    variants += [(p, b) for b in BLOCKS_S for p in ("single", "split", "folded")]
    for policy, block_s in variants:
        kernel._MIN_BLOCK_S, kernel._MAX_BLOCK_S, kernel._MAX_PROGRAMS = defaults
        kernel.FOLD_COMBINE = policy == "folded"
        if block_s is not None:
            kernel._MIN_BLOCK_S = kernel._MAX_BLOCK_S = block_s
            kernel._MAX_PROGRAMS = 1 if policy == "single" else 1 << 20
        plan = kernel._Plan(q, k, v, bool_mask, None, groups, reference)

        def attend():
            return kernel.decode_attention(q, k, v, bool_mask, None, groups, stride)

        error = (attend().float() - reference.float()).abs().max().item()
        row["variants"].append({
            "policy": policy, "block_s": plan.block_s, "splits": plan.splits,
            "blocks_per_program": plan.meta["BLOCKS"], "folded": plan.fold,
            "us": time_in_graph(attend), "max_abs_error": error,
        })  # fmt: skip
    kernel._MIN_BLOCK_S, kernel._MAX_BLOCK_S, kernel._MAX_PROGRAMS = defaults
    kernel.FOLD_COMBINE = False
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()
    import transformers
    import triton

    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": "float16",
        "batch": 1,
        "defaults": {
            "splits": kernel._SPLITS,
            "block_s": [kernel._MIN_BLOCK_S, kernel._MAX_BLOCK_S],
            "max_programs": kernel._MAX_PROGRAMS,
        },
        "rows": [],
    }
    for name, (heads, kv_heads, width) in SHAPES.items():
        for slots in SLOTS:
            row = {"shape": name, **_case(heads, kv_heads, width, slots)}
            result["rows"].append(row)
            best = min(row["variants"], key=lambda v: v["us"])
            default = row["variants"][0]
            worst_error = max(v["max_abs_error"] for v in row["variants"])
            print(
                f"{name:10s} {slots:5d} slots: repeat+SDPA {row['baseline_us']:6.2f} us; kernel "
                f"{default['us']:6.2f} us (block {default['block_s']}, {default['splits']} "
                f"splits); best variant {best['us']:6.2f} us ({best['policy']}, block "
                f"{best['block_s']}); worst error {worst_error:.2e}",
                flush=True,
            )
            for v in row["variants"]:
                print(
                    f"    {v['policy']:7s} block {v['block_s']:3d} splits {v['splits']:3d} x "
                    f"{v['blocks_per_program']:2d}: {v['us']:6.2f} us"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
