"""Where does a generate() step's host time go, infinifuse against transformers' auto-compile?

On an H100 (2026-11-23) the TinyLlama-shaped decode step replayed in 1.84 ms with infinifuse
against 1.92 ms with reduce-overhead, yet generate() made 248 tokens/s against 279 (4.03 vs
3.58 ms per token): the difference is host time per token. This runs each variant in its own
process (22 layers, fp16, StaticCache of 128, 16-token prompt, 64 new tokens), compiles and
warms it with two generates, then profiles a third with cProfile and prints the functions
with the most own time and the ones of the compile path (infinifuse's runtime, cudagraph
trees), so the two can be compared line by line; then the first generate's profile
(compile, validation, capture), for the first-generate target.

    python benchmarks/diag/diag_generate_host.py [--variant infinifuse|autocompile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def profile(variant: str) -> None:
    import torch
    from generate import build_model
    from transformers import StaticCache
    from transformers.generation import CompileConfig

    model = build_model(22, torch.float16, "cuda")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32000, (1, 16), generator=g).to("cuda")
    cache = StaticCache(config=model.config, max_cache_len=128)
    config = CompileConfig(backend="infinifuse") if variant == "infinifuse" else CompileConfig()
    kwargs = {"max_new_tokens": 64, "min_new_tokens": 64, "do_sample": False,
              "past_key_values": cache, "compile_config": config}  # fmt: skip

    def generate() -> None:
        cache.reset()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()

    with torch.no_grad():
        cache.reset()  # one eager token first: CUDA libraries load outside the timing
        eager_kwargs = {k: v for k, v in kwargs.items() if k != "compile_config"}
        model.generate(ids, **{**eager_kwargs, "max_new_tokens": 1, "min_new_tokens": 1,
                               "disable_compile": True})  # fmt: skip
        torch.cuda.synchronize()
        first = cProfile.Profile()
        start = time.perf_counter()
        first.enable()
        generate()  # compiles, validates, captures
        first.disable()
        first_s = time.perf_counter() - start
        generate()  # a warm one
        pauses = _GcPauses()
        start = time.perf_counter()
        generate()
        plain = time.perf_counter() - start
        pauses.stop()
        profiler = cProfile.Profile()
        profiler.enable()
        generate()
        profiler.disable()
    print(f"{variant}: {plain * 1e3 / 64:.3f} ms per token without the profiler; "
          f"first generate {first_s:.2f} s under the profiler")  # fmt: skip
    print(f"{variant}: during that generate {pauses.summary()}; "
          f"{len(gc.get_objects())} objects tracked by the collector")  # fmt: skip
    for key, title in (("tottime", "own time"), ("cumulative", "cumulative")):
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text).sort_stats(key)
        stats.print_stats(45)
        print(f"--- {variant}: top by {title} (one generate of 64 tokens) ---")
        print(text.getvalue())
    # Where the first generate's time goes (target: <= 0.3x auto-compile's): compile,
    # first-call validation, capture, kernel loading.
    text = io.StringIO()
    pstats.Stats(first, stream=text).sort_stats("cumulative").print_stats(80)
    print(f"--- {variant}: first generate by cumulative time ---")
    print(text.getvalue())


class _GcPauses:
    """Python's garbage-collector pauses while it is installed (gc.callbacks): a process
    holding many more objects (FX graphs, example values) pays more per full collection."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.counts[info["generation"]] += 1

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> str:
        return ", ".join(
            f"gen{g}: {n} collections, {s * 1e3:.2f} ms"
            for g, (n, s) in enumerate(zip(self.counts, self.seconds))
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("infinifuse", "autocompile"))
    args = parser.parse_args()
    if args.variant:
        profile(args.variant)
        return
    for variant in ("infinifuse", "autocompile"):  # own processes: no shared Dynamo state
        subprocess.run([sys.executable, __file__, "--variant", variant], check=False)


if __name__ == "__main__":
    main()
