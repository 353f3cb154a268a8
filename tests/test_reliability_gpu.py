"""Reliability on a CUDA GPU (pytest -m gpu): the rows of docs/RELIABILITY.md that need a
device: device-side asserts, device mismatches, real CUDA-graph capture under faults,
kept outputs against real replays and shared pools, pool memory, threads, subnormals and
mixed bf16/fp64 chains (which Triton's CPU interpreter cannot run), and the fuzz on CUDA.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    assert_close,
    backend_warnings,
    is_fused_graph,
    one_fallback_reason,
    rand_table,
    runtime_modes,
)
from test_fuzz import run_fuzz

import fusebackend
import fusebackend.backend
from fusebackend.kernels import launch
from fusebackend.runtime import capture as cap

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

V, P, D = 1000, 64, 96
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGGER = "fusebackend"


class TokPos(nn.Module):
    """Scaled token embedding + position embedding, gelu, as fp16 (one fused group)."""

    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D, dtype=dtype)
        self.pos = nn.Embedding(P, D, dtype=dtype)

    def forward(self, ids):
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return F.gelu(self.tok(ids) * 1.5 + self.pos(positions))


class MovesIds(TokPos):
    """TokPos that moves its ids to the weight's device inside forward, as models do."""

    def forward(self, ids):
        return super().forward(ids.to(self.tok.weight.device))


def _model(dtype=torch.float32) -> TokPos:
    return TokPos(dtype).cuda().eval()


def _ids(*shape, device="cuda"):
    return torch.randint(0, V, shape, device=device)


def _run_script(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=env)  # fmt: skip


# --- 4. device-side assert, through torch.compile --------------------------------------

ASSERT_SCRIPT = """
    import torch, torch.nn as nn, torch.nn.functional as F
    from fusebackend.backend import infinifuse
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(100, 64)
        def forward(self, ids):
            return F.gelu(self.tok(ids) * 2.0) + 1.0
    model = M().cuda().eval()
    compiled = torch.compile(model, backend=infinifuse, options={options})
    good = torch.randint(0, 100, (2, 8), device="cuda")
    bad = good.clone()
    bad[1, 5] = {bad}
    with torch.no_grad():
        if {warm}:
            compiled(good)
            torch.cuda.synchronize()
        out = compiled(bad)
        torch.cuda.synchronize()
    print("NO ERROR", out.float().sum().item())
"""


@pytest.mark.parametrize("bad", [100, -1])
@pytest.mark.parametrize(
    "when, options",
    [
        ("first-call", {}),  # fused first run, validated
        ("first-call", {"validate": False}),  # fused first run, then capture
        ("replay", {}),  # a captured fused graph replayed with a bad index
        ("direct", {"cudagraphs": False}),  # the fused kernel launched directly
    ],
)
def test_out_of_range_index_through_torch_compile_is_a_device_side_assert(when, options, bad):
    # A device-side assert poisons the CUDA context, so each case runs in its own process.
    code = ASSERT_SCRIPT.format(options=options, bad=bad, warm=when in ("replay", "direct"))
    proc = _run_script(code)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "NO ERROR" not in proc.stdout, output
    assert "device-side assert" in output or "index out of range" in output.lower(), output


# --- 1. device mismatches ----------------------------------------------------------------


def _fails_like_eager_naming(ids, table, *names):
    """Compiled ``embedding(ids, table) * 2`` raises eager's exception class, naming ``names``."""

    def fn(ids, table):
        return F.embedding(ids, table) * 2.0

    with torch.no_grad(), pytest.raises(RuntimeError) as eager_error:
        fn(ids, table)
    with torch.no_grad(), pytest.raises(type(eager_error.value)) as error:
        torch.compile(fn, backend="infinifuse")(ids, table)
    message = str(error.value)
    assert all(name in message for name in names), message


