"""Host time of one CUDA-graph replay: infinifuse's decode graph against a plain capture.

A cProfile of generate() on an H100 (2026-11-23, `diag_generate_host_h100.txt`) put
``CUDAGraph.replay`` at 159 us per call for infinifuse's TinyLlama decode graph against
16 us for the graphs of Inductor's cudagraph trees, the largest difference in host time per
token. This times the replay alone: the same 22-layer decode step captured by infinifuse
(its cache entry's graph) and by ``torch.cuda.graph`` around the eager model, replayed 200
times back to back (host time per ``replay()`` call, no synchronize between) and 50 times
after a synchronize each (the launch into an idle GPU), plus each graph's device time per
replay. Kernels per step without graphs, for scale: eager 1107, infinifuse 322 (H100 suite).

    python benchmarks/diag/diag_replay_host.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def host_us(replay, calls: int, sync_each: bool) -> float:
    """Median host microseconds of one ``replay()`` call."""
    times = []
    torch.cuda.synchronize()
    for _ in range(calls):
        if sync_each:
            torch.cuda.synchronize()
        start = time.perf_counter()
        replay()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def device_us(replay, calls: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def report(name: str, replay) -> None:
    print(f"{name:34s} host per replay: back to back {host_us(replay, 200, False):7.1f} us, "
          f"after a sync {host_us(replay, 50, True):7.1f} us; device "
          f"{device_us(replay):7.1f} us")  # fmt: skip


def main() -> None:
    from generate import build_model
    from transformers import StaticCache

    import fusebackend
    from fusebackend.runtime.counters import live_caches

    model = build_model(22, torch.float16, "cuda")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 32000, (1, 16), generator=g).cuda()
    token = torch.randint(3, 32000, (1, 1), generator=g).cuda()
    cache = StaticCache(config=model.config, max_cache_len=128)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache)  # eager prefill: allocates the cache
        compiled = torch.compile(model, backend="infinifuse")
        for _ in range(3):
            compiled(input_ids=token, past_key_values=cache)
        graphs = [
            (c.name, e.graph)
            for c in live_caches()
            for e in getattr(c, "_entries", {}).values()
            if getattr(e, "graph", None) is not None
        ]
        print(fusebackend.stats()["fusion_modes"])
        for name, graph in graphs:
            report(f"infinifuse {name}", graph.replay)

        # The same step captured around the eager model (every eager kernel, no Dynamo), at
        # an explicit position: computing it from the cache could sync inside the capture.
        step = {"input_ids": token, "past_key_values": cache,
                "cache_position": torch.tensor([16], device="cuda"),
                "position_ids": torch.tensor([[16]], device="cuda")}  # fmt: skip
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    model(**step)
            torch.cuda.current_stream().wait_stream(stream)
            eager_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(eager_graph):
                model(**step)
        except Exception as exc:  # the comparison is lost, our graph's figures stand
            print(f"eager model could not be captured: {type(exc).__name__}: {exc}")
            return
        report("eager model, torch.cuda.graph", eager_graph.replay)


if __name__ == "__main__":
    main()
