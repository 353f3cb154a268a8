"""Two groups of one kernel run by one launch (passes/pairing.py, launch.row_kernel_pair):
q's and k's rotary embeddings of different head counts, norms of different row counts, wide
(chunked) rows; equal to eager and to two launches; never paired across a use or a write."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import FLOAT_DTYPES, LaunchRecorder, as_triton_sees, assert_close, eager, run_fused
from test_row_rope_softmax import _rope_tolerance, rope_slices

import fusebackend
import fusebackend.backend
from fusebackend.kernels import KernelOptions, row_kernel, row_kernel_pair


def _rope_q_k(q, k, cos, sin):
    return rope_slices(q, cos, sin), rope_slices(k, cos, sin)


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _two_norms(x, y, w):
    return _rms(x, w), _rms(y, w)


def _rope_inputs(dtype, width, g, q_heads=5, k_heads=3, tokens=7):
    q = torch.randn(2, q_heads, tokens, width, generator=g).to(dtype)
    k = torch.randn(2, k_heads, tokens, width, generator=g).to(dtype)
    angles = torch.rand(tokens, width, generator=g) * 6.3
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _paired(report) -> list[tuple[str, str]]:
    return sorted({tuple(sorted((g.name, g.launched_with))) for g in report.groups
                   if g.launched_with})  # fmt: skip


@pytest.mark.parametrize("width", [2, 7, 64])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_q_and_k_rotary_embeddings_run_in_one_launch(dtype, width):
    args = _rope_inputs(dtype, width, torch.Generator().manual_seed(width))
    expected = eager(_rope_q_k, *args)
    actual, report = run_fused(_rope_q_k, *args, options={"cudagraphs": False})
    assert_close(actual, expected, **_rope_tolerance(dtype))
    assert len(report.groups) == 2 and _paired(report) == [("group0", "group1")], str(report)


def _programs(monkeypatch, fn, *args):
    """The RowPrograms of ``fn``'s fused groups, in order."""
    programs = []
    real = fusebackend.backend.FusedGroupOp.__init__

    def keep(self, program, *rest, **kwargs):
        programs.append(program)
        real(self, program, *rest, **kwargs)

    monkeypatch.setattr(fusebackend.backend.FusedGroupOp, "__init__", keep)
    run_fused(fn, *args, options={"cudagraphs": False})
    return programs


@pytest.mark.parametrize(
    ("rows_a", "rows_b", "width"),
    [(1, 37, 33), (13, 2, 128), (5, 3, 8200)],  # tile... persistent, chunked (> 8192)
    ids=["few-then-many", "many-then-few", "chunked"],
)
def test_a_pair_launch_equals_two_launches(monkeypatch, rows_a, rows_b, width):
    g = torch.Generator().manual_seed(rows_a * width)
    w = torch.randn(width, generator=g)
    x, y = torch.randn(3, width, generator=g), torch.randn(2, width, generator=g)
    (program, _) = _programs(monkeypatch, _two_norms, x, y, w)
    a = (torch.randn(rows_a, width, generator=g), w)
    b = (torch.randn(rows_b, width, generator=g), w)
    options = KernelOptions()
    expected = (*row_kernel(program, a, options=options), *row_kernel(program, b, options=options))
    actual = row_kernel_pair(program, a, b, options)
    assert_close(actual, expected, rtol=0, atol=0)
    assert_close(actual, (_rms(*a), _rms(*b)), rtol=1e-5, atol=1e-5)


def test_a_pair_of_other_widths_or_no_rows_gets_two_launches(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, generator=g)
    (program, _) = _programs(monkeypatch, _two_norms, torch.randn(3, 16), torch.randn(2, 16), w)
    empty, some = (torch.randn(0, 16), w), (torch.randn(4, 16, generator=g), w)
    actual = row_kernel_pair(program, empty, some, KernelOptions())
    assert actual[0].shape == (0, 16)
    assert_close(actual[1], _rms(*some), rtol=1e-5, atol=1e-5)


