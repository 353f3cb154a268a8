"""Reliability on CPU: bad inputs, injected faults, stale outputs, memory and threads, all
through ``torch.compile(..., backend="infinifuse")``.

The backend sits under people's models: when something is wrong it must fail loudly (the
exception class eager raises, a message saying what was expected and what was given), fall
back when it can (reason in ``stats()["fallback_reasons"]`` and in the report), and never
return a wrong or stale tensor. docs/RELIABILITY.md maps every case to its test; cases that
existing files already cover are referenced there, not repeated here.

The CUDA-graph path is driven on CPU by the ``fake_capture`` fixture: the backend is told the
graph runs on a (fake) CUDA device and ``capture.capture_graph`` records a
``FakeGraph`` (fixed input and output buffers, recomputed in place on each replay), so the
runtime takes exactly the path it takes on a GPU: first run, capture, replay, static
buffers, re-record, fallback.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import operator
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    FakeGraph,
    assert_close,
    assert_fused,
    backend_warnings,
    eager,
    is_fused_graph,
    one_fallback_reason,
    rand_ids,
    rand_table,
    run_fused,
    runtime_modes,
)

import fusebackend
import fusebackend.backend
from fusebackend.kernels import launch
from fusebackend.runtime import capture as cap
from fusebackend.runtime import counters, graph_cache

V, P, D = 13, 16, 8  # vocabulary (odd), positions, row width
FAKE_CUDA = torch.device("cuda", 0)
LOGGER = "fusebackend"


# --- the CUDA-graph path on CPU --------------------------------------------------------


class Capture:
    """What the fake ``capture_graph`` saw and made; ``fail(fn)`` may raise to inject faults."""

    def __init__(self):
        self.graphs: list[weakref.ref[FakeGraph]] = []
        self.attempts: list[object] = []
        self.fail = None

    def __call__(self, fn, inputs, *, device, warmup_iterations):
        assert device == FAKE_CUDA
        self.attempts.append(fn)
        for _ in range(warmup_iterations):
            fn(*inputs)
        if self.fail is not None:
            self.fail(fn, inputs)
        graph = FakeGraph(fn, inputs)
        self.graphs.append(weakref.ref(graph))
        return graph, graph.outputs

    def live(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.graphs)


@pytest.fixture
def fake_capture(monkeypatch) -> Capture:
    monkeypatch.setattr(fusebackend.backend, "_graph_device", lambda inputs: FAKE_CUDA)
    capture = Capture()
    monkeypatch.setattr(cap, "capture_graph", capture)
    return capture


PATHS = ["direct", "captured"]


def _options(path: str, request, **options) -> dict:
    """Backend options for a runtime path; "captured" switches on the fake capture."""
    if path == "captured":
        request.getfixturevalue("fake_capture")
        options.setdefault("cudagraphs", True)
        # Capture on a signature's first call (the default waits for it to recur), so that
        # each test's first call already exercises the captured path.
        options.setdefault("capture_on_call", 1)
    return options


# --- models ------------------------------------------------------------------------------


def _embedding(rows: int, dim: int, dtype=torch.float32, **kwargs) -> nn.Embedding:
    emb = nn.Embedding(rows, dim, dtype=dtype, **kwargs)
    with torch.no_grad():
        emb.weight.copy_(rand_table(rows, dim, dtype))
    return emb


class TokPos(nn.Module):
    """Scaled token embedding + position embedding, gelu: one fused group of two lookups."""

    def __init__(self, dtype=torch.float32, **tok_kwargs):
        super().__init__()
        self.tok = _embedding(V, D, dtype, **tok_kwargs)
        self.pos = _embedding(P, D, dtype)

    def forward(self, ids):
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return F.gelu(self.tok(ids) * 1.5 + self.pos(positions))


def chain(ids, table):
    return F.gelu(F.embedding(ids, table) * 1.5) + 0.25


def _compile(fn, **options):
    return torch.compile(fn, backend="infinifuse", options=options)


# ======================================================================================
# 1. Bad inputs
# ======================================================================================


@pytest.mark.parametrize("bad", [V, -1, -V - 1], ids=["N", "-1", "-N-1"])
@pytest.mark.parametrize("when", ["first-call", "later-call"])
def test_out_of_range_index_raises_index_error_like_eager(bad, when):
    torch.manual_seed(0)
    table = rand_table(V, D)
    good = rand_ids(V, (2, 5))
    bad_ids = good.clone()
    bad_ids[1, 3] = bad
    with pytest.raises(IndexError) as eager_error:
        eager(chain, bad_ids, table)
    compiled = _compile(chain)
    with torch.no_grad():
        if when == "later-call":
            compiled(good, table)  # the signature is cached in "fusion"
        with pytest.raises(type(eager_error.value)) as error:
            compiled(bad_ids, table)
        message = str(error.value)
        assert "index out of range" in message, message
        if when == "later-call":  # the fused kernel's own check: value, range and table
            assert f"embedding index {bad} is outside [0, {V})" in message, message
            assert f"table of shape {(V, D)}" in message, message
        # The error leaves nothing behind: the next valid call runs fused and is right.
        out = compiled(good, table)
    assert_close(out, eager(chain, good, table))
    assert runtime_modes() == ["fusion"], str(fusebackend.last_report())


def test_out_of_range_index_on_a_first_call_is_not_reported_as_a_fusion_fallback(caplog):
    # The input is wrong, not the kernel: eager raises the same IndexError. Counting and
    # logging it as "fusion -> eager" tells the user to look at the backend, and runs the
    # graph a second time for nothing.
    table = rand_table(V, D)
    ids = rand_ids(V, (2, 5))
    ids[0, 0] = V
    compiled = _compile(chain)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(IndexError):
            compiled(ids, table)
    assert backend_warnings(caplog) == []
    assert fusebackend.stats()["fusion_fallbacks"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.int16], ids=str)
def test_non_integer_index_dtypes_raise_like_eager(dtype):
    # Dynamo's fake-tensor run raises before the backend sees the graph; its error is a
    # subclass of eager's RuntimeError and names the argument, the expected and given dtype.
    table = rand_table(V, D)
    ids = rand_ids(V, (2, 3)).to(dtype)
    with pytest.raises(RuntimeError) as eager_error:
        eager(chain, ids, table)
    with torch.no_grad(), pytest.raises(type(eager_error.value)) as error:
        _compile(chain)(ids, table)
    message = str(error.value)
    assert "'indices'" in message and "Long, Int" in message, message
    assert str(dtype) in message, message


INDEX_LAYOUTS = {
    "transposed": lambda: rand_ids(V, (5, 3)).t(),
    "expanded": lambda: rand_ids(V, (1, 4)).expand(3, 4),
    "offset": lambda: rand_ids(V, (4, 5), torch.int32)[1:],
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", list(INDEX_LAYOUTS))
def test_index_layouts_fuse_and_match_eager(layout, path, request):
    # Each call gets fresh ids of the same layout: the second is a cache hit (a replay on
    # the captured path, through the static input buffer).
    torch.manual_seed(1)
    model = TokPos()
    compiled = torch.compile(model, backend="infinifuse", options=_options(path, request))
    for _ in range(2):
        ids = INDEX_LAYOUTS[layout]()
        assert layout != "offset" or ids.storage_offset() > 0
        with torch.no_grad():
            out = compiled(ids)
        assert_close(out, eager(model, ids))
    assert_fused(fusebackend.last_report())
    assert fusebackend.stats()["cache_hits"] == 1


WEIGHTS = {
    "transposed": lambda dt: rand_table(D, V, dt).t(),
    "row-strided": lambda dt: rand_table(2 * V, D, dt)[::2],
    "column-slice": lambda dt: rand_table(V, D + 3, dt)[:, 2 : D + 2],
    "N=1": lambda dt: rand_table(1, D, dt),
    "D=1": lambda dt: rand_table(V, 1, dt),
    "D=20": lambda dt: rand_table(V, 20, dt),  # not a multiple of 16
}


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str
)
@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_weight_layouts_and_sizes_fuse_with_their_strides(kind, dtype):
    torch.manual_seed(2)
    table = WEIGHTS[kind](dtype)
    ids = rand_ids(table.shape[0], (3, 4), torch.int32)
    expected = eager(chain, ids, table)
    out, report = run_fused(chain, ids, table)
    assert_close(out, expected)
    assert out.dtype == dtype


EMBEDDING_KWARGS = {
    "padding_idx=None": {},
    "padding_idx=0": {"padding_idx": 0},
    "padding_idx=-1": {"padding_idx": -1},
    "padding_idx=N-1": {"padding_idx": V - 1},
    "max_norm-p1": {"max_norm": 1.0, "norm_type": 1.0},
    "max_norm-p2": {"max_norm": 1.0, "norm_type": 2.0},
    "max_norm-pinf": {"max_norm": 1.0, "norm_type": float("inf")},
    "scale_grad_by_freq": {"scale_grad_by_freq": True},
    "sparse": {"sparse": True},
}


@pytest.mark.parametrize("name", list(EMBEDDING_KWARGS))
def test_embedding_arguments_forward_and_backward_equal_eager(name):
    kwargs = EMBEDDING_KWARGS[name]
    torch.manual_seed(3)
    model = TokPos(**kwargs)
    with torch.no_grad():
        model.tok.weight.mul_(3.0)  # every row's norm is above max_norm
    reference = copy.deepcopy(model)
    ids = rand_ids(V, (3, 6))
    ids[0, :4] = torch.tensor([0, 0, V - 1, V - 1])  # padding rows, repeated ids

    # Forward (inference): fused, except max_norm, which is rejected with its reason.
    expected = eager(reference, ids)
    out, report = run_fused(model, ids, expect_fused="max_norm" not in kwargs)
    assert_close(out, expected)
    assert_close(model.tok.weight, reference.tok.weight)  # max_norm renormalised in place
    if "max_norm" in kwargs:  # the tok lookup is rejected; pos and the chain still fuse
        assert any("max_norm mutates the weight" in r.reason for r in report.rejections)
        assert [g.lookups for g in report.groups] == [("embedding_1",)], str(report)

    # Backward: aot_autograd, unfused; every gradient equals eager's.
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="infinifuse")
    out = compiled(ids)
    expected = reference(ids)
    assert_close(out, expected)
    weights = torch.linspace(-1, 1, D)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    assert fusebackend.last_report().graphs[0].path.startswith("unfused (gradients needed")
    for (pname, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None, pname
        assert param.grad.layout == ref.grad.layout, pname
        assert_close(param.grad.to_dense(), ref.grad.to_dense())
    if "padding_idx" in kwargs:
        assert (model.tok.weight.grad.to_dense()[kwargs["padding_idx"]] == 0).all()


@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf")], ids=["p1", "p2", "pinf"])
def test_max_norm_on_the_captured_path_renormalises_like_eager(norm_type, fake_capture):
    # The lookup renormalises the weight in place; warm-up, capture and replays must leave
    # the weight as eager's calls do, and each call must see the rows renormalised so far.
    torch.manual_seed(13)
    model = TokPos(max_norm=1.0, norm_type=norm_type)
    with torch.no_grad():
        model.tok.weight.mul_(3.0)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": True})
    with torch.no_grad():
        for _ in range(3):
            ids = rand_ids(V, (2, 4))
            assert_close(compiled(ids), reference(ids))
            assert_close(model.tok.weight, reference.tok.weight)
    assert fusebackend.stats()["recordings"] == 1
    assert set(fusebackend.stats()["fusion_modes"].values()) == {"fusion"}  # pos's group


def test_float_attribute_under_dynamic_true_is_fused_or_reported():
    # With dynamic=True Dynamo does not specialise float attributes (specialize_float is
    # off): ``self.scale`` reaches the graph as a symbolic scalar. The chain must then be
    # correct and, if it is not fused, say why.
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = _embedding(V, D)
            self.scale = D**0.5

        def forward(self, ids):
            return self.tok(ids) * self.scale + 1.0

    model = Scaled()
    compiled = torch.compile(model, backend="infinifuse", dynamic=True)
    with torch.no_grad():
        for batch in (2, 3):
            ids = rand_ids(V, (batch, 5))
            assert_close(compiled(ids), eager(model, ids))
    report = fusebackend.last_report()
    if not report.groups:
        assert any("symbolic scalar" in r.reason for r in report.rejections), str(report)


TINY = {  # subnormal magnitudes of each dtype (bf16 has fp32's exponent range)
    torch.float32: 1e-39,
    torch.float16: 1e-6,
    torch.bfloat16: 1e-39,
    torch.float64: 1e-310,
}


@pytest.mark.parametrize("dtype", list(TINY), ids=str)
def test_denormals_flow_through_fused_chains_unflushed(dtype):
    # Scaling by powers of two and adding equal values is exact for subnormals, so eager and
    # the kernel agree bit for bit unless one side flushes subnormals to zero.
    if dtype == torch.bfloat16 and launch.interpreter_enabled():
        pytest.skip(
            "Triton's interpreter (3.6 and 3.7) converts bf16 subnormals to fp32 wrongly (a plain "
            "gather of 1.01e-39 reads 5.88e-39: interpreter.py _convert_float); the GPU "
            "test test_reliability_gpu.py covers bf16"
        )
    torch.manual_seed(4)
    table = (rand_table(V, D, torch.float64) * TINY[dtype]).to(dtype)
    assert (table != 0).all() and (table.abs() < torch.finfo(dtype).tiny).all()

    def fn(ids, table):
        x = F.embedding(ids, table)
        y = (x * 4.0) * 0.25 + x
        return torch.where(x > 0, y, -y) * 0.5, y

    ids = rand_ids(V, (3, 5))
    expected = eager(fn, ids, table)
    out, _ = run_fused(fn, ids, table)
    for actual, exp in zip(out, expected):
        assert (exp != 0).all()
        torch.testing.assert_close(actual, exp, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_nan_and_inf_through_a_two_table_chain(dtype):
    # test_ops_table covers NaN/Inf per op in fp32/fp16; this runs them through two lookups
    # and a chain in the other two dtypes.
    torch.manual_seed(5)
    tok, pos = rand_table(V, D, dtype), rand_table(P, D, dtype)
    tok[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    pos[1, 3] = float("nan")
    pos[2, 4] = float("-inf")

    def fn(ids, tok, pos):
        x = F.embedding(ids, tok) * 1.5 + F.embedding(torch.arange(ids.shape[-1]), pos)
        return torch.sigmoid(x) * x.clamp(-4.0, 4.0), x - 1.0

    ids = rand_ids(V, (2, 5))
    ids[0, 0] = 0
    expected = eager(fn, ids, tok, pos)
    assert expected[1].isnan().any() and expected[1].isinf().any()
    out, _ = run_fused(fn, ids, tok, pos)
    assert_close(out, expected, equal_nan=True)


class ScaledTokPos(nn.Module):
    """Token embedding * 2 + position embedding: no activation, so a NaN row stays NaN and an
    infinite row keeps its sign through the chain."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.tok = _embedding(V, D, dtype)
        self.pos = _embedding(P, D, dtype)

    def forward(self, ids):
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.tok(ids) * 2.0 + self.pos(positions)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_nan_and_inf_rows_pass_first_run_validation(path, dtype, request):
    # First-run validation must treat NaN as NaN and inf as inf of the same sign, or a
    # table holding a NaN row drops its signature to eager though fused equals eager.
    torch.manual_seed(8)
    model = ScaledTokPos(dtype)
    with torch.no_grad():
        model.tok.weight[1] = float("nan")
        model.tok.weight[2] = float("inf")
        model.tok.weight[3] = -float("inf")
    compiled = torch.compile(model, backend="infinifuse", options=_options(path, request))
    ids = rand_ids(V, (2, 7))
    ids[0, :3] = torch.tensor([1, 2, 3])
    with torch.no_grad():
        expected = model(ids)
        out = compiled(ids)
        again = compiled(ids)
    assert expected.isnan().any() and (expected == float("inf")).any()
    assert (expected == -float("inf")).any()
    assert_close(out, expected, equal_nan=True)
    assert_close(again, expected, equal_nan=True)
    assert torch.equal(out.isnan(), expected.isnan())
    assert runtime_modes() == ["fusion"], str(fusebackend.last_report())
    assert fusebackend.stats()["fusion_successes"] == 1


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("change", ["in-place", ".data", "reassigned"])
def test_results_follow_a_changed_weight(change, path, request):
    torch.manual_seed(6)
    model = TokPos()
    compiled = torch.compile(model, backend="infinifuse", options=_options(path, request))
    ids = rand_ids(V, (2, 5))
    with torch.no_grad():
        compiled(ids)
        compiled(ids)  # a hit: replayed on the captured path
        if change == "in-place":
            model.tok.weight.mul_(-2.0)
        elif change == ".data":
            model.tok.weight.data = rand_table(V, D)
        else:
            model.tok.weight = nn.Parameter(rand_table(V, D), requires_grad=False)
        for _ in range(2):
            ids = rand_ids(V, (2, 5))
            assert_close(compiled(ids), eager(model, ids))
    assert_fused(fusebackend.last_report())
    if path == "captured" and change == ".data":
        assert fusebackend.stats()["rerecords"] == 1


