"""Per-call time with the CPU included, old vs new launch config (cudagraphs off).

Chain of benchmarks/embedding_chain.py at B=16, T=2048, D=2048, fp16.
Plain loop of calls between two synchronizes, and triton's do_bench (which clears L2 before
each call), in one process so host speed is the same for both configs.
"""

import sys
import time

import torch
import triton.testing

sys.path.insert(0, "benchmarks")
from embedding_chain import Chain  # noqa: E402

import fusebackend.kernels.configs as configs  # noqa: E402
import fusebackend.kernels.launch as launch  # noqa: E402

new_config = launch.launch_config


def old_config(rows, width, layout="tile", gathers=True):  # tile programs (the chain)
    block_d = min(configs.triton_next_power_of_2(width), 2048)
    return min(configs.triton_next_power_of_2(rows), max(1, 4096 // block_d)), block_d, 4


torch.manual_seed(0)
model = Chain(32000, 2048, 2048).cuda().half().eval()
ids = torch.randint(0, 32000, (16, 2048), device="cuda")
pos = torch.arange(2048, device="cuda")[None]
with torch.no_grad():
    fused = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})
    for name, config in [("new", new_config), ("old", old_config)] * 2:
        launch.launch_config = config
        for _ in range(20):
            fused(ids, pos)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(500):
            fused(ids, pos)
        torch.cuda.synchronize()
        loop_ms = (time.perf_counter() - start) / 500 * 1e3
        bench = triton.testing.do_bench(lambda: fused(ids, pos), return_mode="median")
        print(f"{name}: loop {loop_ms:.4f} ms/call, do_bench {bench:.4f} ms")
