"""Where does a compiled decode step's first call go, phase by phase, against Dynamo alone?

The target asks the TinyLlama decode step's first call to take <= 1.5x Dynamo alone's
(``backend="eager"``) with a warm Triton cache. In one process, after a throwaway trace
(``measure.prewarm``), this times, in turn and ``--rounds`` times:

- Dynamo alone: ``torch.compile(model, backend="eager")``'s first call;
- infinifuse's first call, split into Dynamo's share (the call minus the rest), the backend
  (``infinifuse()``, under cProfile when ``--profile``), and the runtime's first run of the
  signature: the fused run, the unfused reference run, validation, and the capture (its
  warm-up and the recording). Each phase ends with a device synchronize, so it carries its
  own GPU work.

With ``--profile`` it prints, for the backend alone, the functions by own time and the
callers of the costliest ones, which a profile of the whole call (Dynamo included) buries.
With ``--timm NAME`` the model is timm's (``pretrained=False``, fp16, one 224 x 224 image,
``--batch`` images), whose first call the vision suite measures; the backend's kernel
precompile is its own phase. ``--cold`` makes the first round a cold process's first call
(eager's forward alone before it, no throwaway trace, Dynamo alone after it), as the vision
suite's batch-1 call is; ``--children`` splits each compile process's time into Triton's
compiles and the launchers' gcc builds; ``--optimised-launchers`` has the processes build
the launchers at Triton's -O3 instead of -O0 (an A/B in one session).
EfficientNet-B0 (H200, d628af3): 9.69 s against Dynamo
alone's 1.61; the backend 2.98 s (its precompile 1.92), the runtime's first runs of the
fused and unfused graphs 5.19 s, validation 0.17 s: the runs are where a first call of a
convnet goes (not yet split: cuDNN's plans per convolution shape, first launches).

    python benchmarks/diag/diag_first_call_phases.py [--model llama-decode] [--rounds 2]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import io
import os
import pstats
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES: dict[str, float] = collections.defaultdict(float)
RUNS_PROFILE: cProfile.Profile | None = None  # --profile-runs: the runtime's first runs


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, adding its wall time (device work included) to ``PHASES[name]``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync()
            PHASES[name] += time.perf_counter() - start

    return wrapper


@contextlib.contextmanager
def _patched(owner: Any, name: str, phase: str) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, _timed(phase, original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _runtime_phases() -> contextlib.ExitStack:
    """Time the runtime's steps for a new signature (fusebackend.runtime.graph_cache)."""
    from fusebackend.runtime import capture, graph_cache, validation

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(graph_cache.GraphCache, "_fused_run", "runtime: runs"))
    original_run = graph_cache.fused_run  # (imported by name there)

    def split_run(fused: Any, unfused: Any, *args: Any, **kwargs: Any) -> Any:
        # The fused graph's first run and the unfused reference run, each on its own.
        fused = _timed("runtime: runs: fused", fused)
        unfused = _timed("runtime: runs: unfused", unfused)
        if RUNS_PROFILE is not None:
            RUNS_PROFILE.enable()
        try:
            return original_run(fused, unfused, *args, **kwargs)
        finally:
            if RUNS_PROFILE is not None:
                RUNS_PROFILE.disable()

    graph_cache.fused_run = split_run
    stack.callback(setattr, graph_cache, "fused_run", original_run)
    stack.enter_context(_patched(validation, "mismatch", "runtime: validation"))
    stack.enter_context(_patched(capture, "capture_graph", "runtime: capture"))
    stack.enter_context(_patched(graph_cache.GraphCache, "__call__", "runtime: whole call"))
    import fusebackend.fusion

    stack.enter_context(_patched(fusebackend.fusion, "precompile_all", "backend: precompile"))
    from fusebackend.kernels import triton_api

    stack.enter_context(
        _patched(triton_api, "compile_in_children", "backend: precompile: processes")
    )
    return stack


COMPILES: list[tuple[str, int, float, float]] = []  # (kernel, thread, start, end)