# ======================================================================================
# 2. Injected faults: each ends in the documented fallback, with its reason, and the next
#    call works.
# ======================================================================================


def _run_with_fault(path, request, *, options=None, calls=3):
    """Compile TokPos, make ``calls`` calls with fresh ids; return (model, report text)."""
    torch.manual_seed(7)
    model = TokPos()
    compiled = torch.compile(
        model, backend="infinifuse", options=_options(path, request, **(options or {}))
    )
    with torch.no_grad():
        for _ in range(calls):
            ids = rand_ids(V, (3, 4))
            assert_close(compiled(ids), eager(model, ids))
    return model, str(fusebackend.last_report())


def _expect_fallback(path: str, text: str, *parts: str) -> str:
    mode = "graph_replay" if path == "captured" else "eager"
    assert runtime_modes() == [mode], text
    reason = one_fallback_reason()
    assert reason.startswith(f"fusion -> {mode}"), reason
    for part in parts:
        assert part in reason, reason
        assert part in text, text  # the report shows the signature's mode and reason
    assert f"mode {mode} (fusion -> {mode}" in text, text
    s = fusebackend.stats()
    assert (s["fusion_attempts"], s["fusion_fallbacks"], s["fusion_successes"]) == (1, 1, 0)
    return reason


@pytest.mark.fusion_failure_expected
@pytest.mark.parametrize("path", PATHS)
def test_a_fusion_pass_that_raises_leaves_the_graph_unfused(path, request, monkeypatch, caplog):
    # A pass's bug must not fail the user's compile (timm's EVA-02 did, 2026-11-30): the
    # graph runs as traced (captured on the captured path) and the report names the pass.
    from fusebackend import fusion

    def broken(c):
        raise RuntimeError("planted pass failure")

    planted = [dataclasses.replace(p, run=broken) if p.name == "fold_parameter_work" else p
               for p in fusion.FUSE]  # fmt: skip
    monkeypatch.setattr(fusion, "FUSE", planted)
    with caplog.at_level(logging.WARNING, logger="fusebackend"):
        _, text = _run_with_fault(path, request)
    expected = "fusion failed in fold_parameter_work: RuntimeError: planted pass failure"
    assert expected in fusebackend.last_report().graphs[-1].path, text
    assert "planted pass failure" in caplog.text
    assert fusebackend.last_report().graphs[-1].groups == [], text
    if path == "captured":
        assert fusebackend.stats()["recordings"] == 1


