"""Where a single sentence-transformers query's time goes once its length has been seen (GPU diag).

Question: issue 37 measured a repeated single query of MiniLM-L6 at 3.92 ms p50 under
infinifuse against 2.79 ms under reduce-overhead (H200, a4dc674). Which part of
``SentenceTransformer.encode(query)`` is slower: the tokenizer, the compiled forward's host
time (Dynamo's guards, infinifuse's key, routing, replay, output handling), the GPU, pooling,
or the copy back?

Per backend, in its own process: build the workload of ``examples/sentence_embeddings.py``
(random weights, local tokenizer), compile the inner model's forward, encode every query
``--warm`` times (each length is captured by then), then encode every query once more,
timing per query the whole ``encode``, the compiled forward's host time (call to return, no
synchronize) and its GPU time (events); then once more under cProfile (the top functions by
own time and by cumulative time are written beside the JSON).

    python benchmarks/diag/diag_query_host.py --shape minilm-l6 --out /tmp/q.json
    python benchmarks/diag/diag_query_host.py --shape mpnet-base --backends infinifuse \
        --out /tmp/q.json
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_MARKER = "QUERY_HOST_RESULT "
VARIANTS = {  # name -> (backend, infinifuse options, torch.compile's dynamic)
    "eager": ("eager", None, None),
    "reduce-overhead": ("reduce-overhead", None, None),
    "infinifuse": ("infinifuse", {}, None),
    "infinifuse-dynamic": ("infinifuse", {}, True),
    "reduce-overhead-dynamic": ("reduce-overhead", None, True),
}


def _example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "_sentence_example", ROOT / "examples" / "sentence_embeddings.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["_sentence_example"] = module
    spec.loader.exec_module(module)
    return module


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "mean": statistics.fmean(ordered),
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    ex = _example()
    import fusebackend

    device, dtype = torch.device("cuda"), torch.float16
    queries = ex.make_sentences(args.queries + 2, seed=1, high=args.max_words)[2:]
    with tempfile.TemporaryDirectory() as tmp:
        shape = ex.SHAPES[args.shape]
        ex.build_model_dir(tmp, shape, 0)
        model = ex.load_sentence_transformer(tmp, device, dtype, shape["hidden_size"])
    model.encode(["warm up", "the device"])
    backend, options, dynamic = VARIANTS[args.variant]
    ex.compile_inner(model, backend, options, dynamic)
    start = time.perf_counter()
    for _ in range(args.warm):
        for q in queries:
            model.encode(q)
    warm_s = time.perf_counter() - start

    hf = model[0].auto_model
    forward = hf.forward
    host: list[float] = []
    events: list[tuple[Any, Any]] = []

    def timed_forward(*a: Any, **k: Any) -> Any:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        t0 = time.perf_counter()
        out = forward(*a, **k)
        host.append(time.perf_counter() - t0)
        end.record()
        events.append((begin, end))
        return out

    hf.forward = timed_forward
    total: list[float] = []
    for q in queries:
        t0 = time.perf_counter()
        model.encode(q)
        total.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    gpu = [b.elapsed_time(e) / 1e3 for b, e in events]
    hf.forward = forward

    profile = cProfile.Profile()
    profile.enable()
    for q in queries:
        model.encode(q)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    ms = {
        "encode_ms": {k: v * 1e3 for k, v in _percentiles(total).items()},
        "forward_host_ms": {k: v * 1e3 for k, v in _percentiles(host).items()},
        "forward_gpu_ms": {k: v * 1e3 for k, v in _percentiles(gpu).items()},
    }
    result: dict[str, Any] = {
        "shape": args.shape,
        "variant": args.variant,
        "queries": len(queries),
        "warm_rounds": args.warm,
        "warm_s": warm_s,
        **ms,
        "profile": text.getvalue(),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    if backend == "infinifuse":
        s = fusebackend.stats()
        keys = ("cache_size", "recordings", "evictions", "capture_failures", "fusion_fallbacks")
        result["stats"] = {k: s.get(k) for k in keys}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="minilm-l6")
    parser.add_argument("--backends", default="eager,reduce-overhead,infinifuse")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--max-words", type=int, default=199)
    parser.add_argument("--warm", type=int, default=3, help="encodes of every query before timing")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(_MARKER + json.dumps(child(args)), flush=True)
        return 0
    results = []
    for variant in args.backends.split(","):
        if variant not in VARIANTS:
            parser.error(f"unknown backend {variant!r}: expected one of {', '.join(VARIANTS)}")
        command = [sys.executable, __file__, "--child", "--variant", variant, "--out", args.out,
                   "--shape", args.shape, "--queries", str(args.queries),
                   "--max-words", str(args.max_words), "--warm", str(args.warm)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_MARKER)]
        if not lines:
            print(f"{variant}: failed\n{done.stderr[-3000:]}")
            continue
        result = json.loads(lines[-1][len(_MARKER) :])
        results.append(result)
        Path(args.out).with_suffix(f".{variant}.profile.txt").write_text(result.pop("profile"))
        print(f"{args.shape} {variant:24s} encode p50 {result['encode_ms']['p50']:.3f} "
              f"p90 {result['encode_ms']['p90']:.3f} | forward host p50 "
              f"{result['forward_host_ms']['p50']:.3f} | gpu p50 "
              f"{result['forward_gpu_ms']['p50']:.3f} ms", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
