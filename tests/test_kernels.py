"""The launcher ``fusebackend.kernels.row_kernel`` called directly with hand-written
RowPrograms: index dtypes and layouts, broadcast operands, odd widths, empty inputs, the
host-side bounds check and the masked gather behind it."""

from __future__ import annotations

import helpers
import pytest
import torch
import torch.nn.functional as F
from helpers import INDEX_DTYPES, assert_close, rand_ids, rand_table, run_fused, single_group
from hypothesis import given, settings
from hypothesis import strategies as st

import fusebackend.kernels.configs as configs
import fusebackend.kernels.launch as launch
from fusebackend.kernels import (
    Const,
    InputRef,
    Instr,
    KernelOptions,
    Lookup,
    RowProgram,
    ValueRef,
    kernel_source,
    row_kernel,
    triton_usable,
)

N = 29  # table rows


def test_interpreter_is_active():
    # Every test below runs the generated kernel, not a torch fallback.
    assert triton_usable(torch.device("cpu"))


def mul_add_spec(index_dtype, dtype, operand_dtype=None):
    """v0 = table[ids]; v1 = v0 * operand; v2 = v1 + 0.5  -> outputs (v2,)."""
    operand_dtype = operand_dtype or dtype
    return RowProgram(
        input_dtypes=(index_dtype, dtype, operand_dtype),
        lookups=(Lookup(index_slot=0, table_slot=1),),
        instrs=(
            Instr("mul", (ValueRef(0), InputRef(2)), dtype),
            Instr("add", (ValueRef(1), Const("0.5")), dtype),
        ),
        outputs=(2,),
    )


def mul_add_eager(ids, table, operand):
    return F.embedding(ids.long(), table) * operand + 0.5


def lookup_spec(index_dtype, dtype):
    return RowProgram((index_dtype, dtype), (Lookup(0, 1),), (), (0,))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dim", [1, 3, 127, 4097])
def test_lookup_only_odd_widths(dim, index_dtype):
    torch.manual_seed(dim)
    table = rand_table(N, dim)
    ids = rand_ids(N, (2, 3) if dim < 4097 else (3,), index_dtype)
    (out,) = row_kernel(lookup_spec(index_dtype, torch.float32), [ids, table])
    torch.testing.assert_close(out, F.embedding(ids, table), rtol=0, atol=0)
    assert out.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dim", [1, 3, 127, 4097])
def test_chain_odd_widths(dim, index_dtype, dtype):
    torch.manual_seed(dim + 1)
    table = rand_table(N, dim, dtype)
    operand = rand_table(1, dim, dtype)[0]
    ids = rand_ids(N, (2, 5) if dim < 4097 else (2,), index_dtype)
    (out,) = row_kernel(mul_add_spec(index_dtype, dtype), [ids, table, operand])
    assert_close(out, mul_add_eager(ids, table, operand))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize(
    "make_ids",
    [
        pytest.param(lambda d: rand_ids(N, (7, 3), d).t(), id="transposed"),
        pytest.param(lambda d: rand_ids(N, (4, 12), d)[1:, ::3], id="sliced"),
        pytest.param(lambda d: rand_ids(N, (3, 1), d).expand(3, 4), id="expanded"),
        pytest.param(lambda d: rand_ids(N, (2, 5, 6), d).permute(2, 0, 1)[::2], id="3d-perm"),
        pytest.param(lambda d: torch.tensor(11, dtype=d), id="0d"),
        pytest.param(lambda d: rand_ids(N, (2, 3, 2), d), id="3d"),
    ],
)
def test_index_layouts(make_ids, index_dtype):
    torch.manual_seed(3)
    ids = make_ids(index_dtype)
    table = rand_table(N, 10)
    operand = rand_table(1, 10)[0]
    (out,) = row_kernel(mul_add_spec(index_dtype, torch.float32), [ids, table, operand])
    expected = mul_add_eager(ids, table, operand)
    assert out.shape == expected.shape
    assert_close(out, expected)


