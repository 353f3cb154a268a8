"""Which of a Swin block's kernels take longer under infinifuse than Inductor's, and is it the
folded copies?

The vision suite (H200, 6e4ef06) put Swin-T's kernel time at batch 8 at 1125 us against
Inductor's 1004, with fewer kernels (170 against 193); two row kernels, run 5 and 7 times a
call, took 110 and 78 us. This builds one timm ``SwinTransformerBlock`` per stage of Swin-T
(dim 96 x 56 x 56 with 3 heads, 192 x 28 x 28 with 6, 384 x 14 x 14 with 12; window 7;
shifted and not), fp16, batch 8 unless ``--batch``, and profiles one call without CUDA
graphs (``torch.profiler``, the call after warm-up) under:

- ``infinifuse``: as shipped;
- ``infinifuse-unfolded``: with ``fold_copies_into_groups`` and ``gather_rows`` off (the
  window copies and rolls run as their own kernels);
- ``inductor``: ``torch.compile`` default mode.

Per block and backend it prints each kernel's device time, and for infinifuse which group
(its FX nodes) each generated kernel runs.

    python benchmarks/diag/diag_swin_rows.py [--batch 8] [--out diag_swin_rows.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import unittest.mock

import torch

STAGES = [(96, 56, 3), (192, 28, 6), (384, 14, 12)]


def kernel_times(fn, x) -> dict[str, list[float]]:
    """Device time (us) of each CUDA kernel of one call, by kernel name."""
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn(x)
            torch.cuda.synchronize()
    times: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:90]].append(round(event.device_time, 2))
    return dict(times)


def groups_by_kernel() -> dict[str, str]:
    import fusebackend

    found = {}
    for graph in fusebackend.last_report().graphs:
        for group in graph.groups:
            found[group.kernel_name] = ",".join(group.nodes)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from timm.models.swin_transformer import SwinTransformerBlock

    import fusebackend.backend

    rows = []
    for dim, size, heads in STAGES:
        for shift in (0, 3):
            torch.manual_seed(0)
            block = SwinTransformerBlock(
                dim=dim,
                input_resolution=(size, size),
                num_heads=heads,
                window_size=7,
                shift_size=shift,
            )
            block = block.eval().to("cuda", torch.float16)
            x = torch.randn(args.batch, size, size, dim, device="cuda", dtype=torch.float16)
            for backend in ("infinifuse", "infinifuse-unfolded", "inductor"):
                torch._dynamo.reset()
                patches = []
                if backend == "inductor":
                    fn = torch.compile(block)
                else:
                    fn = torch.compile(block, backend="infinifuse",
                                       options={"cudagraphs": False})  # fmt: skip
                    if backend.endswith("unfolded"):
                        patches.append(unittest.mock.patch.object(
                            fusebackend.backend, "fold_copies_into_groups",
                            lambda graph, owner: []))  # fmt: skip
                for p in patches:
                    p.start()
                try:
                    times = kernel_times(fn, x)
                finally:
                    for p in patches:
                        p.stop()
                names = groups_by_kernel() if backend.startswith("infinifuse") else {}
                total = sum(sum(t) for t in times.values())
                print(f"== dim {dim} size {size} shift {shift} {backend}: {total:.1f} us, "
                      f"{sum(len(t) for t in times.values())} kernels")  # fmt: skip
                for name, t in sorted(times.items(), key=lambda kv: -sum(kv[1])):
                    group = names.get(name.split("(")[0], "")
                    print(f"   {sum(t):8.2f} us x{len(t):<3d} {name[:60]} {group[:80]}")
                rows.append({"dim": dim, "size": size, "shift": shift, "backend": backend,
                             "batch": args.batch, "total_us": round(total, 2),
                             "kernels": times, "groups": names})  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