def test_kept_launches_are_reused_per_signature_with_each_call_s_tensors(monkeypatch):
    # A caller's ``plans`` keep a launch per (shapes, strides, dtypes): a later call of the
    # same signature builds nothing, yet reads its own tensors; another signature builds anew.
    from fusebackend.kernels import launch

    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, generator=g)
    (program, _) = _programs(monkeypatch, _two_norms, torch.randn(3, 40), torch.randn(2, 40), w)
    built = []
    real = launch._make_plans
    monkeypatch.setattr(launch, "_make_plans", lambda *a: built.append(1) or real(*a))
    single, pairs, options = {}, {}, KernelOptions()

    def check(a, b, builds):
        assert_close(row_kernel(program, a, options=options, plans=single), (_rms(*a),),
                     rtol=1e-5, atol=1e-5)  # fmt: skip
        assert_close(row_kernel_pair(program, a, b, options, pairs), (_rms(*a), _rms(*b)),
                     rtol=1e-5, atol=1e-5)  # fmt: skip
        assert len(built) == builds

    def rows(n):
        return (torch.randn(n, 40, generator=g), w)

    check(rows(3), rows(2), 2)
    check(rows(3), rows(2), 2)  # new data, same signature: kept launches
    transposed = (torch.randn(40, 3, generator=g).t(), w)  # same shape, other strides
    check(transposed, rows(2), 4)
    check(rows(5), rows(0), 6)  # other rows; a set without rows launches nothing
    check(rows(5), rows(0), 6)
    for n in range(1, 2 * launch._MAX_PLANS):  # dynamic shapes: the oldest launches go
        row_kernel(program, rows(n), options=options, plans=single)
    assert 0 < len(single) <= launch._MAX_PLANS


def _used_between(q, k, cos, sin, m):
    qr = rope_slices(q, cos, sin)
    scores = qr @ m  # reads q's result before k's group: q's launch cannot wait for k's
    return scores, rope_slices(k, cos, sin)


def _written_between(q, k, cos, sin, counter):
    qr = rope_slices(q, cos, sin)
    counter.add_(1)  # a write between the two groups: nothing moves across it
    return qr, rope_slices(k, cos, sin) + counter


@pytest.mark.parametrize("case", ["used", "written"])
def test_groups_are_not_paired_across_a_use_or_a_write(case):
    g = torch.Generator().manual_seed(3)
    q, k, cos, sin = _rope_inputs(torch.float32, 8, g)
    if case == "used":
        fn, extra = _used_between, torch.randn(8, 4, generator=g)
    else:
        fn, extra = _written_between, torch.tensor(2.0)
    expected = eager(fn, q, k, cos, sin, extra.clone())
    actual, report = run_fused(fn, q, k, cos, sin, extra, options={"cudagraphs": False})
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    rope = [g for g in report.groups if g.moves]
    assert len(rope) == 2 and _paired(report) == [], str(report)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_paired_rotary_embeddings_on_the_gpu_in_a_cuda_graph(dtype):
    # TinyLlama's heads: 32 for q, 4 for k, 64 wide; one token (decode) and 33 (prefill)
    for tokens in (1, 33):
        g = torch.Generator().manual_seed(tokens)
        args = [t.cuda() for t in _rope_inputs(dtype, 64, g, q_heads=32, k_heads=4,
                                              tokens=tokens)]  # fmt: skip
        expected = eager(_rope_q_k, *args)
        torch._dynamo.reset()
        compiled = torch.compile(_rope_q_k, backend="infinifuse")
        with torch.no_grad():
            for _ in range(3):  # capture, then replays
                actual = compiled(*args)
        assert_close(actual, expected, **_rope_tolerance(dtype))
        report = fusebackend.last_report()
        assert _paired(report) == [("group0", "group1")], str(report)
        modes = [e["mode"] for e in report.graphs[-1].runtime_modes()]
        assert modes == ["fusion"], modes


@pytest.mark.parametrize("paired", [False, True], ids=["group", "pair"])
def test_precompile_warms_the_kernel_the_launch_runs(monkeypatch, paired):
    # The warm-up must specialise as the launch does (same grid, options, ints; each tensor
    # as its dtype), or the launch compiles again and the concurrent compile was for nothing.
    from fusebackend.kernels import launch

    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, generator=g)
    (program, _) = _programs(monkeypatch, _two_norms, torch.randn(3, 48), torch.randn(2, 48), w)
    launches, warmups = [], []
    recorder = LaunchRecorder(launches, warmups)
    monkeypatch.setattr(launch, "_compiled_kernel", lambda *a, **k: recorder)
    a = [torch.randn(2, 7, 49, generator=g)[:, 1:, 1:], w]  # a view 200 bytes in: unaligned
    b = [torch.randn(3, 48, 5, generator=g).transpose(1, 2), w]  # columns not contiguous
    options = KernelOptions()
    if paired:
        launch.row_kernel_pair(program, a, b, options)
        job = functools.partial(launch.precompile, program, [*a, *b], options, len(a))
        assert launch.precompile_all([job]) == 0
    else:
        launch.row_kernel(program, a, options=options)
        assert (
            launch.precompile_all([functools.partial(launch.precompile, program, a, options)]) == 0
        )
    ((run_args, run_grid, run_meta),) = launches
    ((warm_args, warm_grid, warm_meta),) = warmups
    seen = as_triton_sees  # a pointer as Triton specialises on it: dtype, 16-byte alignment
    assert [seen(x) for x in warm_args] == [seen(x) for x in run_args]
    assert seen(run_args[0]) == (torch.float32, False)  # the unaligned view stays unaligned
    assert (warm_grid, warm_meta) == (run_grid, run_meta)


