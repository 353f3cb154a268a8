"""Host time of one uncaptured (direct) call of a BERT encoder, infinifuse against eager.

On an H100 (2026-11-26, ``diag_sentence_passes.py``) a sentence-transformers corpus pass
spent 5.4 ms per capture of a MiniLM-L6 graph at batch 32 (99 nodes), of which ending the
capture and instantiating it took 0.7 ms: the rest is the capture's own run of the graph,
the host launching each kernel, which is also what a signature's first (uncaptured) call
costs. This times that call, direct, at one padded length after Dynamo has gone dynamic
(several lengths first, as a corpus makes it), for infinifuse with CUDA graphs off and for
eager, host only (the device is kept busy ahead by a sleep kernel so the host never waits),
and prints a cProfile of the infinifuse calls sorted by own time.

    python benchmarks/diag/diag_direct_host.py [--shape minilm-l6] [--length 37]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))


def host_ms(fn, calls: int) -> float:
    """Median host milliseconds per call, the device kept busy ahead of the host."""
    times = []
    for _ in range(calls):
        torch.cuda._sleep(20_000_000)  # ~10 ms at H100 clocks: the host never waits
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def main() -> int:
    import sentence_embeddings as ex
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="minilm-l6", choices=sorted(ex.SHAPES))
    parser.add_argument("--length", type=int, default=37)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        ex.build_model_dir(tmp, ex.SHAPES[args.shape], 0)
        model = transformers.AutoModel.from_pretrained(tmp, dtype=torch.float16).to(device).eval()

    def inputs(length: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1000, 2000, (args.batch, length), device=device)
        mask = torch.ones_like(ids)
        mask[1:, length // 2 :] = 0  # padded rows, as a sorted corpus batch has
        return {"input_ids": ids, "attention_mask": mask}

    fixed = inputs(args.length)
    with torch.no_grad():
        eager = host_ms(lambda: model(**fixed), args.calls)
        compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})
        for length in (9, 14, 23, 31, 46, 58, args.length):  # Dynamo recompiles, then dynamic
            compiled(**inputs(length))
        fused = host_ms(lambda: compiled(**fixed), args.calls)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            compiled(**fixed)
        profile.disable()
        torch.cuda.synchronize()
    print(f"{args.shape} batch {args.batch} length {args.length}: host ms per direct call: "
          f"eager {eager:.3f}, infinifuse (cudagraphs off) {fused:.3f}")  # fmt: skip
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("tottime")
    stats.print_stats(40)
    stats.sort_stats("cumulative").print_stats("fusebackend", 30)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
