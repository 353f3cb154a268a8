"""Shared helpers for the CPU tests: compile with infinifuse, prove fusion, compare to eager.

Tolerances (``TOLERANCES``): fp32 and fp64 use ``torch.testing.assert_close``'s defaults.
fp16: atol = rtol = 1e-2; the kernel rounds every op to fp16 as eager does, but computes
each op in fp32 with its own formulas (gelu, tanh, sigmoid), so results can differ by an
ulp of fp16 (~1e-3 relative) per op and a chain of a few ops stays well inside 1e-2.
bf16: atol = rtol = 2e-2; a bf16 ulp is 8x an fp16 ulp (7 explicit mantissa bits: up to
7.8e-3 relative), so one ulp of disagreement after rounding must pass. On CPU it matters
more: Triton 3.6's interpreter converts fp32 -> bf16 by truncation (round toward zero; see
triton/runtime/interpreter.py ``cast_impl`` -> ``_convert_float`` with no rounding mode)
where eager and GPU Triton round to nearest even, so every bf16 value the kernel rounds can
be one full ulp off eager's. 2e-2 still covers that for the chains tested (measured: at most
1.0e-2 needed for single values); a *sum* of many such values does not (errors add up), so
the tests reduce with amax, never sum, after a bf16 group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import fusebackend
import fusebackend.backend
import fusebackend.row_ops
from fusebackend.report import FusionReport

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {},
    torch.float64: {},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Eager's function for each activation name a kernel epilogue takes (kernels.ir.ACTIVATIONS,
# "" the identity; "gelu_new", transformers' NewGELU, is test_epilogue.py's alone)
EAGER_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "": lambda y: y,
    "relu": torch.relu,
    "relu6": torch.nn.functional.relu6,
    "silu": torch.nn.functional.silu,
    "hardswish": torch.nn.functional.hardswish,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
}
# (rtol, atol) of a hand-written vision kernel (depthwise convolution, GroupNorm) with its
# activation, against eager's ops in fp32 rounded once
KERNEL_TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
INDEX_DTYPES = [torch.int64, torch.int32]


def tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(TOLERANCES.get(dtype, {}))


def assert_close(
    actual: Any,
    expected: Any,
    *,
    equal_nan: bool = False,
    floor_dtype: torch.dtype | None = None,
    **override: Any,
) -> None:
    """assert_close with the tolerance of ``expected``'s dtype (per tensor, recursively).

    ``floor_dtype``: the computation went through this dtype (e.g. bf16 math cast to fp32 at
    the end), so the tolerance is never tighter than that dtype's.
    """
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)), f"expected a sequence, got {type(actual)}"
        assert len(actual) == len(expected), f"{len(actual)} outputs, expected {len(expected)}"
        for a, e in zip(actual, expected):
            assert_close(a, e, equal_nan=equal_nan, floor_dtype=floor_dtype, **override)
        return
    assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {actual.shape}, expected {expected.shape}"
    kwargs = tol(expected.dtype)
    if floor_dtype is not None and tol(floor_dtype).get("rtol", 0) > kwargs.get("rtol", 0):
        kwargs = tol(floor_dtype)
    kwargs.update(override)
    if expected.dtype == torch.bool:
        kwargs = {}
    torch.testing.assert_close(actual, expected, equal_nan=equal_nan, **kwargs)


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp16 through a deep net: the largest difference within 2% of the output's own scale
    (per-element tolerances do not hold after dozens of layers)."""
    scale = expected.float().abs().max().item() + 1e-3
    assert (actual.float() - expected.float()).abs().max().item() <= 2e-2 * scale


