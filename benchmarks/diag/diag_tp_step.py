"""Where does a tensor-parallel decode step's GPU time go, per rank? (GPU diag, under torchrun)

On two H100s (2026-11-26, ``benchmarks/results/tensor_parallel_*_h100.json``) a TP=2 step
was slower than the same model on one GPU: TinyLlama shape 3.38 against 1.93 ms, Llama-3-8B
shape 7.74 against 6.81 ms, where each rank streams half the weights and 65 all-reduces
cost ~0.78 ms. This diag loads the model as ``benchmarks/tensor_parallel.py`` does (same
shapes, same saved weights), compiles the forward with infinifuse and reports, per rank:

- the step time replayed from CUDA graphs (median of rounds), as the benchmark measures it,
  first with each all-reduce cloning its input as traced (the pass ``reduce_in_place`` off),
  then with the default passes;
- that step replayed, and the same step run without graphs (``cudagraphs=False``), under
  torch.profiler: each kernel name's device time per step and launches per step, NCCL's
  kernels apart (their time includes waiting for the other rank), the sum of device time
  against the step's wall time;
- the host's time per replayed step (the GPU idle at its start) and its cProfile;
- this rank's GPU and copy bandwidth (a 1 GiB device copy) and where the parameters live:
  two ranks on one GPU, or a GPU slower than its twin, would explain a slow step alone;
- the fusion report's groups (matmul groups among them) on this rank.

    torchrun --nproc_per_node 2 benchmarks/diag/diag_tp_step.py --shape tinyllama --out d.json
    torchrun --nproc_per_node 1 benchmarks/diag/diag_tp_step.py --shape tinyllama --out d1.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import io
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tensor_parallel as tp  # noqa: E402  (benchmarks/tensor_parallel.py: shapes, loading)

import fusebackend  # noqa: E402
import fusebackend.prepare  # noqa: E402


def copy_gbs(device: torch.device) -> float:
    """Read + write bandwidth of a 1 GiB device-to-device copy, GB/s."""
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * src.numel() * 2 * 10 / (time.perf_counter() - start) / 1e9


def step_fn(model: Any, options: dict[str, Any], device: torch.device):
    """A decode step compiled by infinifuse with ``options``, from cold compiler caches, as
    the benchmark's (512 cache slots: each variant below makes about 200 calls)."""
    tp.reset_compilers()
    forward = torch.compile(model.forward, backend="infinifuse", options=options)
    return tp.prefilled_step(model, forward, device, length=512)


def timed_steps(step, device: torch.device, world: int, steps: int = 32, rounds: int = 5) -> float:
    rounds_ms = []
    with torch.no_grad():
        for _ in range(4):
            step()
        for _ in range(rounds):
            _, seconds = tp.synced(device, world, lambda: [step() for _ in range(steps)])
            rounds_ms.append(seconds / steps * 1e3)
    return statistics.median(rounds_ms)


def host_time(step, device: torch.device, steps: int = 20) -> tuple[float, str]:
    """The host's time per replayed step, the GPU idle at each start (so no launch waits
    for it), and a cProfile of those steps: a step whose host time exceeds its GPU time
    leaves the GPU waiting between replays."""
    profile = cProfile.Profile()
    times = []
    with torch.no_grad():
        for _ in range(steps):
            tp.sync(device)
            start = time.perf_counter()
            profile.enable()
            step()
            profile.disable()
            times.append(time.perf_counter() - start)
    tp.sync(device)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
    return statistics.median(times) * 1e3, text.getvalue()[-8000:]