@pytest.mark.parametrize(
    "make_operand",
    [
        pytest.param(lambda b, t, d: rand_table(1, d)[0], id="[D]"),
        pytest.param(lambda b, t, d: rand_table(1, d).reshape(1, 1, d), id="[1,1,D]"),
        pytest.param(lambda b, t, d: torch.tensor(1.75), id="0-d"),
        pytest.param(lambda b, t, d: rand_table(b, 1).reshape(b, 1, 1), id="[B,1,1]"),
        pytest.param(lambda b, t, d: rand_table(b * t, 1).reshape(b, t, 1), id="[B,T,1]"),
        pytest.param(lambda b, t, d: rand_table(b * t, d).reshape(b, t, d), id="[B,T,D]"),
        pytest.param(lambda b, t, d: rand_table(d, b * t).t().reshape(b, t, d), id="transposed"),
        pytest.param(
            lambda b, t, d: rand_table(b * t, 2 * d).reshape(b, t, 2 * d)[..., ::2], id="strided"
        ),  # fmt: skip
    ],
)
def test_broadcast_operands(make_operand):
    torch.manual_seed(4)
    b, t, d = 3, 4, 9
    table, ids = rand_table(N, d), rand_ids(N, (b, t))
    operand = make_operand(b, t, d)
    (out,) = row_kernel(mul_add_spec(torch.int64, torch.float32), [ids, table, operand])
    assert_close(out, mul_add_eager(ids, table, operand))


def test_operand_of_higher_rank_than_the_lookup():
    # ids [T] -> [T, D], operand [B, T, D]: the group (and output) takes the operand's shape.
    torch.manual_seed(5)
    table, ids, operand = rand_table(N, 6), rand_ids(N, (4,)), rand_table(8, 6).reshape(2, 4, 6)
    (out,) = row_kernel(mul_add_spec(torch.int64, torch.float32), [ids, table, operand])
    assert out.shape == (2, 4, 6)
    assert_close(out, mul_add_eager(ids, table, operand))


def test_width_one_table_broadcasts_against_a_row():
    # table [N, 1] gathered to [B, T, 1], times an operand [D]: output [B, T, D].
    torch.manual_seed(6)
    table, ids, operand = rand_table(N, 1), rand_ids(N, (2, 3)), rand_table(1, 8)[0]
    (out,) = row_kernel(mul_add_spec(torch.int64, torch.float32), [ids, table, operand])
    assert out.shape == (2, 3, 8)
    assert_close(out, mul_add_eager(ids, table, operand))


@pytest.mark.parametrize(
    "make_table",
    [
        pytest.param(lambda: rand_table(12, N).t(), id="transposed"),
        pytest.param(lambda: rand_table(N, 30)[:, 5:17], id="column-slice"),
        pytest.param(lambda: rand_table(2 * N, 12)[::2], id="row-stride"),
    ],
)
def test_non_contiguous_tables(make_table):
    torch.manual_seed(7)
    table = make_table()
    assert table.shape == (N, 12) and not table.is_contiguous()
    ids = rand_ids(N, (3, 4))
    operand = rand_table(1, 12)[0]
    (out,) = row_kernel(mul_add_spec(torch.int64, torch.float32), [ids, table, operand])
    assert_close(out, mul_add_eager(ids, table, operand))


def test_two_lookups_with_broadcast_position_ids():
    # token ids [B, T] and position ids [1, T], two tables, gelu of the sum; two outputs.
    torch.manual_seed(8)
    tok, pos = rand_table(N, 16, torch.float16), rand_table(10, 16, torch.float16)
    ids, positions = rand_ids(N, (3, 6), torch.int32), torch.randperm(10)[:6].unsqueeze(0)
    spec = RowProgram(
        input_dtypes=(torch.int32, torch.float16, torch.int64, torch.float16),
        lookups=(Lookup(0, 1), Lookup(2, 3)),
        instrs=(
            Instr("add", (ValueRef(0), ValueRef(1)), torch.float16),
            Instr("gelu", (ValueRef(2),), torch.float16, (("approximate", "none"),)),
        ),
        outputs=(3, 2),
    )
    y, x = row_kernel(spec, [ids, tok, positions, pos])
    x_ref = F.embedding(ids, tok) + F.embedding(positions, pos)
    assert_close(x, x_ref)
    assert_close(y, F.gelu(x_ref))
    assert y.dtype == x.dtype == torch.float16