def timm_fp16_replayed(name: str, size: int, seed: int) -> None:
    """A timm model (``pretrained=False``, fp16, CUDA) compiled with infinifuse and run three
    times on one batch of 2 (the 2nd call captures, the 3rd replays): the replay equals
    eager's output (``assert_close_to_scale``); the compile's report is then the last."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False).eval().to("cuda", torch.float16)
    compiled = torch.compile(model, backend="infinifuse")
    x = torch.randn(2, 3, size, size, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        expected = model(x)
        for _ in range(3):
            out = compiled(x)
    assert_close_to_scale(out, expected)


def rand_table(rows: int, dim: int, dtype: torch.dtype = torch.float32, *, g=None) -> torch.Tensor:
    """A random table whose entries are never zero: |x| in [0.05, 2.05), random sign."""
    mag = torch.rand(rows, dim, generator=g) * 2.0 + 0.05
    sign = torch.where(torch.rand(rows, dim, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(dtype)


def rand_ids(
    high: int, shape: Sequence[int], dtype: torch.dtype = torch.int64, *, g=None
) -> torch.Tensor:
    return torch.randint(0, high, tuple(shape), generator=g).to(dtype)


@contextlib.contextmanager
def count_launches() -> Iterator[list[int]]:
    """Count fused-kernel launches made by the backend (one per group, one per pair of
    groups launched together)."""
    calls = [0]

    def counting(real: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return real(*args, **kwargs)

        return spy

    row_ops = fusebackend.row_ops
    with (
        mock.patch.object(row_ops, "row_kernel", counting(row_ops.row_kernel)),
        mock.patch.object(row_ops, "row_kernel_pair", counting(row_ops.row_kernel_pair)),
    ):
        yield calls


def compile_fused(fn: Callable[..., Any], options: dict[str, Any] | None = None) -> Any:
    """torch.compile with infinifuse; first-run validation off, so the fused outputs are
    what the call returns (a wrong kernel must fail the comparison with eager, not be
    silently replaced by the unfused graph)."""
    return torch.compile(
        fn, backend="infinifuse", fullgraph=True, options={"validate": False, **(options or {})}
    )


class FakeGraph:
    """CPU stand-in for a captured CUDA graph (the runtime's tests patch
    ``runtime.capture.capture_graph`` to make one): fixed input and output buffers, the
    outputs recomputed in place on each replay."""

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> None:
        self.fn = fn
        self.inputs = list(inputs)
        self.outputs = fn(*self.inputs)
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        # Give other threads the GIL here, as a GPU would run the graph asynchronously: a
        # cache that let another call refill the static inputs now would be caught.
        time.sleep(0)
        for buf, new in zip(self.outputs, self.fn(*self.inputs), strict=True):
            if isinstance(buf, torch.Tensor) and buf is not new:
                buf.copy_(new)


def run_fused(
    fn: Callable[..., Any],
    *args: Any,
    options: dict[str, Any] | None = None,
    expect_fused: bool = True,
) -> tuple[Any, FusionReport]:
    """Compile ``fn`` with infinifuse, run it once under no_grad; return (outputs, report).

    With ``expect_fused`` this proves fusion happened and ran: the graph's path is "fused",
    every group runs on Triton (the interpreter on CPU), the generated kernel was launched,
    and the runtime kept the signature in "fusion" mode (no fallback to the unfused graph).
    """
    previous = fusebackend.last_report().graphs
    compiled = compile_fused(fn, options)
    with torch.no_grad(), count_launches() as launches:
        out = compiled(*args)
    report = fusebackend.last_report()
    assert report.graphs, "no graph was compiled"
    assert not previous or report.graphs[0] is not previous[0], "no new graph was compiled"
    if expect_fused:
        assert_fused(report)
        assert launches[0] >= 1, "the fused kernel was never launched"
    return out, report


def row_groups(report: Any) -> list[Any]:
    """The row kernels' groups of a FusionReport or GraphReport (matmul groups left out)."""
    return [g for g in report.groups if g.family == "row"]


def assert_fused(report: FusionReport) -> None:
    graph = report.graphs[-1]
    assert graph.path == "fused", f"{graph.path}\n{report}"
    assert report.groups, str(report)
    for group in report.groups:
        assert group.backend == "triton", str(report)
    for group in row_groups(report):
        assert group.kernel_name in group.source
    modes = graph.runtime_modes()
    assert modes, "the compiled graph never ran"
    for entry in modes:
        assert entry["mode"] == "fusion", f"fell back: {entry}"
        assert entry["reason"] is None, entry


