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
(its FX nodes) each generated kernel runs. The JSON (``--out``, a ledger source) keeps per
block and backend ``total_us`` and ``kernel_count``, and the time of the copies that move q,
k, v and the attention output: ``aten_copy_us`` (ATen's generic N-d copy,
``elementwise_kernel<128, 4>``), ``row_copy_us`` (infinifuse's copies run as row kernels,
passes/lone_copies.py) and ``inductor_copy_us`` (Inductor's kernels named for a clone and for
no add, norm, softmax or GELU).

    python benchmarks/diag/diag_swin_rows.py [--batch 8] [--commit C] [--out F.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import unittest.mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def groups_by_kernel() -> tuple[dict[str, str], set[str]]:
    """(kernel name -> its group's nodes, the kernels of copies run as row kernels)."""
    import fusebackend

    found, copies = {}, set()
    for graph in fusebackend.last_report().graphs:
        alone = set(graph.rewrites.get("copies_as_row_kernels", []))
        for group in graph.groups:
            found[group.kernel_name] = ",".join(group.nodes)
            if set(group.nodes) <= alone:
                copies.add(group.kernel_name)
    return found, copies


def copy_times(times: dict[str, list[float]], row_copies: set[str]) -> dict[str, float]:
    def total(keep) -> float:
        return round(sum(sum(t) for name, t in times.items() if keep(name)), 2)

    others = ("add", "layer_norm", "softmax", "gelu")
    return {
        "aten_copy_us": total(lambda n: n.startswith("void at::native::elementwise_kernel<128, 4")),
        "row_copy_us": total(lambda n: n.split("(")[0] in row_copies),
        "inductor_copy_us": total(lambda n: n.startswith("triton_") and "clone" in n
                                  and not any(o in n for o in others)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--commit", default=None, help="the commit measured (for the ledger)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from timm.models.swin_transformer import SwinTransformerBlock

    import fusebackend.copies

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
                            fusebackend.copies, "fold_copies_into_groups",
                            lambda graph, owner: []))  # fmt: skip
                for p in patches:
                    p.start()
                try:
                    times = kernel_times(fn, x)
                finally:
                    for p in patches:
                        p.stop()
                names, row_copies = groups_by_kernel() if backend != "inductor" else ({}, set())
                total = sum(sum(t) for t in times.values())
                print(f"== dim {dim} size {size} shift {shift} {backend}: {total:.1f} us, "
                      f"{sum(len(t) for t in times.values())} kernels")  # fmt: skip
                for name, t in sorted(times.items(), key=lambda kv: -sum(kv[1])):
                    group = names.get(name.split("(")[0], "")
                    print(f"   {sum(t):8.2f} us x{len(t):<3d} {name[:60]} {group[:80]}")
                rows.append({"dim": dim, "size": size, "shift": shift, "backend": backend,
                             "batch": args.batch, "total_us": round(total, 2),
                             "kernel_count": sum(len(t) for t in times.values()),
                             **copy_times(times, row_copies),
                             "kernel_times": times, "groups": names})  # fmt: skip
    if args.out:
        import ledger

        environment = {**ledger.environment(), "commit": args.commit}
        with open(args.out, "w") as f:
            json.dump({"benchmark": "diag_swin_rows", "environment": environment,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