def test_cpu_indices_with_gpu_weights_fail_like_eager_naming_both_devices():
    # test_backend_gpu.py::test_model_without_the_move_fails_like_eager covers nn.Module;
    # here the table is a graph input.
    _fails_like_eager_naming(
        _ids(2, 9, device="cpu"), torch.randn(V, D, device="cuda"), "cpu", "cuda"
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_indices_on_another_gpu_fail_like_eager_naming_both_devices():
    table = torch.randn(V, D, device="cuda:0")
    _fails_like_eager_naming(_ids(2, 9, device="cuda:1"), table, "cuda:0", "cuda:1")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_model_on_the_second_gpu_fuses_and_captures_there():
    # The weight's device is the source of truth, whatever the current device is: kernels
    # launch and graphs are captured on cuda:1 while cuda:0 stays current.
    torch.manual_seed(11)
    model = MovesIds().to("cuda:1").eval()
    assert torch.cuda.current_device() == 0
    with torch.no_grad():
        compiled = torch.compile(model, backend="infinifuse")
        for device in ("cuda:1", "cpu", "cuda:1", "cpu"):
            ids = _ids(3, 11, device=device)
            out = compiled(ids)
            assert out.device == torch.device("cuda:1")
            assert_close(out, model(ids))
    stats = fusebackend.stats()
    assert set(stats["fusion_modes"].values()) == {"fusion"}, stats
    assert stats["recordings"] == 2, stats  # one per signature: ids on cuda:1, ids on the CPU
    assert fusebackend.last_report().groups[0].backend == "triton"


# --- 1. changed weights, subnormals, NaN/Inf, mixed dtypes ------------------------------


@pytest.mark.parametrize("change", ["in-place", ".data", "reassigned"])
def test_results_follow_a_changed_weight(change):
    model = _model()
    compiled = torch.compile(model, backend="infinifuse")
    ids = _ids(2, 7)
    with torch.no_grad():
        compiled(ids)
        compiled(ids)  # replayed
        if change == "in-place":
            model.tok.weight.mul_(-2.0)  # same address: the captured graph reads it
        elif change == ".data":
            model.tok.weight.data = torch.randn_like(model.tok.weight)
        else:
            model.tok.weight = nn.Parameter(torch.randn_like(model.tok.weight), False)
        for _ in range(2):
            ids = _ids(2, 7)
            torch.testing.assert_close(compiled(ids), model(ids))
    assert set(fusebackend.stats()["fusion_modes"].values()) == {"fusion"}


TINY = {torch.float32: 1e-39, torch.float16: 1e-6, torch.bfloat16: 1e-39, torch.float64: 1e-310}


@pytest.mark.parametrize("dtype", list(TINY), ids=str)
def test_denormals_flow_through_fused_chains_unflushed(dtype):
    # Exact for subnormals unless one side flushes them to zero (see test_reliability.py).
    table = (rand_table(V, 16, torch.float64) * TINY[dtype]).to(dtype).cuda()
    assert (table != 0).all()

    def fn(ids, table):
        x = F.embedding(ids, table)
        y = (x * 4.0) * 0.25 + x
        return torch.where(x > 0, y, -y) * 0.5, y

    ids = _ids(3, 5)
    with torch.no_grad():
        expected = fn(ids, table)
        actual = torch.compile(fn, backend="infinifuse", options={"validate": False})(ids, table)
    assert fusebackend.last_report().groups[0].backend == "triton"
    for a, e in zip(actual, expected):
        assert (e != 0).all()
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_nan_and_inf_through_a_two_table_chain(dtype):
    tok = rand_table(V, 16, dtype).cuda()
    pos = rand_table(P, 16, dtype).cuda()
    tok[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    pos[1, 3] = float("nan")

    def fn(ids, tok, pos):
        x = F.embedding(ids, tok) * 1.5 + F.embedding(
            torch.arange(ids.shape[-1], device="cuda"), pos
        )
        return torch.sigmoid(x) * x.clamp(-4.0, 4.0), x - 1.0

    ids = _ids(2, 5)
    ids[0, 0] = 0
    with torch.no_grad():
        expected = fn(ids, tok, pos)
        actual = torch.compile(fn, backend="infinifuse", options={"validate": False})(ids, tok, pos)
    assert expected[1].isnan().any() and expected[1].isinf().any()
    assert_close(actual, expected, equal_nan=True)
    assert runtime_modes() == ["fusion"]


def test_bf16_and_fp64_in_one_group():
    # The CPU suite cannot run this (the interpreter converts fp64 -> bf16 wrongly): a bf16
    # table, an fp64 operand, intermediates rounded to bf16 inside an fp64 computation.
    tok = rand_table(V, 16, torch.bfloat16).cuda()
    scale = rand_table(1, 16, torch.float64)[0].cuda()

    def fn(ids, tok, scale):
        x = torch.tanh(F.embedding(ids, tok))  # bf16, computed in fp64 and rounded
        return (x * scale).to(torch.bfloat16) + x, torch.erf(x.double())

    ids = _ids(3, 4)
    with torch.no_grad():
        expected = fn(ids, tok, scale)
        actual = torch.compile(fn, backend="infinifuse", options={"validate": False})(
            ids, tok, scale
        )
    assert_close(actual, expected, floor_dtype=torch.bfloat16)
    assert runtime_modes() == ["fusion"] and fusebackend.last_report().groups


# --- 2. faults on the real CUDA-graph path ----------------------------------------------


def test_out_of_memory_halfway_through_a_real_capture_falls_back(monkeypatch):
    # The fused graph raises OutOfMemoryError while it is being captured (after warm-up,
    # inside capture_begin/capture_end): the capture is cleaned up, the key falls back to
    # the captured unfused graph, and the device (stream, pool, RNG) stays usable.
    real_capture = cap.capture_graph

    def capture(fn, inputs, *, device, warmup_iterations):
        def body(*args):
            if torch.cuda.is_current_stream_capturing() and is_fused_graph(fn):
                raise torch.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate 4.00 GiB (injected)"
                )
            return fn(*args)

        return real_capture(body, inputs, device=device, warmup_iterations=warmup_iterations)

    monkeypatch.setattr(cap, "capture_graph", capture)
    model = _model()
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):
            ids = _ids(3, 11)
            torch.testing.assert_close(compiled(ids), model(ids))
    assert runtime_modes() == ["graph_replay"]
    reason = one_fallback_reason()
    assert "capture failed: OutOfMemoryError" in reason and "4.00 GiB" in reason, reason
    assert "mode graph_replay (fusion -> graph_replay" in str(fusebackend.last_report())
    s = fusebackend.stats()
    assert (s["capture_failures"], s["recordings"]) == (1, 1)
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randn(8, device="cuda")  # the RNG is not left "capturing"