@pytest.mark.fusion_failure_expected
def test_a_preparation_pass_that_raises_halfway_runs_the_graph_as_traced(monkeypatch, caplog):
    # The PREPARE passes rewrite Dynamo's graph in place: one that raises after changing it
    # must leave the traced graph to run, not its half-rewritten state.
    def broken(c):
        for node in list(c.gm.graph.nodes):  # a half-done rewrite: every add made a sub
            if node.target is operator.add or node.target is torch.add:
                node.target = operator.sub
        c.gm.recompile()
        raise RuntimeError("planted preparation failure")

    planted = [dataclasses.replace(p, run=broken) if p.name == "fold_constants" else p
               for p in fusebackend.backend.PREPARE]  # fmt: skip
    monkeypatch.setattr(fusebackend.backend, "PREPARE", planted)
    torch.manual_seed(8)
    model = TokPos()
    compiled = torch.compile(model, backend="infinifuse")
    with caplog.at_level(logging.WARNING, logger="fusebackend"), torch.no_grad():
        for _ in range(3):
            ids = rand_ids(V, (3, 4))
            assert_close(compiled(ids), eager(model, ids))
    path = fusebackend.last_report().graphs[-1].path
    assert path.startswith("eager (preparation failed in fold_constants: RuntimeError: "
                           "planted preparation failure"), path  # fmt: skip
    assert "planted preparation failure" in caplog.text