def _record_compiles() -> None:
    """Record each of the precompile's compiles on its threads (with its load; after the
    compile processes, a cache hit): its kernel, thread and times, to tell compiles that
    overlap from compiles that wait on one another."""
    import threading

    from fusebackend.kernels import triton_api

    original = triton_api._compile_and_load

    def recorded(compile_fn: Any, *args: Any, **kwargs: Any) -> Any:
        start, kernel = time.perf_counter(), None
        try:
            kernel = original(compile_fn, *args, **kwargs)
            return kernel
        finally:
            name = str(getattr(kernel, "name", "(failed)"))
            COMPILES.append((name, threading.get_ident(), start, time.perf_counter()))

    triton_api._compile_and_load = recorded


def _print_compiles() -> None:
    """The compiles since the last print: count, their summed time against the span they
    took (the mean number running at once), and the costliest kernels."""
    if not COMPILES:
        print("    (no precompile compiles recorded)")
        return
    span = max(e for *_, e in COMPILES) - min(s for *_, s, _ in COMPILES)
    total = sum(e - s for *_, s, e in COMPILES)
    threads = len({t for _, t, _, _ in COMPILES})
    print(
        f"    compiles: {len(COMPILES)} on {threads} threads, {total:.2f} s summed over a "
        f"{span:.2f} s span ({total / max(span, 1e-9):.1f} at once on average)"
    )
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, _, s, e in COMPILES:
        by_name[name].append(e - s)
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(
            f"      {name:40s} x{len(times):<3d} {sum(times):6.2f} s "
            f"(each {min(times):.2f}-{max(times):.2f})"
        )
    COMPILES.clear()


