"""Where does a sentence-transformers corpus pass spend its time under infinifuse? (GPU diag)

On an H100 (2026-11-26, ``benchmarks/results/sentence_embeddings_h100_c7ca9d9.json``) the
second corpus pass took 1.11 s against eager's 0.76 (MiniLM-L6 shape) and 2.09 against 0.79
(BERT-base shape), with 46 captures in it: a shape seen once in the first pass is captured
on its second call (``capture_on_call=2``), and 45 entries of the first pass's older Dynamo
graphs were superseded. This diag splits that time: per variant, in its own process (cold
caches), the first pass, the second pass (cProfile'd, or the first with ``--profile
first``: the top entries by cumulative time), a third pass (every shape captured: replays
only) and eager's pass, with the seconds spent inside ``capture.capture_graph`` (warm-up +
capture + instantiate) and the capture count.

Variants: ``default``; ``call1`` (``capture_on_call=1``: captures in the first pass);
``call2`` (``capture_on_call=2``: every signature captured when it recurs, the default
before 2026-12-01);
``nowarm`` (capture_graph's warm-up run left out: the call that captures has just run the
graph at this shape on the caller's stream); ``cudnn`` (the fused graph's attention keeps
SDPA's own kernel choice, cuDNN's on an H100: ``passes/attention.avoid_cudnn_plans`` off);
``dynamic`` (``torch.compile(..., dynamic=True)``: symbolic lengths and batch from the first
trace; its second pass measured 0.565 against 0.456 s on MiniLM, 2026-11-27). ``--profile
third`` profiles the pass of replays only (the per-call host cost).

On an H200 (2026-12-01, 1000 sentences, ``--profile none``) at f46059b, capture on the 2nd
call made 14 captures in the second pass, 6.2 ms each for MiniLM-L6 and 10.8 for BERT-base
(``--trace-captures``: most of it cuBLAS' ``addmm`` under capture and
``cudaGraphInstantiate``); at 7a84fe4 the default (``runtime/recurrence.py``) left 5, and
the second pass took 0.186 and 0.232 s against 0.257 and 0.343 with ``call2``.

    python benchmarks/diag/diag_sentence_passes.py --shape minilm-l6 --out /tmp/passes.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
VARIANTS = {
    "default": {},
    "call1": {"capture_on_call": 1},
    "call2": {"capture_on_call": 2},
    "nowarm": {},
    "cudnn": {},
    "dynamic": {},
}


# CUgraphNodeType values (CUDA driver API)
_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty",
               6: "wait_event", 7: "event_record", 8: "ext_sem_signal", 9: "ext_sem_wait",
               10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}  # fmt: skip


def _driver() -> Any:
    """The CUDA driver library (torch links the runtime statically; a cudaGraph_t is a
    CUgraph)."""
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def _time_capture_phases(torch: Any, count_nodes: bool) -> dict[str, Any]:
    """Make every CUDAGraph keep its graph, and time ``capture_end`` (the stream's end of
    capture) apart from ``instantiate`` (cudaGraphInstantiate); with ``count_nodes``, count
    the nodes per type (through the driver: 5 ms a MiniLM-L6 graph on an H200, 2026-12-01,
    counted in the pass's time, so off unless asked for)."""
    import ctypes

    phases: dict[str, Any] = {"end_s": 0.0, "instantiate_s": 0.0, "graphs": 0, "nodes": 0}
    driver = _driver()
    base = torch.cuda.CUDAGraph

    class PhasedGraph(base):
        # keep_graph=True (the C++ graph reads it in __init__), so that capture_end only
        # ends the capture and instantiate is timed on its own
        def __new__(cls, keep_graph: bool = False):
            return super().__new__(cls, True)

        def __init__(self, keep_graph: bool = False) -> None:
            super().__init__(True)

        def capture_end(self) -> None:
            start = time.perf_counter()
            super().capture_end()
            middle = time.perf_counter()
            self.instantiate()
            end = time.perf_counter()
            phases["end_s"] += middle - start
            phases["instantiate_s"] += end - middle
            phases["graphs"] += 1
            if not count_nodes:
                return
            graph = ctypes.c_void_p(self.raw_cuda_graph())
            count = ctypes.c_size_t(0)
            driver.cuGraphGetNodes(graph, None, ctypes.byref(count))
            nodes = (ctypes.c_void_p * count.value)()
            driver.cuGraphGetNodes(graph, nodes, ctypes.byref(count))
            types: dict[str, int] = {}
            for node in nodes:
                kind = ctypes.c_int(-1)
                driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
                name = _NODE_TYPES.get(kind.value, str(kind.value))
                types[name] = types.get(name, 0) + 1
            phases["nodes"] += count.value
            phases["types"] = types

    torch.cuda.CUDAGraph = PhasedGraph
    return phases


def child(
    shape: str, variant: str, sentences: int, profiled: str, count_nodes: bool = False,
    trace_pass: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    import torch
    from sentence_embeddings import _example

    import fusebackend
    from fusebackend.runtime import capture as capture_module

    ex = _example()
    device = torch.device("cuda")
    spent = {"seconds": 0.0, "captures": 0}
    original = capture_module.capture_graph

    # With --trace-captures: the host's own time per operation and CUDA API call inside
    # the captures, summed over the traced pass (torch.profiler around each capture).
    traced: dict[str, list[float]] = {}
    tracing = {"on": False}

    def timed_capture(fn, inputs, *, device, warmup_iterations):
        if variant == "nowarm":
            warmup_iterations = 0
        torch.cuda.synchronize()
        start = time.perf_counter()
        profiler = None
        if tracing["on"]:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        try:
            return original(fn, inputs, device=device, warmup_iterations=warmup_iterations)
        finally:
            torch.cuda.synchronize()
            spent["seconds"] += time.perf_counter() - start
            spent["captures"] += 1
            if profiler is not None:
                profiler.__exit__(None, None, None)
                for event in profiler.key_averages():
                    row = traced.setdefault(event.key, [0.0, 0])
                    row[0] += event.self_cpu_time_total / 1e3
                    row[1] += event.count

    capture_module.capture_graph = timed_capture
    if variant == "cudnn":
        import fusebackend.backend

        fusebackend.backend.avoid_cudnn_plans = lambda graph: []
    # Host seconds inside CUDAGraph.replay, split into each graph's first replay (where the
    # driver uploads the executable graph) and the later ones.
    replays = {"first_s": 0.0, "first": 0, "later_s": 0.0, "later": 0}
    replayed: set[int] = set()
    original_replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph):
        start = time.perf_counter()
        try:
            return original_replay(graph)
        finally:
            kind = "later" if id(graph) in replayed else "first"
            replayed.add(id(graph))
            replays[kind + "_s"] += time.perf_counter() - start
            replays[kind] += 1

    torch.cuda.CUDAGraph.replay = timed_replay
    phases = _time_capture_phases(torch, count_nodes)
    corpus = ex.make_sentences(sentences, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        ex.build_model_dir(tmp, ex.SHAPES[shape], 0)
        model = ex.load_sentence_transformer(tmp, device, torch.float16)
    model.encode(["warm up", "the device"])

    def one_pass() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.encode(corpus, batch_size=32)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    result: dict[str, Any] = {"shape": shape, "variant": variant}
    result["eager_s"] = one_pass()
    ex.compile_inner(model, "infinifuse", VARIANTS[variant],
                     dynamic=True if variant == "dynamic" else None)  # fmt: skip
    for name in ("first", "second", "third"):
        before = dict(spent)
        replays_before = dict(replays)
        phases_before = dict(phases)
        counts = fusebackend.stats()
        tracing["on"] = trace_pass == name
        profile = cProfile.Profile() if name == profiled else None
        if profile:
            profile.enable()
        result[f"{name}_s"] = one_pass()
        if profile:
            profile.disable()
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text).sort_stats("cumulative")
            stats.print_stats(35)
            # this package's own share and Triton's compiles, which Dynamo's frames crowd
            # out of the top entries of a first pass
            stats.print_stats("fusebackend", 40)
            stats.print_stats(r"triton/(compiler|runtime/jit)", 10)
            result["profile"] = f"{name} pass:\n" + text.getvalue()[-30000:]
            # Dynamo's own split of its compile time (tracing, the backend call, guards)
            result["profile"] += "\n" + torch._dynamo.utils.compile_times(repr="str")
        after = fusebackend.stats()
        result[f"{name}_capture_s"] = spent["seconds"] - before["seconds"]
        result[f"{name}_captures"] = spent["captures"] - before["captures"]
        for k in replays:
            result[f"{name}_replay_{k}"] = replays[k] - replays_before[k]
        for k in phases:
            if isinstance(phases[k], (int, float)):
                result[f"{name}_phase_{k}"] = phases[k] - phases_before.get(k, 0)
        result[f"{name}_misses"] = after["cache_misses"] - counts["cache_misses"]
        result[f"{name}_evictions"] = after["evictions"] - counts["evictions"]
    tracing["on"] = False
    top = sorted(traced.items(), key=lambda kv: -kv[1][0])[:25]
    result["capture_trace_ms"] = [(round(ms, 2), count, key) for key, (ms, count) in top]
    result["node_types_last_graph"] = phases.get("types")
    result["eager_again_s"] = None
    ex.uncompile_inner(model)
    result["eager_again_s"] = one_pass()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="minilm-l6")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--sentences", type=int, default=3000)
    parser.add_argument(
        "--profile",
        choices=("first", "second", "third", "none"),
        default="second",
        help="the pass cProfile'd (the first one includes Dynamo's compiles)",
    )
    parser.add_argument("--nodes", action="store_true", help="count each graph's nodes by type")
    parser.add_argument("--trace-captures", choices=("first", "second"), default=None,
                        help="torch.profiler around each capture of that pass: host time "
                             "by operation and CUDA call (capture_trace_ms)")  # fmt: skip
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        row = child(args.shape, args.child, args.sentences, args.profile, args.nodes,
                    args.trace_captures)  # fmt: skip
        print(json.dumps(row))
        return 0
    rows = []
    for variant in args.variants.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--shape", args.shape, "--child", variant,
             "--sentences", str(args.sentences), "--profile", args.profile,
             *(["--nodes"] if args.nodes else []),
             *(["--trace-captures", args.trace_captures] if args.trace_captures else [])],
            capture_output=True, text=True, env=os.environ.copy(),
        )  # fmt: skip
        if proc.returncode != 0:
            print(variant, "failed:", proc.stderr[-3000:])
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(row.pop("profile", ""))
        for ms, count, key in row.get("capture_trace_ms", []):
            print(f"  {ms:9.2f} ms {count:6} {key}")
    keys = ["eager_s", "first_s", "second_s", "third_s", "eager_again_s", "first_captures",
            "first_capture_s", "second_captures", "second_capture_s", "second_misses",
            "second_evictions", "third_captures", "second_replay_first",
            "second_replay_first_s", "second_replay_later", "second_replay_later_s",
            "second_phase_graphs", "second_phase_nodes", "second_phase_end_s",
            "second_phase_instantiate_s"]  # fmt: skip
    print("variant  " + " ".join(f"{k:>16}" for k in keys))
    for row in rows:
        cells = [row.get(k) for k in keys]
        print(f"{row['variant']:8} " + " ".join(
            f"{c:16.3f}" if isinstance(c, float) else f"{c!s:>16}" for c in cells))  # fmt: skip
    if args.out:
        import torch  # noqa: F401  (environment() reads the device through it: the children ran)
        from ledger import environment  # benchmarks/ledger.py reads this format

        record = {"benchmark": "diag_sentence_passes", "environment": environment(),
                  "shape": args.shape, "sentences": args.sentences, "runs": rows}  # fmt: skip
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