@pytest.mark.parametrize("path", PATHS)
def test_triton_compile_error_falls_back(path, request, monkeypatch):
    from triton.compiler.errors import CompilationError

    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise CompilationError("def k():\n    tl.bad()", None, "injected: unsupported op")

    monkeypatch.setattr(launch, "_compiled_kernel", broken)
    _, text = _run_with_fault(path, request)
    _expect_fallback(path, text, "fused graph raised CompilationError", "injected: unsupported op")
    assert len(calls) == 1  # never retried for the cached signature


@pytest.mark.parametrize("path", PATHS)
def test_kernel_launch_error_falls_back(path, request, monkeypatch):
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    monkeypatch.setattr(fusebackend.row_ops, "row_kernel", broken)
    _, text = _run_with_fault(path, request)
    _expect_fallback(path, text, "fused graph raised RuntimeError", "illegal memory access")
    assert len(calls) == 1
    if path == "captured":  # the unfused graph was captured and replayed
        assert fusebackend.stats()["recordings"] == 1


def test_kernel_launch_error_on_a_later_call_falls_back(monkeypatch):
    # A fused signature that worked can fail later (on a GPU without CUDA graphs a new
    # input alignment makes Triton compile a new binary). The README promises that a
    # failing fused kernel falls back to the unfused graph, not that the error escapes.
    real = fusebackend.row_ops.row_kernel
    failing = [False]

    def flaky(*args, **kwargs):
        if failing[0]:
            raise RuntimeError("CUDA error: launch failure (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(fusebackend.row_ops, "row_kernel", flaky)
    torch.manual_seed(8)
    model = TokPos()
    compiled = _compile(model)
    with torch.no_grad():
        ids = rand_ids(V, (3, 4))
        compiled(ids)
        failing[0] = True
        for _ in range(2):
            ids = rand_ids(V, (3, 4))
            assert_close(compiled(ids), eager(model, ids))
    assert runtime_modes() == ["eager"]
    assert "launch failure (injected)" in one_fallback_reason()


@pytest.mark.parametrize("path", PATHS)
def test_wrong_fused_kernel_is_caught_by_first_run_validation(path, request, monkeypatch):
    real = fusebackend.backend.FusedGroupOp.__call__
    calls = []

    def wrong(self, *inputs):
        calls.append(1)
        return tuple(out * 1.01 + 0.01 for out in real(self, *inputs))

    monkeypatch.setattr(fusebackend.backend.FusedGroupOp, "__call__", wrong)
    _, text = _run_with_fault(path, request, options={"validate": True})
    _expect_fallback(path, text, "fused graph does not match the unfused graph")
    assert len(calls) == 1


class Counter(nn.Module):
    """TokPos that also counts its calls in a buffer (a mutated input of the graph)."""

    def __init__(self):
        super().__init__()
        self.inner = TokPos()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, ids):
        self.calls.add_(1)
        return self.inner(ids)


