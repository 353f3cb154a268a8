"""generate() tokens/s of several backends in one process, their timed runs interleaved.

The generate benchmark (``benchmarks/generate.py``) runs each backend in its own cold
process, one after the other; on the shared H100 hosts the same eager transformers ops ran
1.3-1.5x slower in one process than in the next (``diag_generate_host_h100.txt``), so a
5-10% difference in tokens/s between processes says little. Here each backend gets its own
copy of the model (same seed) and StaticCache, every backend's first generate compiles it,
and then the timed generates go round the backends in turn, so that host-speed drift falls
on all of them alike.

Variants: ``autocompile`` (transformers' default CompileConfig: Inductor, reduce-overhead),
``infinifuse`` (``CompileConfig(backend="infinifuse")``), and ``infinifuse-without:NAME,...``
(the same with graph rewrites of ``fusebackend.backend`` replaced by ones that change
nothing; compiled after the plain ``infinifuse``).

    python benchmarks/diag/diag_generate_ab.py [--variants autocompile infinifuse ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from generate import build_model
    from transformers import StaticCache
    from transformers.generation import CompileConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["autocompile", "infinifuse"])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--cache-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32000, (1, 16), generator=g).cuda()
    runs = {}
    for variant in args.variants:
        model = build_model(args.layers, torch.float16, "cuda")
        cache = StaticCache(config=model.config, max_cache_len=args.cache_len)
        backend = {} if variant == "autocompile" else {"backend": "infinifuse"}
        config = CompileConfig(**backend)
        runs[variant] = (model, cache, config)

    def generate(variant: str) -> tuple[float, torch.Tensor]:
        model, cache, config = runs[variant]
        cache.reset()
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(
            ids,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            past_key_values=cache,
            compile_config=config,
        )
        torch.cuda.synchronize()
        return time.perf_counter() - start, out

    with torch.no_grad():
        tokens = {}
        for variant in args.variants:
            model, cache, _ = runs[variant]
            if variant.startswith("infinifuse-without:"):  # compiles at its first generate
                import fusebackend.backend as fb

                for name in variant.partition(":")[2].split(","):
                    setattr(fb, name, lambda *a: [])
            model.generate(
                ids, max_new_tokens=1, do_sample=False, past_key_values=cache, disable_compile=True
            )  # allocates the cache
            first, tokens[variant] = generate(variant)
            print(f"{variant:40s} first generate {first:6.2f} s")
        times: dict[str, list[float]] = {v: [] for v in args.variants}
        for _ in range(args.rounds):
            for variant in args.variants:
                times[variant].append(generate(variant)[0])
    base = statistics.median(times[args.variants[0]])
    for variant in args.variants:
        median = statistics.median(times[variant])
        same = int((tokens[variant] == tokens[args.variants[0]]).sum()) - 16
        print(f"{variant:40s} {args.new_tokens / median:7.1f} tokens/s "
              f"({median * 1e3 / args.new_tokens:5.3f} ms per token; {base / median:5.3f}x the "
              f"first variant's tokens/s; spread {min(times[variant]) * 1e3:.1f}-"
              f"{max(times[variant]) * 1e3:.1f} ms; tokens equal to it {same})")  # fmt: skip
    try:
        import fusebackend

        print(fusebackend.stats()["fusion_modes"])
    except ImportError:
        pass


if __name__ == "__main__":
    main()