def test_outputs_of_different_dtypes_and_a_lookup_output():
    # v0 = table[ids] (fp16, written out), v1 = v0 cast to fp32, v2 = v1 / 3 (fp32), v3 = v2 > 0
    torch.manual_seed(9)
    table, ids = rand_table(N, 5, torch.float16), rand_ids(N, (4,))
    spec = RowProgram(
        input_dtypes=(torch.int64, torch.float16),
        lookups=(Lookup(0, 1),),
        instrs=(
            Instr("cast", (ValueRef(0),), torch.float32),
            Instr("div", (ValueRef(1), Const("3.0")), torch.float32),
            Instr("gt", (ValueRef(2), Const("0.0")), torch.bool),
        ),
        outputs=(2, 0, 3),
    )
    third, gathered, positive = row_kernel(spec, [ids, table])
    assert (third.dtype, gathered.dtype, positive.dtype) == (
        torch.float32,
        torch.float16,
        torch.bool,
    )
    torch.testing.assert_close(gathered, table[ids], rtol=0, atol=0)
    torch.testing.assert_close(third, table[ids].float() / 3.0)
    torch.testing.assert_close(positive, table[ids] > 0)


def test_float64_chain_computes_in_float64():
    torch.manual_seed(10)
    table, ids = rand_table(N, 7, torch.float64), rand_ids(N, (2, 3))
    operand = rand_table(1, 7, torch.float64)[0] * 1e-9
    (out,) = row_kernel(mul_add_spec(torch.int64, torch.float64), [ids, table, operand])
    torch.testing.assert_close(out, mul_add_eager(ids, table, operand))  # fp64 tolerance
    assert "tl.float64" in kernel_source(mul_add_spec(torch.int64, torch.float64), 2)[1]


# --- empty inputs ---------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4), (2, 0, 5)])
def test_empty_indices(shape, index_dtype):
    table = rand_table(N, 6)
    ids = torch.empty(shape, dtype=index_dtype)
    operand = rand_table(1, 6)[0]
    (out,) = row_kernel(mul_add_spec(index_dtype, torch.float32), [ids, table, operand])
    assert out.shape == (*shape, 6)
    assert out.dtype == torch.float32


def test_empty_indices_skip_the_bounds_check():
    # Nothing is gathered, so an empty index tensor is valid even for an empty table.
    table = torch.empty(0, 6)
    (out,) = row_kernel(lookup_spec(torch.int64, torch.float32), [torch.empty(0).long(), table])
    assert out.shape == (0, 6)


# --- bounds ---------------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("bad", [N, N + 100, -1, -N])
def test_out_of_range_raises_index_error(bad, index_dtype):
    table = rand_table(N, 4)
    ids = rand_ids(N, (2, 3), index_dtype)
    ids[1, 2] = bad
    operand = rand_table(1, 4)[0]
    with pytest.raises(IndexError, match=f"embedding index {bad} is outside"):
        row_kernel(mul_add_spec(index_dtype, torch.float32), [ids, table, operand])
    with pytest.raises(IndexError):  # eager agrees
        F.embedding(ids, table)


def test_out_of_range_in_the_second_lookup_raises():
    tok, pos = rand_table(N, 4), rand_table(5, 4)
    spec = RowProgram(
        (torch.int64, torch.float32, torch.int64, torch.float32),
        (Lookup(0, 1), Lookup(2, 3)),
        (Instr("add", (ValueRef(0), ValueRef(1)), torch.float32),),
        (2,),
    )
    ids = rand_ids(5, (2, 3))  # valid for both tables
    positions = torch.tensor([[0, 1, 5]])  # 5 is valid for tok, not for pos
    with pytest.raises(IndexError, match="table of shape \\(5, 4\\)"):
        row_kernel(spec, [ids, tok, positions, pos])


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
def test_masked_gather_reads_zero_without_the_host_check(monkeypatch, index_dtype):
    # With the host check bypassed and the device assert off, an out-of-range row must read
    # as 0 (masked load), not whatever lies past the table. The table is a view into a larger
    # buffer whose next rows are 1000s, so a read past the end would be visible.
    monkeypatch.setattr(launch, "check_indices", lambda spec, inputs: None)
    torch.manual_seed(11)
    backing = torch.full((N + 8, 4), 1000.0)
    backing[:N] = rand_table(N, 4)
    backing[N - 1] = rand_table(1, 4)[0]
    table = backing[:N]
    ids = rand_ids(N, (3, 4), index_dtype)
    bad = [(0, 0, N), (1, 2, N + 3), (2, 3, -1), (2, 1, -3)]
    for i, j, value in bad:
        ids[i, j] = value
    operand = torch.full((4,), 2.0)
    (out,) = row_kernel(
        mul_add_spec(index_dtype, torch.float32), [ids, table, operand], index_checks=False
    )
    expected = F.embedding(ids.clamp(0, N - 1).long(), table) * 2.0 + 0.5
    for i, j, _ in bad:
        expected[i, j] = 0.5  # 0 * 2 + 0.5
    assert_close(out, expected)
    assert (out < 500).all()


