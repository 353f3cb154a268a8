"""Measuring one (workload, backend): first call, per-call latency, memory, error, mode.

Per-call latency is wall time with the CPU included: a loop of calls between two
``torch.cuda.synchronize()``, divided by its length; the figure is the median over rounds.
First call: the first call after ``torch._dynamo.reset()`` (compile, and for infinifuse the
CUDA-graph capture, included). Errors are ``||out - ref|| / ||ref||`` in float64 against
eager on the same inputs and state, on the first call and on the last warm-up call (the
replayed path for every CUDA-graph backend).
"""

from __future__ import annotations

import gc
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

# The copy probe shared with the kernel benchmarks (benchmarks/ is on sys.path, as for
# workloads' embedding_chain.Chain)
from embedding_chain import copy_bandwidth_gbs

import fusebackend
import fusebackend.backend  # register_cache_key_start: what fresh_state restores
import fusebackend.report as fusebackend_report  # _reports_since: every graph of one row

# No garbage collection while timing, as timeit does: one collection inside a short loop
# would be that round's outlier, not a cost of the backend. The backend pauses it the same way.
from fusebackend.pipeline import collector_paused as _gc_off

from .workloads import Case, Workload

__all__ = [
    "BACKENDS",
    "CUDA_ONLY",
    "DEFAULT_BACKENDS",
    "TOLERANCE",
    "borrow_kernel_counts",
    "copy_bandwidth",
    "count_kernels",
    "floor_fields",
    "fresh_state",
    "measure",
    "prewarm",
    "references",
    "warm_process",
]

BACKENDS = (
    "eager", "dynamo", "inductor", "reduce-overhead", "infinifuse", "infinifuse-nofusion",
    "infinifuse-nomatmul", "infinifuse-nopdl", "infinifuse-fold", "infinifuse-nogemv",
)  # fmt: skip
# Variants that run with flags of fusebackend.kernels modules set otherwise while they run
# (each launcher reads its flag at each call; a captured graph keeps what it was captured
# with): programmatic dependent launch and the matmul weight prefetch off, which matter on
# Hopper GPUs alone; decode attention's combine folded into its last program; one-row matmul
# groups on tensor cores (matmul.ONE_ROW_GEMV off).
INFINIFUSE_FLAGS: dict[str, dict[tuple[str, str], Any]] = {
    "infinifuse-nopdl": {("dependent_launch", "USE_PDL"): False, ("matmul", "PREFETCH_K"): 0},
    "infinifuse-fold": {("decode_attention", "FOLD_COMBINE"): True},
    "infinifuse-nogemv": {("matmul", "ONE_ROW_GEMV"): False},
}
# Without --backends: all but the flag variants (diagnostics: name them to run them)
DEFAULT_BACKENDS = tuple(b for b in BACKENDS if b not in INFINIFUSE_FLAGS)
# Each infinifuse variant's options beside the defaults: fusion off, or matmul groups off
# (passes/matmul_groups.py), so one run measures what each part of the fusion gives.
INFINIFUSE_OPTIONS: dict[str, dict[str, Any]] = {
    "infinifuse": {},
    "infinifuse-nofusion": {"fusion": False},
    "infinifuse-nomatmul": {"matmul_groups": False},
    "infinifuse-nopdl": {},  # the defaults, with INFINIFUSE_FLAGS
    "infinifuse-fold": {},
    "infinifuse-nogemv": {},
}
CUDA_ONLY = frozenset({"inductor", "reduce-overhead"})  # Inductor on CPU needs a C++ toolchain
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4}

# Calls after the first before timing. cudagraph trees (reduce-overhead) run a warm-up on
# the 1st call of a shape, record on the 2nd and replay from the 3rd; infinifuse captures
# on the 1st. Three make every backend's last warm-up call a steady-state one.
WARMUP = 3


def make_fn(model: torch.nn.Module, backend: str) -> Callable[..., Any]:
    if backend == "eager":
        return model
    if backend == "dynamo":
        return torch.compile(model, backend="eager")
    if backend == "inductor":
        return torch.compile(model)
    if backend == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    if backend in INFINIFUSE_OPTIONS:
        options = INFINIFUSE_OPTIONS[backend]
        compiled = torch.compile(model, backend="infinifuse", options=options or None)
        flags = INFINIFUSE_FLAGS.get(backend)
        return _with_flags(compiled, flags) if flags else compiled
    raise ValueError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")


