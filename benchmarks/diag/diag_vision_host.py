"""Where does a vision model's call spend host time under infinifuse, against reduce-overhead?

The vision suite (a865516, H200) timed ResNet-18 at batch 1 at 0.458 ms a call under
infinifuse against 0.331 under reduce-overhead, with fewer kernels (41 against 57) and less
kernel time than Inductor's. A call timed alone (``per_call_ms``: synchronize, call,
synchronize) pays its host time and its device time one after the other, so a gap with less
device work is host work. For each model (timm, ``pretrained=False``, fp16, batch 1 unless
``--batch``) and backend, once every graph is captured, this times per call:

- ``host_us``: from the call until it returns, after a synchronize (the launch path);
- ``alone_us``: the call and a synchronize (what ``vision.py`` reports as ``per_call_ms``);
- ``loop_us``: calls back to back between two synchronizations, per call;

and for infinifuse a cProfile of 200 calls (the functions with the most own time) and the
time spent in the derived-constant hook (``Refresh``: folded BatchNorms and channels-last
weight copies compared with their sources, before the call or, checked, after the launch).

``--variant NAME=JSON`` adds infinifuse with those options as a backend of its own (as in
``vision.py``; e.g. ``--variant 'no-matmul-groups={"matmul_groups":false}'``), timed in the same
process as the others. ``--kernels N`` adds, per backend, the device time of one call's kernels
(``torch.profiler``, the captured graph's kernels included) and the N kernels with the most.

``--interleave R`` keeps every backend's build of a model alive and adds ``interleaved_us``:
the median of R rounds of ``--loop`` calls, the backends taking turns (``vision.py`` times each
backend in a process of its own, where a shared host's load at that moment decides rows within
a few percent: at dabefa5 three rows read 1.02-1.04x reduce-overhead's that had read 0.92-0.94x
in the run before). The JSON (``--out``) is ``benchmarks/ledger.py``'s ``diag_vision_host``
format.

With ``--check-every-address`` captured graphs check the address of every input before each
replay, as before edd9415, instead of only those the graph reads: what that check costs.

    python benchmarks/diag/diag_vision_host.py [--models resnet18,resnet50] [--batch 1] \
        [--variant NAME=JSON] [--kernels 12] [--interleave 7 --loop 100] [--out F.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _variant(text: str) -> tuple[str, dict]:
    from vision import parse_variant

    return parse_variant(text)


def per_call(fn, x, calls: int) -> dict[str, float]:
    host, alone = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(x)
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        alone.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    torch.cuda.synchronize()
    loop = (time.perf_counter() - start) / calls
    return {
        "host_us": round(statistics.median(host) * 1e6, 1),
        "alone_us": round(statistics.median(alone) * 1e6, 1),
        "loop_us": round(loop * 1e6, 1),
    }


def interleaved(
    calls: dict[str, Callable[..., object]],
    rounds: int,
    loop: int,
    prepares: dict[str, Callable[[], None]] | None = None,
) -> dict:
    """Per backend, the median microseconds a call over ``rounds`` rounds of ``loop`` calls
    back to back, each output dropped before the next call (the suite's ``per_call_ms``), the
    backends taking turns within each round and their order reversed every other round: a
    shared machine's host load, which moves over seconds, falls on every backend alike.
    ``prepares``: per backend, what runs untimed before each of its rounds (a decode's cache
    reset, so that every round steps through the same positions)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for turn in range(rounds):
        for name in order if turn % 2 == 0 else order[::-1]:
            call = calls[name]
            if prepares is not None:
                prepares[name]()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(loop):
                out = None  # the previous output must not be alive during the next call
                out = call()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / loop * 1e6)
            del out
    return {name: {"interleaved_us": round(statistics.median(t), 1),
                   "interleaved_rounds_us": [round(v, 1) for v in t]}
            for name, t in times.items()}  # fmt: skip


def add_interleave_arguments(parser: argparse.ArgumentParser) -> None:
    """``--interleave ROUNDS`` and ``--loop N``, as ``interleaved`` takes them."""
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="keep every backend's build and time ROUNDS rounds in turns",
    )
    parser.add_argument("--loop", type=int, default=100, help="calls a round (--interleave)")