# --- generated source -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("lead", "strides", "sizes", "merged"),
    [
        ((1, 1), [(768, 768), (0, 0)], [1], [(0,), (0,)]),  # a decode row: one dim
        ((2, 3), [(3 * 8, 8)], [6], [(8,)]),  # contiguous rows
        ((2, 3), [(24, 8), (0, 0)], [6], [(8,), (0,)]),  # and a broadcast operand
        ((2, 3), [(24, 8), (8, 16)], [2, 3], [(24, 8), (8, 16)]),  # a transposed operand
        ((2, 3), [(24, 8), (8, 0)], [2, 3], [(24, 8), (8, 0)]),  # broadcast along one dim
        ((4, 1, 5), [(5, 99, 1)], [20], [(1,)]),  # a size-1 dim's stride never matters
    ],
)
def test_lead_dims_collapse_only_where_every_tensor_steps_over_them_as_one(
    lead, strides, sizes, merged
):
    assert launch._collapse_lead(lead, strides) == (sizes, merged)


def test_the_report_names_the_kernel_that_runs_for_collapsed_rows(monkeypatch):
    # A decode row [1, 1, D] runs the rank-1 kernel (lead dims collapsed): explain's name
    # must be that one, so that it can be found in a profile.
    launched = []
    real = launch.run_on_device

    def spy(kernel, *args):
        launched.append(getattr(kernel, "__name__", None) or kernel.fn.__name__)
        return real(kernel, *args)

    monkeypatch.setattr(launch, "run_on_device", spy)
    x, w = torch.randn(1, 1, 37), torch.randn(37)
    out, report = run_fused(lambda x, w: F.rms_norm(x * 2, (37,), w) + 1, x, w,
                            options={"cudagraphs": False})  # fmt: skip
    group = single_group(report)
    assert launched and set(launched) == {group.kernel_name}, (launched, group.kernel_name)
    assert "size1" not in group.source  # rank 1: one lead size


def test_a_kernel_without_lookups_is_not_built_in_debug_mode():
    # Debug mode exists for the index assert; it slows every other kernel down (5% measured).
    _, report = run_fused(lambda x: torch.relu(x * 2 + 1), torch.randn(3, 5),
                          options={"cudagraphs": False, "index_checks": True})  # fmt: skip
    source = single_group(report).source
    assert "@triton.jit(debug=False," in source and "device_assert" not in source


def test_kernel_source_is_readable_and_names_the_kernel():
    spec = mul_add_spec(torch.int64, torch.float16)
    name, source = kernel_source(spec, 2, KernelOptions(index_checks=True))
    assert name.startswith("_pointwise_kernel_")
    assert f"def {name}(" in source
    assert "@triton.jit(debug=True," in source
    assert "tl.device_assert" in source
    assert "v2 = add(v1, 0.5) -> float16" in source  # the math docstring
    assert ".to(tl.float16).to(tl.float32)" in source  # fp16 rounding after each op
    name2, source2 = kernel_source(spec, 2, KernelOptions(index_checks=False))
    assert "@triton.jit(debug=False," in source2
    # rank is part of the name
    assert kernel_source(spec, 1, KernelOptions(index_checks=True))[0] != name


def test_round_intermediates_off_rounds_only_outputs_and_stays_close():
    torch.manual_seed(41)
    spec = mul_add_spec(torch.int64, torch.float16)
    rounded = kernel_source(spec, 2, KernelOptions(round_intermediates=True))[1]
    unrounded = kernel_source(spec, 2, KernelOptions(round_intermediates=False))[1]
    # v1 (the product) is rounded to fp16 only when intermediates are rounded
    assert "v1 = v1.to(tl.float16)" in rounded
    assert "v1 = v1.to(tl.float16)" not in unrounded
    ids = torch.randint(0, N, (3, 5))
    table = torch.randn(N, 7, dtype=torch.float16)
    operand = torch.randn(7, dtype=torch.float16)
    options = KernelOptions(round_intermediates=False)
    (out,) = row_kernel(spec, [ids, table, operand], options=options)
    exact = F.embedding(ids, table.double()) * operand.double() + 0.5
    torch.testing.assert_close(out, mul_add_eager(ids, table, operand), rtol=1e-2, atol=1e-2)
    # one rounding instead of two: never further from the exact result than fp16 allows
    assert (out.double() - exact).abs().max() <= exact.abs().max() * 2**-10