def test_triton_compile_error_falls_back_to_graph_replay(monkeypatch):
    from triton.compiler.errors import CompilationError

    def broken(*args, **kwargs):
        raise CompilationError("def k():\n    tl.bad()", None, "injected: unsupported op")

    monkeypatch.setattr(launch, "_compiled_kernel", broken)
    model = _model()
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):
            ids = _ids(2, 7)
            torch.testing.assert_close(compiled(ids), model(ids))
    assert runtime_modes() == ["graph_replay"]
    assert "fused graph raised CompilationError" in one_fallback_reason()
    assert fusebackend.stats()["recordings"] == 1


def test_wrong_fused_kernel_is_caught_by_validation_on_the_gpu(monkeypatch):
    real = fusebackend.backend.FusedGroupOp.__call__

    def wrong(self, *inputs):
        return tuple(o * 1.01 + 0.01 for o in real(self, *inputs))

    monkeypatch.setattr(fusebackend.backend.FusedGroupOp, "__call__", wrong)
    model = _model()
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):
            ids = _ids(2, 7)
            torch.testing.assert_close(compiled(ids), model(ids))
    assert runtime_modes() == ["graph_replay"]
    assert "does not match the unfused graph" in one_fallback_reason()


# --- 3. never stale ------------------------------------------------------------------------


@pytest.mark.parametrize("buckets", [None, (4, 8)], ids=["no-buckets", "buckets"])
def test_kept_output_is_never_overwritten(buckets):
    # Graphs share one memory pool; an output kept from call 1 must survive replays of the
    # same graph, other buckets' captures and replays. test_backend_gpu.py covers one shape.
    model = _model()
    compiled = torch.compile(model, backend="infinifuse", dynamic=True,
                             options={"batch_buckets": buckets})  # fmt: skip
    first = _ids(3, 11)
    with torch.no_grad():
        expected_first = model(first)
        kept = compiled(first)
        for batch in (3, 3, 2, 4, 5, 7, 1, 3):
            ids = _ids(batch, 11)
            torch.testing.assert_close(compiled(ids), model(ids))
    torch.cuda.synchronize()
    torch.testing.assert_close(kept, expected_first)
    assert set(fusebackend.stats()["fusion_modes"].values()) == {"fusion"}