def write_rows(path: str, benchmark: str, commit: str | None, rows: list[dict]) -> None:
    """``rows`` as ``benchmarks/ledger.py`` reads a diag's JSON: the benchmark's name, this
    process's environment (``commit`` given where the checkout has no git) and the rows."""
    from ledger import environment

    env = {**environment(), **({"commit": commit} if commit else {})}
    with open(path, "w") as f:
        json.dump({"benchmark": benchmark, "environment": env, "rows": rows}, f, indent=1)


def profile(fn, x, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn(x)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def hook_time(fn, x, calls: int) -> float | None:
    """Microseconds per call inside infinifuse's derived-constant hook: ``Refresh.__call__``
    (before a call) and ``Refresh.stale`` (its check after a replay's launch, where the graph
    writes no input); None where neither ran."""
    from fusebackend.passes import batch_norm_folding

    refresh = batch_norm_folding.Refresh
    spent = [0.0, 0]
    originals = {name: getattr(refresh, name) for name in ("__call__", "stale")}

    def timed(original):
        def run(self, inputs):
            start = time.perf_counter()
            try:
                return original(self, inputs)
            finally:
                spent[0] += time.perf_counter() - start
                spent[1] += 1

        return run

    for name, original in originals.items():
        setattr(refresh, name, timed(original))
    try:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    finally:
        for name, original in originals.items():
            setattr(refresh, name, original)
    return round(spent[0] / calls * 1e6, 1) if spent[1] else None


def device_kernels(fn, x, top: int) -> dict:
    """The device time of one call's kernels (memcpy and memset apart), and the ``top`` kernel
    names with the most of it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name[:80], []).append(e.device_time)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernels": len(events),
        "kernel_us": round(sum(e.device_time for e in events), 1),
        "top": [{"name": n, "count": len(t), "us": round(sum(t), 1)} for n, t in ranked],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50,mobilenetv3_large_100,"
                        "efficientnet_b0,vit_small_patch16_224,convnext_tiny")  # fmt: skip
    parser.add_argument("--backends", default="infinifuse,reduce-overhead")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--out", default=None, help="JSON results")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=_variant,
        help="NAME=JSON: infinifuse with these options, as one more backend",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="the device time of a call's kernels and its N largest",
    )
    parser.add_argument(
        "--check-every-address",
        action="store_true",
        help="captured graphs check the address of every input, read or not (the rule before "
        "edd9415), labelled infinifuse-every-address-checked",
    )
    add_interleave_arguments(parser)
    parser.add_argument("--commit", default=None, help="the commit measured (no git there)")
    args = parser.parse_args()
    if args.check_every_address:
        from fusebackend.runtime import recording

        recording.unread_inputs = lambda fn: frozenset()
    from vision import build_model, make_fn

    variants = dict(args.variant)
    backends = args.backends.split(",") + [v for v in variants if v not in args.backends]

    results = []
    for name in args.models.split(","):
        model = build_model(name, 0).to("cuda", torch.float16)
        x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.float16)
        torch._dynamo.reset()
        builds, rows = {}, []
        for backend in backends:
            if not args.interleave:
                torch._dynamo.reset()
            if backend in variants:
                fn = make_fn(model, "infinifuse", variants[backend])
            else:
                fn = make_fn(model, backend, None)
            with torch.inference_mode(False), torch.no_grad():
                for _ in range(5):
                    fn(x)
                torch.cuda.synchronize()
                label = backend
                if backend == "infinifuse" and args.check_every_address:
                    label = "infinifuse-every-address-checked"
                row = {"model": name, "batch": args.batch, "backend": label,
                       **per_call(fn, x, args.calls)}  # fmt: skip
                if args.kernels:
                    row.update(device_kernels(fn, x, args.kernels))
                if backend == "infinifuse":
                    row["refresh_us"] = hook_time(fn, x, args.calls)
                    print(profile(fn, x, args.calls, args.top))
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.interleave:  # (keyed by position: a backend may be named twice)
                builds[f"{label}#{len(rows)}"] = lambda fn=fn, x=x: fn(x)
        if args.interleave:
            with torch.inference_mode(False), torch.no_grad():
                timed = interleaved(builds, args.interleave, args.loop)
            for row, figures in zip(rows, timed.values(), strict=True):
                row.update(figures)
                print(row["backend"], "in turns:", row["interleaved_us"], "us", flush=True)
        results += rows
        if args.out:
            write_rows(args.out, "diag_vision_host", args.commit, results)


if __name__ == "__main__":
    main()
