"""Where does a decode step's GPU time go? One TinyLlama-shape (or Qwen2-shape) decode step,
compiled by infinifuse without CUDA graphs (so the profiler sees each launch), its kernels
grouped by name with their device time per step, for the default options and with matmul
groups off, in one run.

    python benchmarks/diag/diag_decode_profile.py [--model llama|qwen2] [--batch 1]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from suite import workloads  # noqa: E402

import fusebackend  # noqa: E402


def profile(model, cache, token, options: dict, steps: int = 5) -> list[tuple[str, float, int]]:
    torch._dynamo.reset()
    fusebackend.clear_cache()
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": False, **options})
    with torch.no_grad():
        for _ in range(3):
            compiled(input_ids=token, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                compiled(input_ids=token, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:60]
            totals[name][0] += event.device_time_total / steps
            totals[name][1] += 1
    rows = [(name, us, count // steps) for name, (us, count) in totals.items()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama", choices=["llama", "qwen2"])
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda")
    configs = {"llama": workloads._llama_config, "qwen2": workloads._qwen2_config}
    make = configs[args.model](False)
    model = workloads._causal_lm(make(), device, torch.float16)
    cache = workloads.static_cache(model, args.batch, 128)
    prompt = torch.randint(0, 1000, (args.batch, 16), device=device)
    token = torch.randint(0, 1000, (args.batch, 1), device=device)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{args.model} batch {args.batch}: weights {weights / 1e9:.3f} GB")
    for label, options in (("matmul groups", {}), ("no matmul groups", {"matmul_groups": False})):
        rows = profile(model, cache, token, options)
        total = sum(us for _, us, _ in rows)
        launches = sum(n for _, _, n in rows)
        print(f"\n== {label}: {total:.1f} us of kernels per step, {launches} launches")
        for name, us, count in rows[:14]:
            print(f"  {us:8.1f} us  {count:4d} x  {name}")


if __name__ == "__main__":
    main()