class KeepsLast(nn.Module):
    """TokPos that keeps its last output in a buffer and counts its calls in another: two
    inputs written in place, one of them from the fused group's values."""

    def __init__(self):
        super().__init__()
        self.inner = TokPos()
        self.register_buffer("last", torch.zeros(3, 4, D))
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, ids):
        out = self.inner(ids)
        self.last.copy_(out)
        self.calls.add_(1)
        return out


@pytest.mark.parametrize("path", PATHS)
def test_validation_mismatch_restores_written_input(path, request, monkeypatch):
    # The fused run wrote its wrong values into its copy of the buffer: on a mismatch the
    # unfused run's writes are the ones kept, and the counter advances once per call, not
    # once per run (the fused and the reference run each ran it)
    real = fusebackend.backend.FusedGroupOp.__call__

    def wrong(self, *inputs):
        return tuple(out * 1.01 + 0.01 for out in real(self, *inputs))

    monkeypatch.setattr(fusebackend.backend.FusedGroupOp, "__call__", wrong)
    torch.manual_seed(12)
    model = KeepsLast()
    options = _options(path, request, validate=True)
    compiled = torch.compile(model, backend="infinifuse", options=options)
    with torch.no_grad():
        for n in range(1, 4):
            ids = rand_ids(V, (3, 4))
            expected = eager(model.inner, ids)
            assert_close(compiled(ids), expected)
            torch.testing.assert_close(model.last, expected, rtol=0, atol=0)
            assert model.calls.item() == n
    _expect_fallback(path, str(fusebackend.last_report()), "does not match the unfused graph")