def test_an_interrupted_precompile_leaves_no_async_mode_behind(monkeypatch):
    # Triton's AsyncCompileMode switches itself off only after waiting on every compile;
    # an interrupt during the wait must not leave it on for later compiles.
    from triton.runtime import _async_compile

    from fusebackend.kernels import launch

    def interrupted_compile():
        def finalize(kernel):
            raise KeyboardInterrupt

        _async_compile.active_mode.get().submit("key", lambda: None, finalize)

    with pytest.raises(KeyboardInterrupt):
        launch.precompile_all([interrupted_compile])
    assert _async_compile.active_mode.get() is None


def test_a_precompile_that_fails_is_counted_and_left_to_the_launch(monkeypatch):
    from fusebackend.kernels import launch

    def broken():
        raise RuntimeError("no compiler")

    assert launch.precompile_all([broken, broken]) == 2


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _chained(x, y, z, cos, sin):
    # the second group reads the first's output: the rotation of a value computed in a
    # group ends that group, so one program runs twice, the second on the first's result
    first = _rotate_half(x) * sin + y * cos
    return _rotate_half(first) * sin + z * cos


def test_a_group_reading_its_twin_is_not_paired_with_it():
    g = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(2, 5, 8, generator=g) for _ in range(3))
    angles = torch.rand(5, 8, generator=g) * 6
    args = (x, y, z, angles.cos(), angles.sin())
    expected = eager(_chained, *args)
    actual, report = run_fused(_chained, *args, options={"cudagraphs": False})
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert len([g for g in report.groups if g.moves]) == 2 and _paired(report) == [], str(report)


def test_a_pair_reads_each_set_s_own_graph_number():
    # A norm's eps given as a graph input (dynamic shapes) is a scalar argument; a paired
    # launch takes one per set (a_in2, b_in2), each set normalised with its own.
    from fusebackend.kernels import InputRef, Instr, Reduce, RowProgram, ValueRef
    from fusebackend.kernels.launch import kernel_source
    from fusebackend.kernels.pair_source import generate_pair_source

    f32 = torch.float32
    program = RowProgram(
        input_dtypes=(f32, f32, f32),  # x, w, eps (a number)
        lookups=(),
        instrs=(
            Instr("mul", (InputRef(0), InputRef(0)), f32),
            Reduce("mean", ValueRef(0), f32),
            Instr("add", (ValueRef(1), InputRef(2)), f32),
            Instr("rsqrt", (ValueRef(2),), f32),
            Instr("mul", (InputRef(0), ValueRef(3)), f32),
            Instr("mul", (ValueRef(4), InputRef(1)), f32),
        ),  # fmt: skip
        outputs=(5,),
        scalar_inputs=frozenset({2}),
    )
    g = torch.Generator().manual_seed(15)
    w = torch.randn(24, generator=g)
    a, b = torch.randn(3, 5, 24, generator=g) * 0.1, torch.randn(2, 24, generator=g) * 0.1

    def rms(x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    assert "a number read at each call" in kernel_source(program, 1)[1]
    pair_source = generate_pair_source(program, 1, KernelOptions(), "persistent")[1]
    assert "a_in2: tl.float32," in pair_source and "b_in2: tl.float32," in pair_source
    plans: dict = {}
    for eps_a, eps_b in ((1e-6, 0.5), (2.0, 1e-3)):
        actual = row_kernel_pair(program, (a, w, eps_a), (b, w, eps_b), KernelOptions(), plans)
        assert_close(actual, (rms(a, eps_a), rms(b, eps_b)))
    (kept,) = [v for k, v in plans.items() if k != "shape recipes"]  # numbers: one signature
    assert len(kept.launches) == 1  # one paired launch
