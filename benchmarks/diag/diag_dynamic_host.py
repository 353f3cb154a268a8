"""Why a replayed encoder call costs more host time with ``dynamic=True`` (GPU diag).

Question: on an H200 (2026-11-28, ``diag_query_host.py``) a repeated MiniLM-L6 query's
compiled forward took 1.19 ms of host time with ``dynamic=True`` against 0.43 ms with static
shapes, both replaying a captured graph. How much of that is Dynamo's (its guards, and the
0-d tensors it builds per call for module floats such as LayerNorm's eps, which
``dynamic=True`` leaves unspecialized), and how much infinifuse's runtime?

For a BertModel of the MiniLM-L6 shape (fp16, batch 1, a fixed length), each variant in its own
process: eager; Dynamo alone (``backend="eager"``); infinifuse; reduce-overhead; each static and
with ``dynamic=True``, and with ``dynamic=True`` plus ``torch._dynamo.config.specialize_float``.
Per variant: host time per call of a loop of calls (a synchronize after each, and the call's own
time measured before it), the Dynamo graph's inputs by kind, and a cProfile of the loop (top
functions by own time, written beside the JSON).

    python benchmarks/diag/diag_dynamic_host.py --out /tmp/dyn.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_MARKER = "DYNAMIC_HOST_RESULT "
VARIANTS = (
    "eager", "dynamo", "dynamo-dynamic", "infinifuse", "infinifuse-dynamic",
    "infinifuse-dynamic-specialize-float", "reduce-overhead", "reduce-overhead-dynamic",
)  # fmt: skip


def child(variant: str, length: int, calls: int, shape: str) -> dict[str, Any]:
    import torch
    import transformers

    import fusebackend

    sizes = {"minilm-l6": (6, 384, 12, 1536), "bert-base": (12, 768, 12, 3072)}[shape]
    layers, hidden, heads, inner = sizes
    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=inner, vocab_size=30522,
    )  # fmt: skip
    model = transformers.BertModel(config).eval().to("cuda", torch.float16)
    backend = variant.split("-dynamic")[0]
    dynamic = True if "-dynamic" in variant else None
    if variant.endswith("specialize-float"):
        torch._dynamo.config.specialize_float = True
    inputs_seen: list[dict[str, int]] = []

    def counting(gm: Any, example_inputs: list[Any]) -> Any:
        kinds: dict[str, int] = {}
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                kind = "0-d cpu tensor" if x.dim() == 0 and x.device.type == "cpu" else "tensor"
            else:
                kind = type(x).__name__
            kinds[kind] = kinds.get(kind, 0) + 1
        inputs_seen.append(kinds)
        return gm.forward

    if backend == "eager":
        forward = model.forward
    elif backend == "dynamo":
        forward = torch.compile(model.forward, backend=counting, dynamic=dynamic)
    elif backend == "infinifuse":
        forward = torch.compile(model.forward, backend="infinifuse", dynamic=dynamic)
    else:
        forward = torch.compile(model.forward, mode="reduce-overhead", dynamic=dynamic)
    ids = torch.randint(1000, 2000, (1, length), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for other in (length + 3, length + 7, length):  # symbolic lengths from the 2nd trace
            probe = torch.randint(1000, 2000, (1, other), device="cuda")
            for _ in range(4):
                forward(input_ids=probe, attention_mask=torch.ones_like(probe))
        torch.cuda.synchronize()
        host: list[float] = []
        for _ in range(calls):
            t0 = time.perf_counter()
            forward(input_ids=ids, attention_mask=mask)
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            forward(input_ids=ids, attention_mask=mask)
            torch.cuda.synchronize()
        profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
    result: dict[str, Any] = {
        "variant": variant,
        "shape": shape,
        "length": length,
        "host_ms_p50": statistics.median(host) * 1e3,
        "host_ms_min": min(host) * 1e3,
        "dynamo_graph_inputs": inputs_seen,
        "profile": text.getvalue(),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    if backend == "infinifuse":
        stats = fusebackend.stats()
        result["stats"] = {k: stats.get(k) for k in ("cache_size", "recordings", "cache_hits")}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shape", default="minilm-l6", choices=("minilm-l6", "bert-base"))
    parser.add_argument("--length", type=int, default=14)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(args.child, args.length, args.calls, args.shape)
        print(_MARKER + json.dumps(result), flush=True)
        return 0
    results = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}: expected one of {', '.join(VARIANTS)}")
        command = [sys.executable, __file__, "--child", variant, "--out", args.out,
                   "--shape", args.shape, "--length", str(args.length),
                   "--calls", str(args.calls)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_MARKER)]
        if not lines:
            print(f"{variant}: failed\n{done.stderr[-2000:]}", flush=True)
            continue
        result = json.loads(lines[-1][len(_MARKER) :])
        Path(args.out).with_suffix(f".{variant}.profile.txt").write_text(result.pop("profile"))
        results.append(result)
        print(
            f"{variant:38s} host p50 {result['host_ms_p50']:.3f} ms (min "
            f"{result['host_ms_min']:.3f}) inputs {result['dynamo_graph_inputs']}",
            flush=True,
        )
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