def _with_flags(fn: Callable[..., Any], flags: dict[tuple[str, str], Any]) -> Callable[..., Any]:
    """``fn`` with ``flags`` ((module of fusebackend.kernels, name) -> value) set while it
    runs, and set back after."""
    targets = [
        (importlib.import_module(f"fusebackend.kernels.{module}"), name, value)
        for (module, name), value in flags.items()
    ]

    def call(*args: Any, **kwargs: Any) -> Any:
        saved = [(module, name, getattr(module, name)) for module, name, _ in targets]
        for module, name, value in targets:
            setattr(module, name, value)
        try:
            return fn(*args, **kwargs)
        finally:
            for module, name, value in saved:
                setattr(module, name, value)

    return call


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in GB/s, bytes read plus bytes written
    (``embedding_chain.copy_bandwidth_gbs``' ceiling, 256 MB each way, as
    benchmarks/matmul_kernels.py measures it); None without CUDA."""
    if device.type != "cuda":
        return None
    return copy_bandwidth_gbs(device, 0.25)["ceiling"]


def floor_fields(
    weight_bytes: int | None, copy_gbs: float | None, per_call_ms: float | None
) -> dict[str, Any]:
    """A decode row's weight-streaming floor: ``floor_ms``, the step's weight bytes at the
    copy bandwidth, and ``floor_fraction``, floor_ms / per_call_ms (1.0: the step takes no
    longer than its weights take to stream). The copy bandwidth counts bytes read plus bytes
    written, so streaming the weights (read only) at that rate is what the floor is: the
    same convention as matmul_kernels.py's ``floor_us``. None where a figure is missing
    (no CUDA: no copy bandwidth; a row that did not run: no per call)."""
    floor_ms = weight_bytes / (copy_gbs * 1e9) * 1e3 if weight_bytes and copy_gbs else None
    fraction = floor_ms / per_call_ms if floor_ms is not None and per_call_ms else None
    return {"weight_bytes": weight_bytes, "copy_gbs": copy_gbs, "floor_ms": floor_ms,
            "floor_fraction": fraction}  # fmt: skip


def fresh_state(device: torch.device) -> None:
    """Forget every compiled graph, captured graph and counter."""
    torch._dynamo.reset()
    try:  # dynamo's reset clears cudagraph trees in recent torch; older ones need this
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    except Exception:  # noqa: BLE001  (absent or already reset: nothing to free)
        pass
    fusebackend.clear_cache()
    fusebackend.reset_stats()
    # Dynamo's reset dropped the callback a user's process has from its import (Triton's
    # cache key, started as a compile starts): a first call measured here starts as theirs
    fusebackend.backend.register_cache_key_start()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != eager's {tuple(ref.shape)}")
    denominator = ref.norm().item()
    return (out - ref).norm().item() / denominator if denominator else (out - ref).norm().item()


def _worst(errors: list[float]) -> float:
    """The largest error; NaN if any is NaN (``max`` would skip it depending on order)."""
    return float("nan") if any(e != e for e in errors) else max(errors)


def _grab(case: Case, out: Any) -> torch.Tensor:
    # Cloned at once: reduce-overhead's outputs are overwritten by its next call.
    return case.main_output(out).detach().clone()


def references(case: Case, device: torch.device) -> list[torch.Tensor]:
    """Eager outputs: per call 0..WARMUP (steady workloads) or per length (sweeps)."""
    model = case.model
    if case.sweep is not None:
        return [_grab(case, model(**kwargs)) for kwargs in case.sweep]
    case.prepare()
    refs = [_grab(case, model(**case.kwargs)) for _ in range(WARMUP + 1)]
    sync(device)
    return refs


def warm_process(device: torch.device, backends: list[str]) -> None:
    """Pay the process's one-time costs (imports, Inductor's compile workers, Triton's
    driver) on a toy function, so the first row of each backend does not carry them."""
    x = torch.randn(8, 8, device=device)
    table = torch.randn(16, 8, device=device)
    ids = torch.randint(0, 16, (4,), device=device)

    def toy(x: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        # An embedding with an elementwise consumer: infinifuse generates and compiles a kernel.
        return torch.nn.functional.embedding(ids, table) * 2.0 + torch.relu(x[:4])

    for backend in backends:
        if backend == "eager" or (backend in CUDA_ONLY and device.type != "cuda"):
            continue
        fresh_state(device)
        try:
            make_fn(toy, backend)(x, ids, table)
        except Exception:  # noqa: BLE001  (the real rows will record the failure)
            pass
    sync(device)
    fresh_state(device)


def prewarm(case: Case, device: torch.device) -> None:
    """One throwaway Dynamo trace of the model: the first trace of a model's code pays for
    caches that outlive ``torch._dynamo.reset()`` (source inspection, lazy imports), which
    made the first compiled row's first call ~2x slower than the next (CPU, tiny Llama:
    1.47 s vs 0.67 s)."""
    fn = torch.compile(case.model, backend="eager")
    case.prepare()
    fn(**(case.sweep[0] if case.sweep is not None else case.kwargs))
    sync(device)
    fresh_state(device)


def infinifuse_state(device: torch.device | None = None) -> dict[str, Any]:
    """Modes reached and the counters worth keeping, from ``fusebackend.stats()``.

    ``all_captured``: every input signature runs from a CUDA graph (no mode "eager", the
    zoo's criterion); None where nothing can be captured (no CUDA device).
    """
    stats = fusebackend.stats()
    modes = list(stats["fusion_modes"].values())
    eager = sum(mode == "eager" for mode in modes)
    captured = None if device is None or device.type != "cuda" else bool(modes) and not eager
    keep = (
        "cache_size",
        "cache_hits",
        "cache_misses",
        "recordings",
        "fusion_attempts",
        "fusion_successes",
        "fusion_fallbacks",
        "evictions",
        "rerecords",
        "capture_failures",
        "graph_pool_bytes",
    )
    reasons = sorted(set(stats["fallback_reasons"].values()))
    return {
        "mode": ",".join(sorted(set(modes))) or "none",
        "signatures": len(modes),
        "eager_signatures": eager,
        "all_captured": captured,
        "stats": {k: stats[k] for k in keep},
        "fallback_reasons": [r[:400] for r in reasons[:5]],
    }


def measure(
    workload: Workload, case: Case, backend: str, device: torch.device, refs: list[torch.Tensor]
) -> dict[str, Any]:
    """One row. The caller resets state before and after."""
    reports_before = fusebackend_report._recorded
    fn = make_fn(case.model, backend)
    step = (
        torch.compiler.cudagraph_mark_step_begin
        if backend == "reduce-overhead" and hasattr(torch.compiler, "cudagraph_mark_step_begin")
        else None
    )
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        mem_before = torch.cuda.memory_allocated(device)
    if case.sweep is not None:
        row = _sweep(case, fn, step, device, refs, workload.loop)
    else:
        row = _steady(case, fn, step, device, refs, workload.rounds, workload.loop)
    if cuda:
        row["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        row["mem_before_mb"] = mem_before / 2**20
    tolerance = TOLERANCE.get(workload.dtype, 1e-4)
    row["tolerance"] = tolerance
    row["error_ok"] = row["rel_error"] <= tolerance  # NaN compares False
    if backend.startswith("infinifuse"):
        row.update(infinifuse_state(device))
        # Every graph compiled for this row (a model with graph breaks has several);
        # last_report() would show only the last one.
        graphs = fusebackend_report._reports_since(reports_before)
        row["graphs"] = len(graphs)
        row["fused_groups"] = sum(len(graph.groups) for graph in graphs)
    else:
        row["mode"] = "n/a"
    if workload.count_kernels and backend != "reduce-overhead":  # see borrow_kernel_counts
        row.update(count_kernels(case, backend, fn, device))
    return row


def count_kernels(
    case: Case, backend: str, fn: Callable[..., Any], device: torch.device
) -> dict[str, Any]:
    """CUDA kernels launched by one steady call WITHOUT CUDA graphs, from torch.profiler.

    infinifuse is compiled again with ``cudagraphs=False`` (its timed rows replay graphs,
    whose kernels the profiler would not show as launches); eager, Dynamo and Inductor's
    default mode launch every kernel anyway, so their timed ``fn`` is reused. Memcpy and
    memset activities are counted apart from kernels. Without a CUDA device the same path
    runs and the counts are None (no CUDA activity to count).
    """
    if backend.startswith("infinifuse"):
        fresh_state(device)  # the timed row's stats were read already
        options: dict[str, Any] = {"cudagraphs": False, **INFINIFUSE_OPTIONS[backend]}
        fn = torch.compile(case.model, backend="infinifuse", options=options)
        if backend in INFINIFUSE_FLAGS:
            fn = _with_flags(fn, INFINIFUSE_FLAGS[backend])
    step = None  # reduce-overhead never gets here
    cuda = device.type == "cuda"
    case.prepare()
    for _ in range(1 + WARMUP):  # the first call compiles (infinifuse) or was timed already
        _call(fn, case.kwargs, step)
    sync(device)
    modes = (
        sorted(set(fusebackend.stats()["fusion_modes"].values()))
        if backend.startswith("infinifuse")
        else None
    )
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else
                  torch.profiler.ProfilerActivity.CPU]  # fmt: skip
    with torch.profiler.profile(activities=activities) as prof:
        _call(fn, case.kwargs, step)
        sync(device)
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in device_events if e.name.startswith(("Memcpy", "Memset"))]
    kernels = len(device_events) - len(copies) if cuda else None
    layers = getattr(getattr(case.model, "config", None), "num_hidden_layers", None)
    return {
        "kernels_per_call": kernels,
        # a decoder layer's share (the whole call's kernels over its layers: the embedding,
        # final norm and LM head are counted in, so it is a bound from above)
        "kernels_per_layer": round(kernels / layers, 2) if kernels and layers else None,
        "copies_per_call": len(copies) if cuda else None,
        "kernels_source": "own call, no CUDA graphs" if cuda else "no CUDA device",
        "kernels_modes": modes,
        "kernel_us_per_call": sum(e.device_time for e in device_events) if cuda else None,
        "kernel_kinds": _kernel_kinds(device_events) if cuda else None,
    }


def _kernel_kinds(events: list[Any], top: int = 25) -> list[dict[str, Any]]:
    """The kernels that take the most device time in one call, by name: where a per-call
    gap to another backend comes from (launch count alone does not say). Memcpy and memset
    activities are listed too (``kernels_per_call`` leaves them out)."""
    kinds: dict[str, dict[str, Any]] = {}
    for e in events:
        kind = kinds.setdefault(e.name[:90], {"name": e.name[:90], "count": 0, "us": 0.0})
        kind["count"] += 1
        kind["us"] += e.device_time
    ranked = sorted(kinds.values(), key=lambda k: -k["us"])[:top]
    return [{**k, "us": round(k["us"], 2)} for k in ranked]


def borrow_kernel_counts(rows: list[dict[str, Any]]) -> None:
    """reduce-overhead's rows take the kernel counts of Inductor's default mode: the same
    generated code, but its CUDA graphs hide the launches from the profiler."""
    inductor = {r["workload"]: r for r in rows if r["backend"] == "inductor"}
    for row in rows:
        source = inductor.get(row["workload"])
        if row["backend"] != "reduce-overhead" or source is None or row["status"] != "ok":
            continue
        if "kernels_source" not in source:
            continue  # this workload counts no kernels
        row["kernels_per_call"] = source.get("kernels_per_call")
        for key in ("copies_per_call", "kernel_us_per_call", "kernel_kinds"):
            row[key] = source.get(key)
        row["kernels_source"] = "Inductor's default mode (its graphs hide launches)"


def _call(fn: Callable[..., Any], kwargs: dict[str, Any], step: Callable | None) -> Any:
    if step is not None:
        step()
    return fn(**kwargs)


def _steady(
    case: Case,
    fn: Callable[..., Any],
    step: Callable | None,
    device: torch.device,
    refs: list[torch.Tensor],
    rounds: int,
    loop: int,
) -> dict[str, Any]:
    kwargs = case.kwargs
    case.prepare()
    sync(device)
    start = time.perf_counter()
    first = _grab(case, _call(fn, kwargs, step))
    sync(device)
    first_call_s = time.perf_counter() - start
    for _ in range(WARMUP):
        out = None  # the previous output must not be alive during the next call
        out = _call(fn, kwargs, step)
    last_warm = _grab(case, out)
    sync(device)
    warm_s = time.perf_counter() - start
    out = None
    errors = [rel_error(first, refs[0]), rel_error(last_warm, refs[WARMUP])]
    del first, last_warm

    per_round = []
    gc.collect()
    with _gc_off():
        for _ in range(rounds):
            sync(device)
            start = time.perf_counter()
            for _ in range(loop):
                out = None
                out = _call(fn, kwargs, step)
            sync(device)
            per_round.append((time.perf_counter() - start) / loop * 1e3)
    out = None
    return {
        "first_call_s": first_call_s,
        "warm_s": warm_s,
        "per_call_ms": statistics.median(per_round),
        "per_call_ms_rounds": per_round,
        "timed_calls": rounds * loop,
        "rel_error": _worst(errors),
        "rel_error_first_call": errors[0],
        "rel_error_warm_call": errors[1],
    }


def _sweep(
    case: Case,
    fn: Callable[..., Any],
    step: Callable | None,
    device: torch.device,
    refs: list[torch.Tensor],
    calls_per_length: int,
) -> dict[str, Any]:
    """First pass over every length (the headline), timing each length's last call too."""
    assert case.sweep is not None
    outputs, last_call_ms = [], []
    sync(device)
    start = time.perf_counter()
    for kwargs in case.sweep:
        for _ in range(calls_per_length - 1):
            out = None
            out = _call(fn, kwargs, step)
        sync(device)  # a few syncs in a pass of seconds: noise below 0.1 %
        with _gc_off():
            call_start = time.perf_counter()
            out = None
            out = _call(fn, kwargs, step)
            sync(device)
            last_call_ms.append((time.perf_counter() - call_start) * 1e3)
        outputs.append(_grab(case, out))
    sync(device)
    first_pass_s = time.perf_counter() - start
    out = None
    errors = [rel_error(o, r) for o, r in zip(outputs, refs)]
    return {
        "first_call_s": first_pass_s,  # the whole first pass, compiles included
        "warm_s": None,
        "per_call_ms": statistics.median(last_call_ms),  # median over lengths, warm call
        "per_call_ms_rounds": last_call_ms,
        "timed_calls": len(last_call_ms),
        "rel_error": _worst(errors),
        "rel_error_per_length": errors,
    }