def perturb_uniform_parameters(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter whose elements are all equal random, non-uniform values around
    them (N(0, 0.2) added), in place; returns ``model``.

    transformers' and torch's initialisations leave biases at 0 and norm weights at 1: a
    kernel that drops a bias, reads another half's bias or skips a norm's scale gives eager's
    result on such weights (the rotary epilogue's bias halves went through every CPU test)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() and bool(param.min() == param.max()):
                noise = torch.randn(param.shape, generator=g, dtype=torch.float32) * 0.2
                param.add_(noise.to(param.device, param.dtype))
    return model


def graphs_since(previous: FusionReport) -> list[Any]:
    """The graph reports recorded after ``previous`` (a ``fusebackend.reports()`` taken before
    compiling): compared by identity, since only the last 256 reports are kept."""
    seen = {id(graph) for graph in previous.graphs}
    return [graph for graph in fusebackend.reports().graphs if id(graph) not in seen]


def run_model_twice(
    model: torch.nn.Module, x: torch.Tensor, **options: Any
) -> tuple[Any, Any, Any]:
    """``model`` compiled with infinifuse (``options`` its options) from a fresh Dynamo and
    cache, called twice on ``x`` under no_grad: (the second call's output, eager's, the one
    graph report made)."""
    torch._dynamo.reset()
    fusebackend.clear_cache()
    before = fusebackend.reports()
    compiled = torch.compile(model, backend="infinifuse", options=options)
    with torch.no_grad():
        for _ in range(2):
            out = compiled(x)
        expected = model(x)
    (graph,) = graphs_since(before)
    return out, expected, graph


def rewrites_of(graphs: Sequence[Any], key: str) -> list[str]:
    """What one pass reported (``GraphReport.rewrites[key]``) over all ``graphs``, in order."""
    return [name for graph in graphs for name in graph.rewrites.get(key, [])]


def assert_model_fused(
    graphs: Sequence[Any], *, row_groups: int = 0, matmul_launches: int = 0
) -> None:
    """A whole model ran the path it claims: every graph was rewritten with fused kernels, every
    live signature runs in mode "fusion" (a validation demotion to "graph_replay" or "eager",
    which leaves outputs equal to eager's, fails here), and each graph kept at least
    ``row_groups`` row groups and ``matmul_launches`` matmul-group launches."""
    assert graphs, "no graph was compiled"
    live = 0
    for graph in graphs:
        assert graph.path == "fused", f"{graph.name}: {graph.path}"
        for entry in graph.runtime_modes():
            live += 1
            assert entry["mode"] == "fusion", f"{graph.name} fell back: {entry}"
        assert len(graph.groups) >= row_groups, (graph.name, [g.name for g in graph.groups])
        matmuls = sum(n for kernel, n in graph.launches.items() if kernel.startswith("matmul"))
        assert matmuls >= matmul_launches, (graph.name, graph.launches)
    assert live, "no signature of these graphs is live: nothing ran through the cache"


def tiny_llama_config(layers: int = 2) -> Any:
    """A Llama of 64 wide, 4 query and 2 K/V heads over a 97-token vocabulary (random
    weights): the small decoder the CPU tests build (imports transformers)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def eager(fn: Callable[..., Any], *args: Any) -> Any:
    with torch.no_grad():
        return fn(*args)


def check(
    fn: Callable[..., Any],
    *args: Any,
    options: dict[str, Any] | None = None,
    equal_nan: bool = False,
    **override: Any,
) -> FusionReport:
    """Compile and run ``fn`` fused, compare every output to eager; return the report."""
    expected = eager(fn, *args)
    actual, report = run_fused(fn, *args, options=options)
    assert_close(actual, expected, equal_nan=equal_nan, **override)
    return report


def single_group(report: FusionReport):
    """The report's one row group (matmul groups beside it are not counted)."""
    rows = row_groups(report)
    assert len(rows) == 1, str(report)
    return rows[0]


def runtime_modes() -> list[str]:
    """The runtime mode of every signature of the last graph (fusion, graph_replay, eager)."""
    return [e["mode"] for e in fusebackend.last_report().graphs[-1].runtime_modes()]


def one_fallback_reason() -> str:
    """The only fallback reason in the stats (fails when there is none or several)."""
    reasons = fusebackend.stats()["fallback_reasons"]
    assert len(reasons) == 1, reasons
    return next(iter(reasons.values()))


def backend_warnings(caplog) -> list[str]:
    """Messages of the warnings the backend logged (``caplog`` fixture)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("fusebackend")
    ]


def is_fused_graph(fn) -> bool:
    """Is ``fn`` (a callable the runtime was handed) a graph with a fused group in it?"""
    return isinstance(fn, torch.fx.GraphModule) and any(
        isinstance(n.target, fusebackend.backend.FusedGroupOp) for n in fn.graph.nodes
    )


class LaunchRecorder:
    """Stands in for a Triton kernel: records each launch (``kernel[grid](*args, **meta)``)
    and each warm-up (``kernel.warmup(*args, grid=..., **meta)``) instead of running them."""

    def __init__(self, launches: list[tuple], warmups: list[tuple]) -> None:
        self.launches, self.warmups = launches, warmups

    def warmup(self, *args: Any, grid: Any, **meta: Any) -> None:
        self.warmups.append((list(args), grid, meta))

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **meta: self.launches.append((list(args), grid, meta))


def as_triton_sees(x: Any) -> Any:
    """What Triton specialises an argument on: a tensor (or a warm-up's pointer) as its dtype
    and 16-byte alignment, anything else as itself."""
    if hasattr(x, "data_ptr"):
        return (x.dtype, x.data_ptr() % 16 == 0)
    if hasattr(x, "address"):
        return (x.dtype, x.address % 16 == 0)
    return x


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' ``repeat_kv``, in its spelling: each K/V head ``n_rep`` times in a row."""
    b, kv_heads, length, width = x.shape
    x = x[:, :, None, :, :].expand(b, kv_heads, n_rep, length, width)
    return x.reshape(b, kv_heads * n_rep, length, width)


class TritonCompiles:
    """Counts the binaries Triton would compile on a GPU for the fused launches made while
    it is active (``with TritonCompiles() as compiles``), while the interpreter runs them.

    Each launch's key is what Triton's JIT caches binaries by: its specialisation of every
    argument, computed by Triton's own binder (``create_function_from_signature`` with the
    base backend's rules: pointers by dtype and 16-byte alignment, integers by 32/64-bit,
    equal to 1 and divisible by 16 unless ``do_not_specialize`` names them, floats by type
    only), its constexprs, and its launch options (warps, debug). Warm-ups
    (``launch.precompile``) are keyed alike, in ``warmed``.
    """

    def __init__(self) -> None:
        self.keys: list[tuple] = []  # one per launch
        self.warmed: list[tuple] = []  # one per warm-up
        self._binders: dict[Any, Any] = {}
        self._patches: list[Any] = []

    @property
    def distinct(self) -> set[tuple]:
        """One key per binary Triton would compile."""
        return set(self.keys)

    def key(self, kernel: Any, args: Sequence[Any], meta: dict[str, Any]) -> tuple:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        # the interpreter's kernels keep their options in ``kwargs``; a JITFunction (GPU) has
        # them as attributes
        settings = getattr(kernel, "kwargs", None) or {
            "do_not_specialize": kernel.do_not_specialize,
            "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment,
            "debug": kernel.debug,
        }
        binder = self._binders.get(kernel)
        if binder is None:
            options = {k: v for k, v in settings.items() if k.startswith("do_not_")}
            jit = JITFunction(kernel.fn, **options)
            binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
            self._binders[kernel] = binder
        _, specialization, options = binder(*args, **meta)
        return (kernel.fn.__name__, tuple(specialization), tuple(sorted(options.items())),
                settings.get("debug"))  # fmt: skip

    def __enter__(self) -> TritonCompiles:
        import fusebackend.kernels.launch as launch

        real_run = launch.run_on_device

        def run(kernel: Any, grid: Any, args: list[Any], meta: dict[str, Any], device: Any):
            self.keys.append(self.key(kernel, args, meta))
            return real_run(kernel, grid, args, meta, device)

        real_warmup = launch._warmup

        def warmup(kernel: Any, grid: Any, args: list[Any], meta: dict[str, Any]) -> None:
            self.warmed.append(self.key(kernel, args, meta))
            return real_warmup(kernel, grid, args, meta)

        self._patches = [mock.patch.object(launch, "run_on_device", run),
                         mock.patch.object(launch, "_warmup", warmup)]  # fmt: skip
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for patch in self._patches:
            patch.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    script: Path, nproc: int, *args: str, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun on ``nproc`` processes (one thread each) from the
    repository root; a run past ``timeout`` (a hung collective) kills the whole process
    group and fails the test with what it printed."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", str(script), *args,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=root, env=environment, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun ran past {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


# What every benchmark's JSON records about where it ran (benchmarks/row_kernels.versions)
BENCHMARK_ENVIRONMENT = ("device", "torch", "triton", "transformers", "python", "date")


def run_smoke(script: str, out: Path, benchmark: str, timeout: int = 300) -> dict[str, Any]:
    """Run ``benchmarks/<script> --smoke --out <out>`` in a subprocess (through Triton's
    interpreter where there is no GPU); check it exited 0 and wrote a smoke report of
    ``benchmark`` with its environment; return the report."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(root / "benchmarks" / script), "--smoke", "--out", str(out)]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    missing = [k for k in BENCHMARK_ENVIRONMENT if k not in report]
    assert not missing, missing
    assert report["benchmark"] == benchmark and report["smoke"] is True, report.get("benchmark")
    return report


def gpu_llama_decode(dtype: torch.dtype, tolerance: dict[str, float]) -> list[Any]:
    """A 2-layer Llama (256 wide, 8 query and 2 K/V heads) on the GPU: 4 prompt tokens into
    two StaticCaches eagerly, then 5 decode steps through eager and through
    ``torch.compile(backend="infinifuse")`` (validation on: it must pass; the 2nd call
    captures, the 3rd on replays), each step's logits compared. Returns the two caches
    (eager's, the compiled model's)."""
    import transformers

    torch.manual_seed(6)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval().to("cuda", dtype)
    caches = [
        transformers.StaticCache(config=config, max_cache_len=32, device="cuda", dtype=dtype)
        for _ in range(2)
    ]
    compiled = torch.compile(model, backend="infinifuse")
    ids = torch.randint(0, 1000, (1, 4), device="cuda")
    with torch.no_grad():
        for cache in caches:
            model(ids, past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(4, device="cuda"))  # fmt: skip
        for position in range(4, 9):
            token = torch.randint(0, 1000, (1, 1), device="cuda")
            where = torch.tensor([position], device="cuda")
            expected = model(token, past_key_values=caches[0], cache_position=where).logits
            actual = compiled(token, past_key_values=caches[1], cache_position=where).logits
            assert_close(actual.float(), expected.float(), **tolerance)
    return caches