def _record_children(folder: str) -> None:
    """Record, in each compile process, every compile's two parts (Triton's compile into its
    cache, and the C launcher's build) as a line in ``folder`` (one file a child), and in
    this process each fork's time: what a child's share of the precompile is spent on."""
    from fusebackend.kernels import forked_compiles, triton_api

    real = triton_api._compile_for_the_cache  # (the launcher built as the processes build it)

    def timed_compile(compile_fn: Any) -> None:
        seen: dict[str, Any] = {}

        def compile_timed() -> Any:
            seen["start"] = time.perf_counter()
            kernel = compile_fn()
            seen["compiled"], seen["name"] = time.perf_counter(), getattr(kernel, "name", "?")
            return kernel

        real(compile_timed)
        launcher = time.perf_counter() - seen["compiled"]
        with open(os.path.join(folder, str(os.getpid())), "a") as log_file:
            log_file.write(f"{seen['name']} {seen['start']} "
                           f"{seen['compiled'] - seen['start']} {launcher}\n")  # fmt: skip

    triton_api._compile_for_the_cache = timed_compile
    original_fork = forked_compiles._fork

    def timed_fork(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return original_fork(*args)
        finally:
            CHILDREN["forks"].append(time.perf_counter() - start)
            CHILDREN.setdefault("first_fork", [start])

    forked_compiles._fork = timed_fork


CHILDREN: dict[str, list[float]] = collections.defaultdict(list)
KEY_TIMES: dict[str, float] = {}  # Triton's cache key: when its thread started and ended


def _record_cache_key() -> None:
    """Record when Triton's cache key thread (``triton_api.start_cache_key``) starts and
    ends, and when the precompile starts (where it joins that thread)."""
    import threading

    from fusebackend.kernels import triton_api

    original = triton_api.start_cache_key

    def recorded() -> None:
        fresh = triton_api._cache_key_thread is None
        original()
        thread = triton_api._cache_key_thread
        if fresh and thread is not None:
            KEY_TIMES["start"] = time.perf_counter()

            def watch() -> None:
                thread.join()
                KEY_TIMES["end"] = time.perf_counter()

            threading.Thread(target=watch, daemon=True).start()

    import fusebackend.fusion

    fusebackend.fusion.start_cache_key = recorded  # (imported there by name)

    original_precompile = fusebackend.fusion.precompile_all

    def precompile_all(*args: Any, **kwargs: Any) -> Any:
        KEY_TIMES.setdefault("precompile", time.perf_counter())
        return original_precompile(*args, **kwargs)

    fusebackend.fusion.precompile_all = precompile_all


def _print_backend_detail() -> None:
    """Triton's cache key (how long, and how long the precompile waited on it) and the
    backend's costliest passes (its report's ``pass_seconds``)."""
    import fusebackend

    if {"start", "end"} <= KEY_TIMES.keys():
        waited = max(0.0, KEY_TIMES["end"] - KEY_TIMES.get("precompile", KEY_TIMES["end"]))
        print(
            f"    Triton's cache key: {KEY_TIMES['end'] - KEY_TIMES['start']:.3f} s on its "
            f"thread; the precompile waited {waited:.3f} s for it"
        )
    KEY_TIMES.clear()
    graphs = fusebackend.reports().graphs
    if graphs:
        seconds = graphs[-1].pass_seconds
        top = sorted(seconds.items(), key=lambda kv: -kv[1])[:10]
        print(f"    passes: {sum(seconds.values()):.3f} s; " + ", ".join(
            f"{name} {value:.3f}" for name, value in top))  # fmt: skip


def _print_children(folder: str) -> None:
    """The forks' times, and per child its compiles and launcher builds (``_record_children``)."""
    forks = CHILDREN.pop("forks", [])
    first = CHILDREN.pop("first_fork", [0.0])[0]
    if forks:
        print(f"    forks: {len(forks)}, {sum(forks):.3f} s in all (max {max(forks):.3f})")
    every: list[tuple[float, str]] = []  # (compile seconds, kernel) over all children
    for entry in sorted(os.listdir(folder)):
        with open(os.path.join(folder, entry)) as log_file:
            lines = [line.split() for line in log_file]
        os.remove(os.path.join(folder, entry))
        every += [(float(c), name) for name, _, c, _ in lines]
        starts = [float(s) for _, s, _, _ in lines]
        compile_s = sum(float(c) for *_, c, _ in lines)
        launcher_s = sum(float(x) for *_, x in lines)
        print(
            f"    child {entry}: {len(lines)} compiles, first starts {min(starts) - first:.3f} s "
            f"after the first fork; compile {compile_s:.3f} s, launchers {launcher_s:.3f} s"
        )
    if every:  # what sets the processes' end: the longest single compiles
        longest = sorted(every, reverse=True)[:10]
        print("    longest compiles: " + ", ".join(f"{n} {sec:.2f} s" for sec, n in longest))


def _timm_case(name: str, batch: int, device: torch.device) -> Any:
    """A suite-like case (``model``, ``kwargs``, ``sweep``, ``prepare``) of a timm model."""
    import types

    import timm

    model = timm.create_model(name, pretrained=False).eval().to(device, torch.float16)
    x = torch.randn(batch, 3, 224, 224, device=device, dtype=torch.float16)
    return types.SimpleNamespace(model=model, kwargs={"x": x}, sweep=None, prepare=lambda: None)


def _build_launchers_optimised() -> None:
    """The compile processes build launchers as Triton does (-O3). Triton's ``_build`` calls
    ``knobs.build.impl`` when one is set, and the processes set theirs around the build: it is
    unset for the call (a lambda calling ``_build`` recursed, 2026-11-30)."""
    import triton
    import triton.runtime.build

    from fusebackend.kernels import triton_api

    def optimised(*build: Any) -> str:
        impl, triton.knobs.build.impl = triton.knobs.build.impl, None
        try:
            return triton.runtime.build._build(*build, [])
        finally:
            triton.knobs.build.impl = impl

    triton_api._unoptimised_build = optimised


def main() -> None:
    from suite import measure, workloads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-decode", help="a suite workload name")
    parser.add_argument("--rounds", type=int, default=2, help="Dynamo / infinifuse pairs")
    parser.add_argument("--profile", action="store_true", help="cProfile the backend")
    parser.add_argument(
        "--profile-runs", action="store_true", help="cProfile the runtime's first runs"
    )
    parser.add_argument("--quick", action="store_true", help="the suite's small configs")
    parser.add_argument("--timm", metavar="NAME", help="a timm model instead of --model")
    parser.add_argument("--batch", type=int, default=1, help="--timm's images per call")
    parser.add_argument(
        "--threads", type=int, default=None, help="the precompile's threads (default: its own)"
    )
    parser.add_argument(
        "--optimised-launchers",
        action="store_true",
        help="the compile processes build Triton's launchers at -O3, as Triton does (by "
        "default they build them at -O0), for an A/B in one session",
    )
    parser.add_argument(
        "--no-key-thread",
        action="store_true",
        help="no background thread for Triton's cache key (the precompile computes it)",
    )
    parser.add_argument(
        "--children", action="store_true", help="each compile process's compiles and launchers"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="eager's forward alone before the first round's infinifuse call (no throwaway "
        "trace, no Dynamo-alone call): a cold process's first call, as the vision suite's, its "
        "one-time costs included",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="the precompile's compile processes (0: threads alone; default: its own)",
    )
    args = parser.parse_args()
    import fusebackend.fusion

    fusebackend.fusion.precompile_all = functools.partial(
        fusebackend.fusion.precompile_all, threads=args.threads, processes=args.processes
    )
    _record_cache_key()
    if args.no_key_thread:
        fusebackend.fusion.warm_compiler = lambda device: None
        fusebackend.fusion.warm_compiler_early = lambda: None
    if args.optimised_launchers:
        _build_launchers_optimised()
    _record_compiles()
    children_folder = None
    if args.children:
        import tempfile

        children_folder = tempfile.mkdtemp(prefix="first_call_children_")
        _record_children(children_folder)
    import transformers
    import triton

    from fusebackend.backend import infinifuse

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"{name}, torch {torch.__version__}, Triton {triton.__version__}, transformers "
        f"{transformers.__version__}"
    )
    print(
        f"{args.timm or args.model}: precompile threads {args.threads or '(default)'}, "
        f"processes {'(default)' if args.processes is None else args.processes}, "
        f"TRITON_CACHE_DIR="
        f"{os.environ.get('TRITON_CACHE_DIR', '(default)')}"
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.timm:
        case = _timm_case(args.timm, args.batch, device)
    else:
        (workload,) = workloads.select(workloads.workloads(args.quick, device), args.model)
        case = workload.build(device, 20)
    profile = cProfile.Profile() if args.profile else None
    global RUNS_PROFILE
    RUNS_PROFILE = cProfile.Profile() if args.profile_runs else None

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            return infinifuse(gm, example_inputs)
        finally:
            if profile is not None:
                profile.disable()
            PHASES["backend"] += time.perf_counter() - start

    def first_call(compile_backend: Any) -> float:
        measure.fresh_state(device)
        case.prepare()
        _sync()
        start = time.perf_counter()
        torch.compile(case.model, backend=compile_backend)(**case.kwargs)
        _sync()
        return time.perf_counter() - start

    with torch.no_grad():
        if args.cold:  # eager's outputs first, as the vision suite computes its references
            case.model(**case.kwargs)
            _sync()
        else:
            measure.prewarm(case, device)
        for r in range(args.rounds):
            cold = args.cold and r == 0
            if not cold:
                dynamo = first_call("eager")
            PHASES.clear()
            with _runtime_phases():
                fused = first_call(backend)
            if cold:  # Dynamo alone afterwards, warm: the rest of Dynamo's share is one-time
                dynamo = first_call("eager")
            rest = PHASES["backend"] + PHASES["runtime: whole call"]
            print(
                f"round {r}: Dynamo alone {dynamo:.2f} s; infinifuse {fused:.2f} s "
                f"({fused / dynamo:.2f}x): Dynamo's share {fused - rest:.2f} s"
            )
            for name, seconds in sorted(PHASES.items()):
                print(f"    {name:24s} {seconds:6.3f} s")
            _print_backend_detail()
            _print_compiles()
            if children_folder is not None:
                _print_children(children_folder)
    if RUNS_PROFILE is not None:
        text = io.StringIO()
        stats = pstats.Stats(RUNS_PROFILE, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        print("the runtime's first runs, profiled:\n" + text.getvalue())
    if profile is not None:
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats("fusebackend", 30)
        stats.sort_stats("tottime").print_callers(8)
        print(text.getvalue())


if __name__ == "__main__":
    main()
