"""Where a sentence-transformers corpus pass spends its time under infinifuse (GPU diag).

On an H100 (2026-11-26, ``benchmarks/results/sentence_embeddings_h100_session4.json``) the
second corpus pass took 1.11 s against eager's 0.76 (MiniLM-L6 shape) and 2.09 against 0.79
(BERT-base shape), with 46 captures in it: a shape seen once in the first pass is captured
on its second call (``capture_on_call=2``), and 45 entries of the first pass's older Dynamo
graphs were superseded. This diag splits that time: per variant, in its own process (cold
caches), the first pass, the second pass (cProfile'd, or the first with ``--profile
first``: the top entries by cumulative time), a third pass (every shape captured: replays
only) and eager's pass, with the seconds spent inside ``capture.capture_graph`` (warm-up +
capture + instantiate) and the capture count.

Variants: ``default``; ``call1`` (``capture_on_call=1``: captures in the first pass);
``nowarm`` (capture_graph's warm-up run left out: the call that captures has just run the
graph at this shape on the caller's stream).

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
    "nowarm": {},
}


def child(shape: str, variant: str, sentences: int, profiled: str) -> dict[str, Any]:
    import torch
    from sentence_embeddings import _example

    import fusebackend
    from fusebackend.runtime import capture as capture_module

    ex = _example()
    device = torch.device("cuda")
    spent = {"seconds": 0.0, "captures": 0}
    original = capture_module.capture_graph

    def timed_capture(fn, inputs, *, device, warmup_iterations):
        if variant == "nowarm":
            warmup_iterations = 0
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return original(fn, inputs, device=device, warmup_iterations=warmup_iterations)
        finally:
            torch.cuda.synchronize()
            spent["seconds"] += time.perf_counter() - start
            spent["captures"] += 1

    capture_module.capture_graph = timed_capture
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
    ex.compile_inner(model, "infinifuse", VARIANTS[variant])
    for name in ("first", "second", "third"):
        before = dict(spent)
        counts = fusebackend.stats()
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
        after = fusebackend.stats()
        result[f"{name}_capture_s"] = spent["seconds"] - before["seconds"]
        result[f"{name}_captures"] = spent["captures"] - before["captures"]
        result[f"{name}_misses"] = after["cache_misses"] - counts["cache_misses"]
        result[f"{name}_evictions"] = after["evictions"] - counts["evictions"]
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
        choices=("first", "second"),
        default="second",
        help="the pass cProfile'd (the first one includes Dynamo's compiles)",
    )
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.shape, args.child, args.sentences, args.profile)))
        return 0
    rows = []
    for variant in args.variants.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--shape", args.shape, "--child", variant,
             "--sentences", str(args.sentences), "--profile", args.profile],
            capture_output=True, text=True, env=os.environ.copy(),
        )  # fmt: skip
        if proc.returncode != 0:
            print(variant, "failed:", proc.stderr[-3000:])
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(row.pop("profile"))
    keys = ["eager_s", "first_s", "second_s", "third_s", "eager_again_s", "first_captures",
            "first_capture_s", "second_captures", "second_capture_s", "second_misses",
            "second_evictions", "third_captures"]  # fmt: skip
    print("variant  " + " ".join(f"{k:>16}" for k in keys))
    for row in rows:
        cells = [row.get(k) for k in keys]
        print(f"{row['variant']:8} " + " ".join(
            f"{c:16.3f}" if isinstance(c, float) else f"{c!s:>16}" for c in cells))  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