@pytest.mark.parametrize("which", ["fused", "both"])
def test_capture_failing_halfway_falls_back(which, fake_capture):
    # The capture runs the graph partway (the mutated buffer is written) and then fails.
    def fail(fn, inputs):
        if which == "both" or is_fused_graph(fn):
            fn(*inputs)
            raise cap.CaptureError("capture ended with RuntimeError: invalidated (injected)")

    fake_capture.fail = fail
    torch.manual_seed(9)
    model = Counter()
    compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": True})
    with torch.no_grad():
        for n in range(1, 4):
            ids = rand_ids(V, (3, 4))
            assert_close(compiled(ids), eager(model.inner, ids))
            assert model.calls.item() == n  # warm-up and failed captures left no trace
    mode = "graph_replay" if which == "fused" else "eager"
    assert runtime_modes() == [mode]
    reason = one_fallback_reason()
    assert "fusion -> graph_replay: capture failed: CaptureError" in reason, reason
    assert "invalidated (injected)" in reason
    assert (which == "both") == ("graph_replay -> eager" in reason)
    s = fusebackend.stats()
    assert s["capture_failures"] == (1 if which == "fused" else 2)
    assert s["recordings"] == (1 if which == "fused" else 0)
    assert len(fake_capture.attempts) == 2  # never retried
    assert f"mode {mode} (fusion -> graph_replay" in str(fusebackend.last_report())