_shapes = st.lists(st.lists(st.sampled_from([0, 1, 2, 3, 5]), max_size=4), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(shapes=_shapes)
def test_broadcast_shapes_agrees_with_torch(shapes):
    # The launcher's fast broadcast must give eager's shape, and refuse what eager refuses.
    try:
        expected = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        with pytest.raises(RuntimeError, match="cannot be broadcast"):
            launch.broadcast_shapes(*shapes)
        return
    assert launch.broadcast_shapes(*shapes) == expected


def test_large_tile_groups_take_four_warps_unless_they_gather():
    # From the H100 prefill sweep (row_kernels_sweep_prefill_h100.json): 1024-element
    # programs of 4 warps for pointwise work; groups with lookups keep the chain's 2 warps,
    # also in 1024-element programs (diag_index_assert_h100.json: the index assert costs
    # nothing there and 4-5% in whole 2048-wide rows).
    rows = configs.SMALL_GROUP_ELEMENTS  # past the latency-bound regime for any width >= 2
    assert launch.launch_config(rows, 128, "tile") == (8, 128, 4)
    assert launch.launch_config(rows, 4096, "tile") == (1, 1024, 4)
    assert launch.launch_config(rows, 4096, "tile", gathers=True) == (1, 1024, 2)
    assert launch.launch_config(rows, 64, "tile", gathers=True) == (16, 64, 2)


def test_unaligned_narrow_rows_take_one_warp_per_program():
    # Rows Triton cannot prove 16-element aligned get one element per thread along the row,
    # so a 64-wide block of 8 warps split each row over two warps (Swin's 49-wide window
    # softmax: 26.1 us against 15.8 with one warp of 8 rows, H200; configs.py).
    assert launch.launch_config(75264, 49, "persistent") == (32, 64, 8)
    assert launch.launch_config(75264, 49, "persistent", aligned=False) == (8, 64, 1)
    assert launch.launch_config(9456, 197, "persistent", aligned=False) == (2, 256, 1)
    assert launch.launch_config(3, 49, "persistent", aligned=False) == (4, 64, 1)
    # wider rows (not measured) keep the rule of aligned rows
    assert launch.launch_config(64, 1000, "persistent", aligned=False) == (2, 1024, 8)
    assert launch.launch_config(4096, 49, "tile", aligned=False) == launch.launch_config(
        4096, 49, "tile"
    )


@pytest.mark.parametrize(
    ("shape", "bias_shape", "aligned"),
    [
        ((5, 3, 7, 49), (1, 3, 7, 49), False),  # Swin: rows of 49 start anywhere
        ((5, 3, 7, 64), (1, 3, 7, 64), True),
        ((21, 49), (1, 49), False),  # the broadcast mask is aligned, the scores are not
    ],
)
def test_a_launch_says_whether_its_rows_are_aligned(monkeypatch, shape, bias_shape, aligned):
    asked = []
    real = launch.launch_config

    def spy(rows, width, layout="tile", gathers=False, aligned=True):
        asked.append((layout, aligned))
        return real(rows, width, layout, gathers, aligned=aligned)

    monkeypatch.setattr(launch, "launch_config", spy)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(*shape, generator=g).half()
    bias = torch.randn(*bias_shape, generator=g).half()
    out, _ = run_fused(lambda x, b: (x + b).softmax(-1), x, bias, options={"cudagraphs": False})
    assert asked == [("persistent", aligned)]
    assert_close(out, (x + bias).softmax(-1), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("with_lookup", [False, True], ids=["pointwise", "lookup"])
def test_a_launch_asks_for_the_config_of_a_program_that_gathers(monkeypatch, with_lookup):
    asked = []
    real = launch.launch_config

    def spy(rows, width, layout="tile", gathers=False, aligned=True):
        asked.append(gathers)
        return real(rows, width, layout, gathers, aligned=aligned)

    monkeypatch.setattr(launch, "launch_config", spy)
    table, x = torch.randn(11, 6), torch.randn(4, 6)
    ids = torch.tensor([1, 3, 10, 0])
    if with_lookup:
        run_fused(lambda i, t, x: F.embedding(i, t) * 2 + x, ids, table, x,
                  options={"cudagraphs": False})  # fmt: skip
    else:
        run_fused(lambda x: torch.relu(x * 2 + 1), x, options={"cudagraphs": False})
    assert asked and set(asked) == {with_lookup}


def relu_times_two_spec(dtype):
    """v0 = relu(x); v1 = v0 * 2 -> outputs (v1,): a tile program without lookups."""
    return RowProgram(
        input_dtypes=(dtype,),
        lookups=(),
        instrs=(
            Instr("relu", (InputRef(0),), dtype),
            Instr("mul", (ValueRef(0), Const("2.0")), dtype),
        ),
        outputs=(1,),
    )


def _launched(monkeypatch, run) -> tuple[tuple, dict]:
    """(grid, meta) of the one launch that ``run()`` makes, recorded instead of run."""
    launches, warmups = [], []
    monkeypatch.setattr(
        launch, "_compiled_kernel", lambda *a, **k: helpers.LaunchRecorder(launches, warmups)
    )
    run()
    ((_, grid, meta),) = launches
    return grid, meta


@pytest.mark.parametrize(
    "rows, width, grid, rows_axis",
    [
        (5, 3000, (3, 5), 1),  # three 1024-column blocks step first, on axis 0
        (5, 1000, (5, 1), 0),  # one column block: rows on axis 0
        (65535, 2048, (2, 65535), 1),  # one row per program: axis 1 holds 65535 blocks
        (65536, 2048, (65536, 2), 0),  # one more and the rows go back to axis 0
    ],
)
def test_tile_grid_puts_column_blocks_first_while_row_blocks_fit_axis_1(
    monkeypatch, rows, width, grid, rows_axis
):
    # Inductor's order, neighbouring programs on neighbouring blocks of a row, measured
    # faster (diag_row_variants_h100.json); CUDA's grid axis 1 holds at most 65535 blocks.
    x = torch.empty(rows, width, device="meta")
    launched = _launched(monkeypatch, lambda: row_kernel(relu_times_two_spec(torch.float32), [x]))
    assert (launched[0], launched[1]["ROWS_AXIS"]) == (grid, rows_axis)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_column_first_tile_grid_covers_every_element(dtype):
    # 5 rows x 2500 columns: a (3, 5) grid, the last column block partial; a grid or an
    # axis left unswapped would leave rows or columns unwritten (outputs start empty).
    x = torch.randn(5, 2500).to(dtype)
    (out,) = row_kernel(relu_times_two_spec(dtype), [x])
    assert_close(out, torch.relu(x) * 2)


def narrow_and_row_spec(dtype):
    """v0 = x * s (a row value), v1 = s * 3 (narrow: s is [rows, 1]) -> outputs (v0, v1)."""
    return RowProgram(
        input_dtypes=(dtype, dtype),
        lookups=(),
        instrs=(
            Instr("mul", (InputRef(0), InputRef(1)), dtype),
            Instr("mul", (InputRef(1), Const("3.0")), dtype),
        ),
        outputs=(0, 1),
        narrow_inputs=frozenset({1}),
    )


def test_a_narrow_output_of_a_column_first_tile_is_written_once_per_row(monkeypatch):
    # Only the first column block stores a narrow (per-row) value: the guard must test the
    # column axis, which is grid axis 0 here.
    x, s = torch.randn(5, 2500), torch.randn(5, 1)
    row, narrow = row_kernel(narrow_and_row_spec(torch.float32), [x, s])
    assert_close(row, x * s)
    assert_close(narrow, s * 3)
    meta_inputs = [x.to("meta"), s.to("meta")]
    spec = narrow_and_row_spec(torch.float32)
    grid, meta = _launched(monkeypatch, lambda: row_kernel(spec, meta_inputs))
    assert (grid, meta["ROWS_AXIS"]) == ((3, 5), 1)


def test_a_column_first_pair_splits_its_row_blocks_on_axis_1(monkeypatch):
    # Two sets (3 and 6 rows of 2500 columns) in one launch: 3 column blocks on axis 0 and
    # 3 + 6 row blocks on axis 1, split at GRID_A = 3 along that axis.
    spec = relu_times_two_spec(torch.float32)
    a, b = [torch.randn(3, 2500)], [torch.randn(6, 2500)]
    out_a, out_b = launch.row_kernel_pair(spec, a, b, KernelOptions())
    assert_close(out_a, torch.relu(a[0]) * 2)
    assert_close(out_b, torch.relu(b[0]) * 2)
    meta_a, meta_b = [a[0].to("meta")], [b[0].to("meta")]
    grid, meta = _launched(
        monkeypatch, lambda: launch.row_kernel_pair(spec, meta_a, meta_b, KernelOptions())
    )
    assert (grid, meta["ROWS_AXIS"]) == ((3, 9), 1)