# --- 5. memory ------------------------------------------------------------------------------


def test_graph_pools_hold_no_live_blocks_after_clear_cache_and_dynamo_reset():
    model = _model()
    # Captured on each shape's first call (the default captures on the 2nd).
    compiled = torch.compile(model, backend="infinifuse", options={"capture_on_call": 1})
    with torch.no_grad():
        for batch in (1, 2, 4, 5):
            out = compiled(_ids(batch, 33))
    del out
    torch.cuda.synchronize()
    pools = set(cap._CAPTURE.pool_ids)
    assert pools and fusebackend.stats()["graph_pool_bytes"] > 0

    fusebackend.clear_cache()
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    live = [
        block
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", ())) in pools
        for block in segment["blocks"]
        if block["state"] != "inactive"
    ]
    assert live == []
    torch.cuda.empty_cache()
    assert not [
        s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) in pools
    ]
    assert fusebackend.stats()["graph_pool_bytes"] == 0


def test_dropping_a_compiled_model_returns_its_memory():
    # Without clear_cache; see test_reliability.py::test_dropping_a_compiled_model_frees_its_graphs
    model = _model()
    ids = [_ids(b, 33) for b in (1, 2, 4)]
    torch.cuda.synchronize()
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for x in ids:
            out = compiled(x)
    del out, compiled
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline


def test_300_shapes_keep_memory_bounded_and_warn_at_most_once(caplog):
    model = _model()
    compiled = torch.compile(model, backend="infinifuse", dynamic=True, options={"max_graphs": 4})
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    with (
        torch.no_grad(),
        caplog.at_level(logging.INFO, logger=LOGGER),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        for n in range(2, 302):
            out = compiled(_ids(n, 4))
    del out
    torch.cuda.synchronize()
    s = fusebackend.stats()
    assert s["cache_size"] == 4 and s["evictions"] == 296
    assert set(s["fusion_modes"].values()) == {"fusion"}
    # What 4 live entries of the largest shapes hold (static ids, graph outputs), twice over:
    # 296 evicted graphs left behind would hold about 70 MB.
    entry = 301 * 4 * (D * 4 + 8)
    grown = torch.cuda.memory_allocated() - baseline
    assert grown < 2 * 4 * entry + 2**20, grown
    assert s["graph_pool_bytes"] < 64 * 2**20, s["graph_pool_bytes"]
    assert len(backend_warnings(caplog)) <= 1, backend_warnings(caplog)[:3]
    assert [w for w in caught if "fusebackend" in str(w.filename)] == []


# --- 6. threads --------------------------------------------------------------------------------


def test_two_threads_different_shapes_through_torch_compile():
    model = _model()
    compiled = torch.compile(model, backend="infinifuse")
    errors: list[str] = []
    start = threading.Barrier(2)

    # Inputs are drawn before the threads start: the device's random generator is
    # process-wide, and while one thread captures a graph it is in capture mode, so a
    # torch.randint on the device from another thread raises "Offset increment outside
    # graph capture" (seen on an H200, torch 2.11). A torch limit of CUDA graphs, listed in
    # the README's known limits; the model itself draws no random numbers.
    inputs = {b: [_ids(b, 9) for _ in range(20)] for b in (2, 3, 5)}

    def worker(batch: int) -> None:
        start.wait()
        try:
            for i in range(40):
                b = batch if i % 2 else 2
                ids = inputs[b][i // 2]
                with torch.no_grad():
                    out = compiled(ids)
                    expected = model(ids)
                if not torch.allclose(out, expected, rtol=1.3e-6, atol=1e-5):
                    errors.append(f"batch {b}, call {i}")
        except Exception as exc:
            errors.append(f"batch {batch}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(b,)) for b in (3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert set(fusebackend.stats()["fusion_modes"].values()) == {"fusion"}


# --- 7. the fuzz on CUDA ---------------------------------------------------------------------


def test_fuzz_on_the_gpu():
    # Same cases as tests/test_fuzz.py, on the device, captured in CUDA graphs.
    run_fuzz(int(os.environ.get("FUSEBACKEND_FUZZ_CASES", "300")),
             int(os.environ.get("FUSEBACKEND_FUZZ_SEED", "0")))  # fmt: skip