def test_out_of_memory_during_capture_falls_back(fake_capture, request):
    def oom(fn, inputs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    fake_capture.fail = oom
    _, text = _run_with_fault("captured", request)
    assert runtime_modes() == ["eager"], text
    reason = one_fallback_reason()
    assert "capture failed: OutOfMemoryError" in reason and "2.00 GiB" in reason, reason
    assert "graph_replay -> eager" in reason
    assert fusebackend.stats()["capture_failures"] == 2
    assert len(fake_capture.attempts) == 2
    assert fake_capture.live() == 0


def _many_shapes(compiled, table, count: int) -> None:
    with torch.no_grad():
        for n in range(2, 2 + count):
            ids = rand_ids(V, (n,))
            assert_close(compiled(ids, table), eager(chain, ids, table))


@pytest.fixture
def reference_groups(monkeypatch):
    # The 300-shape tests are about the cache, not the kernel: the graph is rewritten as
    # usual, but each fused group runs its torch reference instead of ~10 ms interpreted
    # launches. (Patching triton_usable instead now leaves the graph unrewritten.)
    def run_reference(self, *inputs):
        return tuple(self.reference(*inputs))

    monkeypatch.setattr(fusebackend.backend.FusedGroupOp, "__call__", run_reference)


def test_300_shapes_keep_the_cache_bounded_and_warn_at_most_once(
    fake_capture, reference_groups, caplog
):
    table = rand_table(V, D)
    compiled = torch.compile(
        chain, backend="infinifuse", dynamic=True,
        options={"cudagraphs": True, "max_graphs": 4, "capture_on_call": 1},
    )  # fmt: skip
    with (
        warnings.catch_warnings(record=True) as caught,
        caplog.at_level(logging.INFO, logger=LOGGER),
    ):
        warnings.simplefilter("always")
        _many_shapes(compiled, table, 300)
    (graph,) = fusebackend.last_report().graphs  # one dynamic-shape graph
    assert graph.path == "fused"
    s = fusebackend.stats()
    assert s["cache_size"] == 4
    assert (s["cache_misses"], s["recordings"], s["evictions"]) == (300, 300, 296)
    assert fake_capture.live() <= 4  # evicted graphs and their buffers are freed
    assert set(s["fusion_modes"].values()) == {"fusion"}
    assert len(backend_warnings(caplog)) <= 1, backend_warnings(caplog)
    assert [w for w in caught if "fusebackend" in str(w.filename)] == []


def test_a_fault_on_every_shape_is_logged_once_not_300_times(
    fake_capture, reference_groups, caplog
):
    fake_capture.fail = lambda fn, inputs: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory (injected)")
    )
    table = rand_table(V, D)
    compiled = torch.compile(
        chain, backend="infinifuse", dynamic=True,
        options={"cudagraphs": True, "max_graphs": 4, "capture_on_call": 1},
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _many_shapes(compiled, table, 300)
    s = fusebackend.stats()
    assert s["cache_size"] == 4
    assert s["capture_failures"] == 600  # fused and unfused capture of each shape
    assert set(s["fusion_modes"].values()) == {"eager"}
    assert all(c.table.verdict_count <= graph_cache._MAX_VERDICTS for c in counters.live_caches())
    assert len(backend_warnings(caplog)) <= 1, (
        f"{len(backend_warnings(caplog))} warnings, first: "
        + (backend_warnings(caplog)[:1] or [""])[0]
    )


def test_random_op_in_the_graph_does_not_fail_validation(caplog):
    # Dropout (training=True, under no_grad) is not fused but runs in both the fused and the
    # reference graph of the first-run validation. Each run draws its own mask, so the
    # outputs differ, the signature falls back for nothing, and the call consumes the RNG
    # twice: with the same seed the compiled model's mask differs from eager's.
    def fn(ids, table):
        return F.dropout(F.embedding(ids, table) * 2.0, p=0.5, training=True) + 1.0

    table = rand_table(V, D)
    ids = rand_ids(V, (3, 4))
    compiled = _compile(fn)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=LOGGER):
        torch.manual_seed(10)
        expected, after_eager = fn(ids, table), torch.rand(3)
        torch.manual_seed(10)
        out, after_compiled = compiled(ids, table), torch.rand(3)
    assert_close(out, expected)
    assert_close(after_compiled, after_eager)  # the RNG advanced as in eager
    assert runtime_modes() == ["fusion"], str(fusebackend.last_report())
    assert backend_warnings(caplog) == []