def kernel_profile(step, device: torch.device, world: int, steps: int = 8) -> dict[str, Any]:
    with torch.no_grad():
        for _ in range(4):
            step()
        tp.sync(device)
        tp.barrier(world)
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            _, seconds = tp.synced(device, world, lambda: [step() for _ in range(steps)])
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:80]][0] += event.device_time_total / steps
            totals[event.name[:80]][1] += 1
    rows = sorted(((n, us, c // steps) for n, (us, c) in totals.items()), key=lambda r: -r[1])
    nccl = [r for r in rows if "nccl" in r[0].lower()]
    return {
        "wall_ms_per_step": seconds / steps * 1e3,
        "device_us_per_step": sum(r[1] for r in rows),
        "nccl_us_per_step": sum(r[1] for r in nccl),
        "launches_per_step": sum(r[2] for r in rows),
        "nccl_launches_per_step": sum(r[2] for r in nccl),
        "top": [
            {"kernel": name, "us_per_step": round(us, 2), "launches": count}
            for name, us, count in rows[:25]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(tp.SHAPES), default="tinyllama")
    parser.add_argument("--model-root", default="/tmp/fusebackend_tp_models")
    parser.add_argument(
        "--guard-filter",
        action="store_true",
        help="compile with guard_filter_fn=skip_guard_on_all_nn_modules_unsafe",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    device, rank, world = tp.setup()
    model = tp.load(tp.model_dir(args, rank, world), device, world)
    params = {str(getattr(p, "device", "?")) for p in model.parameters()}
    row: dict[str, Any] = {
        "rank": rank,
        "tp": world,
        "shape": args.shape,
        "gpu": torch.cuda.get_device_name(device),
        "current_device": torch.cuda.current_device(),
        "pci_bus_id": torch.cuda.get_device_properties(device).pci_bus_id,
        "parameter_devices": sorted(params),
        "copy_gbs": copy_gbs(device),
    }
    # the step with every all-reduce cloning its input first, as traced (reduce_in_place off)
    passes = fusebackend.prepare.PREPARE
    index = next(k for k, step in enumerate(passes) if step.name == "reduce_in_place")
    in_place = passes[index]
    passes[index] = dataclasses.replace(in_place, run=lambda c: [])

    # --guard-filter: Dynamo keeps no guards on the model's parameters (their DTensor spec
    # checks run on the host each call). A dict for each compile: torch.compile takes
    # guard_filter_fn out of the options dict it is given, so a reused dict compiled the
    # second variant with every guard (225 DTensor spec checks per 8B call, 2026-11-26).
    def base() -> dict[str, Any]:
        return tp.compile_options(args.guard_filter) or {}

    cloned = step_fn(model, base(), device)
    row["step_ms_graphs_cloned"] = timed_steps(cloned, device, world)
    passes[index] = in_place
    del cloned
    graphs = step_fn(model, base(), device)
    row["step_ms_graphs"] = timed_steps(graphs, device, world)
    graphs_compiled = fusebackend.reports().graphs
    row["paths"] = [g.path for g in graphs_compiled]
    row["launches"] = [g.launches for g in graphs_compiled]
    row["stats"] = {k: fusebackend.stats()[k] for k in ("fusion_modes", "recordings")}
    row["host_ms_per_step"], row["host_profile"] = host_time(graphs, device)
    # CUPTI traces the kernels of a replayed graph too: NCCL's time there includes the wait
    # for the other rank inside the step, which the direct run's host time hides
    row["profile_graphs"] = kernel_profile(graphs, device, world)
    del graphs
    direct = step_fn(model, {**base(), "cudagraphs": False}, device)
    row["step_ms_direct"] = timed_steps(direct, device, world)
    row["profile_direct"] = kernel_profile(direct, device, world)
    del direct
    gathered: list[Any] = [row]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
    if rank == 0:
        for key, r in ((key, r) for key in ("profile_graphs", "profile_direct") for r in gathered):
            p = r[key]
            print(f"[{key}] rank {r['rank']} TP={r['tp']} {r['gpu']} bus {r['pci_bus_id']} params "
                  f"{r['parameter_devices']} copy {r['copy_gbs']:.0f} GB/s | step graphs "
                  f"{r['step_ms_graphs']:.3f} ms (cloning all-reduces "
                  f"{r['step_ms_graphs_cloned']:.3f}), direct {r['step_ms_direct']:.3f} ms | "
                  f"profiled: wall {p['wall_ms_per_step']:.3f} ms, device "
                  f"{p['device_us_per_step'] / 1e3:.3f} ms ({p['launches_per_step']} "
                  f"launches), nccl {p['nccl_us_per_step'] / 1e3:.3f} ms "
                  f"({p['nccl_launches_per_step']})")  # fmt: skip
            if key == "profile_graphs":
                print(f"    host {r['host_ms_per_step']:.3f} ms per replayed step")
            for k in p["top"][:15]:
                print(f"    {k['us_per_step']:9.1f} us {k['launches']:4d}x  {k['kernel']}")
        print(gathered[0]["host_profile"])
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"environment": tp.environment(world, None), "ranks": gathered}, f,
                          indent=1)  # fmt: skip
    tp.reset_compilers()
    tp.sync(device)
    tp.barrier(world)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
