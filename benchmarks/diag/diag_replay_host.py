"""Why does a replay of infinifuse's graph cost more host time than reduce-overhead's?

A cProfile of generate() on an H100 (2026-11-25, ``diag_generate_host_h100.txt``) put the
host time of ``CUDAGraph.replay`` at 63 us per call for infinifuse's TinyLlama decode graph
against 16 us for the graphs of Inductor's cudagraph trees, with fewer kernels in ours; and
GPT-2's replay spends 138 us outside its kernels against Inductor's 77 us. ``cudaGraphLaunch``
should cost the host a few microseconds, whatever the graph holds.

For each model (TinyLlama-shaped 22-layer decode, GPT-2 decode; fp16, batch 1, StaticCache)
and each backend (infinifuse; Inductor with ``mode="reduce-overhead"``; a plain
``torch.cuda.graph`` around the eager model), this keeps every CUDA graph captured and
times ``replay()`` of the one with the most device time: host time back to back (a replay
that waits for the one before it shows the device time here) and after a synchronize, and
device time per replay. Backends
``infinifuse:OPTION=False,...`` and ``infinifuse-without:REWRITE,...`` switch options or
graph rewrites off, to find which one a cost comes from.

    python benchmarks/diag/diag_replay_host.py [--models llama,gpt2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every graph captured while a backend runs.
_GRAPHS: list = []
_CAPTURE_BEGIN = torch.cuda.CUDAGraph.capture_begin


def _capture_begin_kept(self, *args, **kwargs):
    _GRAPHS.append(self)
    return _CAPTURE_BEGIN(self, *args, **kwargs)


torch.cuda.CUDAGraph.capture_begin = _capture_begin_kept


def host_us(replay, calls: int, sync_each: bool) -> float:
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


def device_us(replay, calls: int = 40) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def report(model_name: str, backend: str, graphs: list) -> None:
    """Host and device time per replay of the graph with the most device time."""
    timed = sorted((device_us(g.replay), i) for i, g in enumerate(graphs))
    device, index = timed[-1]
    replay = graphs[index].replay
    back_to_back, after_sync = host_us(replay, 100, False), host_us(replay, 40, True)
    print(f"--- {model_name} / {backend}: {len(graphs)} graph(s); the largest: host per "
          f"replay back to back {back_to_back:7.1f} us, after a sync {after_sync:6.1f} us; "
          f"device {device:7.1f} us per replay")  # fmt: skip


def build(model_name: str):
    from suite.workloads import _causal_lm, _gpt2_config, _llama_config

    config = {"llama": _llama_config(False), "gpt2": _gpt2_config(False)}[model_name]()
    model = _causal_lm(config, torch.device("cuda"), torch.float16)
    return model, config.vocab_size


def run_backend(model, vocab: int, backend: str) -> list:
    """Decode calls through one backend; the graphs it captured."""
    from suite.workloads import static_cache

    torch._dynamo.reset()
    _GRAPHS.clear()
    # Room for the prefill, the calls and every timed replay (each advances the position).
    cache = static_cache(model, 1, 400)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (1, 16), generator=g).cuda()
    token = torch.randint(0, vocab, (1, 1), generator=g).cuda()
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        if backend == "eager graph":
            step = {"input_ids": token, "past_key_values": cache, "use_cache": True,
                    "cache_position": torch.tensor([16], device="cuda"),
                    "position_ids": torch.tensor([[16]], device="cuda")}  # fmt: skip
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    model(**step)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(**step)
        else:
            if backend.startswith("infinifuse-without:"):
                # "infinifuse-without:share_mask_conversion,batch_state_sums": graph rewrites
                # of backend.py replaced by ones that change nothing, for the rest of this
                # process (run one such backend per process)
                import fusebackend.backend as fb

                for name in backend.partition(":")[2].split(","):
                    if not callable(getattr(fb, name, None)):
                        raise ValueError(f"backend.py calls no rewrite named {name!r}")
                    setattr(fb, name, lambda *args: [])
                compiled = torch.compile(model, backend="infinifuse")
            elif backend.startswith("infinifuse"):
                # "infinifuse:rewrites=False,index_checks=False": options switched off
                off = backend.partition(":")[2]
                options = {name.split("=")[0]: False for name in off.split(",") if name}
                compiled = torch.compile(model, backend="infinifuse", options=options)
            else:
                compiled = torch.compile(model, mode="reduce-overhead")
            for _ in range(4):
                compiled(input_ids=token, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
    if backend.startswith("infinifuse"):
        import fusebackend

        print("  modes:", fusebackend.stats()["fusion_modes"])
    return list(_GRAPHS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,gpt2", help="comma-separated: llama, gpt2")
    parser.add_argument(
        "--backends",
        default="infinifuse;reduce-overhead;eager graph",
        help="semicolon-separated: infinifuse, infinifuse:OPTION=False,..., "
        "infinifuse-without:REWRITE,... (a function backend.py calls), reduce-overhead, "
        "eager graph",
    )
    args = parser.parse_args()
    for model_name in args.models.split(","):
        model, vocab = build(model_name)
        for backend in args.backends.split(";"):
            try:
                graphs = run_backend(model, vocab, backend)
                report(model_name, backend, graphs)
            except Exception as exc:  # one backend's failure leaves the others' figures
                print(f"--- {model_name} / {backend} failed: {type(exc).__name__}: {exc}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