# ======================================================================================
# 3. Never stale: an output kept from call 1 still equals eager's after later calls.
# ======================================================================================


@pytest.mark.parametrize("buckets", [None, (4, 8)], ids=["no-buckets", "buckets"])
@pytest.mark.parametrize("path", PATHS)
def test_kept_output_is_never_overwritten(path, buckets, request):
    torch.manual_seed(11)
    model = TokPos()
    options = _options(path, request, batch_buckets=buckets)
    # dynamic=True: one graph for every batch size (static shapes would compile, and
    # capture, one graph per batch size, whatever the buckets).
    compiled = torch.compile(model, backend="infinifuse", dynamic=True, options=options)
    first = rand_ids(V, (3, 5))
    expected_first = eager(model, first)
    with torch.no_grad():
        kept = compiled(first)
        for batch in (3, 3, 2, 4, 5):  # same signature, same bucket, other buckets
            ids = rand_ids(V, (batch, 5))
            assert_close(compiled(ids), eager(model, ids))
    assert_close(kept, expected_first)
    assert_fused(fusebackend.last_report())
    if path == "captured" and buckets:
        assert fusebackend.stats()["recordings"] == 2  # batches 2-4 share bucket 4


# ======================================================================================
# 5. Memory
# ======================================================================================


def test_clear_cache_and_dynamo_reset_free_every_graph(fake_capture):
    model = TokPos()
    options = {"cudagraphs": True, "capture_on_call": 1}
    compiled = torch.compile(model, backend="infinifuse", options=options)
    with torch.no_grad():
        for batch in (1, 2, 3):
            compiled(rand_ids(V, (batch, 4)))
    assert fake_capture.live() == 3
    fusebackend.clear_cache()
    torch._dynamo.reset()
    assert fake_capture.live() == 0
    s = fusebackend.stats()
    assert s["cache_size"] == 0 and s["graph_pool_bytes"] == 0


def test_dropping_a_compiled_model_frees_its_graphs():
    # Without clear_cache: once Dynamo forgets the compiled code, nothing of the backend
    # should keep its captured graphs (and their static buffers and pool memory) alive.
    model = TokPos()
    capture = Capture()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fusebackend.backend, "_graph_device", lambda inputs: FAKE_CUDA)
        mp.setattr(cap, "capture_graph", capture)
        options = {"cudagraphs": True, "capture_on_call": 1}
        compiled = torch.compile(model, backend="infinifuse", options=options)
        with torch.no_grad():
            compiled(rand_ids(V, (2, 4)))
    assert capture.live() == 1
    del compiled
    torch._dynamo.reset()
    assert capture.live() == 0, "a dead compiled graph's CUDA graphs are still alive"
    assert fusebackend.stats()["cache_size"] == 0


# ======================================================================================
# 6. Threads
# ======================================================================================


@pytest.mark.parametrize("path", PATHS)
def test_two_threads_different_shapes_through_torch_compile(path, request, monkeypatch):
    # Triton's interpreter patches triton.language globally while a kernel runs, so two
    # interpreted launches must not overlap (a GPU has no such limit); launches are
    # serialised here, everything else (Dynamo, guards, the cache) runs concurrently.
    real = fusebackend.row_ops.row_kernel
    interpreter = threading.Lock()

    def serialised(*args, **kwargs):
        with interpreter:
            return real(*args, **kwargs)

    monkeypatch.setattr(fusebackend.row_ops, "row_kernel", serialised)
    torch.manual_seed(12)
    model = TokPos()
    compiled = torch.compile(model, backend="infinifuse", options=_options(path, request))
    errors: list[str] = []
    start = threading.Barrier(2)

    def worker(batch: int) -> None:
        gen = torch.Generator().manual_seed(batch)
        start.wait()
        try:
            for i in range(12):
                b = batch if i % 2 else 2  # a private shape and one both threads share
                ids = torch.randint(0, V, (b, 5), generator=gen)
                with torch.no_grad():
                    out = compiled(ids)
                    expected = model(ids)
                if not torch.allclose(out, expected, rtol=1.3e-6, atol=1e-5):
                    errors.append(f"batch {b}, call {i}")
        except Exception as exc:  # an exception in a thread would otherwise be lost
            errors.append(f"batch {batch}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(b,)) for b in (3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    modes = fusebackend.stats()["fusion_modes"]
    assert modes and set(modes.values()) == {"fusion"}, modes
