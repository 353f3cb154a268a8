"""Copies that only reorder elements, folded into the groups that write or read them
(passes/folded_copies.py).

Swin's window partition after its LayerNorm (written straight into the windows' order by the
LayerNorm's group) and window reverse before the residual add and the next LayerNorm (read
from the projection's output through strides), written the way timm writes them, and an
operand read through its transpose, at odd sizes: outputs equal eager's, the copies are
gone from the fused graph. A roll, a chain read elsewhere too and a layout other than the
traced one stay or fail as the module docstring says.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    assert_close,
    compile_fused,
    row_groups,
    run_fused,
    runtime_modes,
    timm_fp16_replayed,
)

import fusebackend
from fusebackend.passes.folded_copies import _atoms, strided_view


def window_partition(x: torch.Tensor, w: int) -> torch.Tensor:
    B, H, W, C = x.shape
    x = x.view(B, H // w, w, W // w, w, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, w, w, C)


def window_reverse(windows: torch.Tensor, w: int, H: int, W: int) -> torch.Tensor:
    C = windows.shape[-1]
    x = windows.view(-1, H // w, W // w, w, w, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, H, W, C)


class WindowBlock(nn.Module):
    """The token mixing half of a Swin block (timm's SwinTransformerBlock._attn and the
    residual and norm after it), with a linear in place of the window attention and an
    optional cyclic shift."""

    def __init__(self, dim: int = 12, window: int = 3, shift: int = 0) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mix, self.fc = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.window, self.shift = window, shift
        for p in self.parameters():  # not the initialisation's ones and zeros
            nn.init.normal_(p, 0.3, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        shifted = self.norm1(x)
        if self.shift:
            shifted = torch.roll(shifted, shifts=(-self.shift, -self.shift), dims=(1, 2))
        windows = window_partition(shifted, self.window).view(-1, self.window**2, C)
        mixed = self.mix(windows).view(-1, self.window, self.window, C)
        shifted = window_reverse(mixed, self.window, H, W)
        if self.shift:
            shifted = torch.roll(shifted, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + shifted
        return self.fc(self.norm2(x.reshape(B, H * W, C)))


def _folded() -> list[str]:
    return fusebackend.last_report().graphs[-1].rewrites.get("copies_folded", [])


def _fused_graph() -> torch.fx.Graph:
    return fusebackend.last_report().graphs[-1].runtime._fused.graph


def _copies_left() -> list[str]:
    """Nodes of the fused graph that copy a tensor to reorder it."""
    names = []
    for n in _fused_graph().nodes:
        if n.op == "call_method" and n.target in ("contiguous", "clone", "roll"):
            names.append(n.name)
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_window_partition_and_reverse_are_folded_into_the_layer_norms(dtype):
    torch.manual_seed(0)
    model = WindowBlock().eval().to(dtype)
    x = torch.randn(2, 9, 6, 12, dtype=dtype)
    out, _ = run_fused(model, x)
    assert_close(out, model(x))
    # the partition's copy written by norm1's group, the reverse's read by norm2's
    assert len(_folded()) == 2, _folded()
    assert not any(n.target == "contiguous" for n in _fused_graph().nodes
                   if n.op == "call_method")  # fmt: skip
    # the copies no longer show as not fused
    assert not set(_folded()) & {r.node for r in fusebackend.last_report().rejections}
    with torch.no_grad():  # replayed on new data: the buffer is written again
        x = torch.randn(2, 9, 6, 12, dtype=dtype)
        assert_close(compile_fused(model)(x), model(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_rolled_window_is_gathered_by_rows(dtype):
    torch.manual_seed(1)
    model = WindowBlock(shift=1).eval().to(dtype)
    x = torch.randn(2, 6, 9, 12, dtype=dtype)
    out, _ = run_fused(model, x)
    assert_close(out, model(x))
    # a roll's order wraps around, so no strides give it: norm1's group stores each row at
    # its place in the windows, norm2's gathers the projection's rows
    assert len(_folded()) == 4, _folded()  # two rolls, two copies
    assert sum(name.startswith("contiguous") for name in _folded()) == 2, _folded()
    assert _copies_left() == []
    assert not any(n.target is torch.roll for n in _fused_graph().nodes)
    programs = [n.target.program for n in _fused_graph().nodes if hasattr(n.target, "program")]
    gathers = [lk for p in programs for lk in p.lookups]
    assert len(gathers) == 1 and not gathers[0].checked, programs
    assert sum(bool(p.placed_outputs) for p in programs) == 1, programs
    # the report shows the kernels that run: the gather and the placed rows, by their names
    report = fusebackend.last_report()
    assert any("rows of table" in g.source for g in report.groups), str(report)
    assert any("rows placed by" in g.source for g in report.groups), str(report)
    launched = {n.target.__name__ for n in _fused_graph().nodes if hasattr(n.target, "program")}
    assert launched == {g.kernel_name for g in report.groups}
    with torch.no_grad():
        x = torch.randn(2, 6, 9, 12, dtype=dtype)
        assert_close(compile_fused(model)(x), model(x))


def test_an_operand_read_through_its_transpose():
    w = torch.randn(7)

    def fn(a, b):
        t = (a @ b).transpose(1, 2).contiguous()  # (2, 5, 7): a copy of the product
        return torch.layer_norm(t + w, (7,))

    a, b = torch.randn(2, 7, 3), torch.randn(3, 5)
    out, _ = run_fused(fn, a, b)
    assert_close(out, fn(a, b))
    assert len(_folded()) == 1, _folded()


def test_an_operand_read_from_inside_its_source():
    """The operand starts one row into the product: its view starts there too."""
    w = torch.randn(7)

    def fn(a, b):
        t = (a @ b)[:, 1:].transpose(1, 2).contiguous()  # (2, 7, 4)
        return torch.relu(t * w.view(7, 1) + 1.0)

    a, b = torch.randn(2, 5, 3), torch.randn(3, 7)
    out, _ = run_fused(fn, a, b)
    assert_close(out, fn(a, b))
    assert len(_folded()) == 1, _folded()


def test_windows_of_two_sizes_read_and_written_by_one_group():
    """Read as windows of 2, written as windows of 4: the group runs over 12 split as
    3 x 2 x 2, each split of the two a run of those dims."""

    def fn(a, b):
        x = window_reverse((a @ b).view(-1, 2, 2, 5), 2, 12, 12)  # a read through strides
        y = torch.sigmoid(x) * 2.0 + 0.5
        return window_partition(y, 4)  # a write into the windows' order

    a, b = torch.randn(72, 4, 3), torch.randn(3, 5)
    out, _ = run_fused(fn, a, b)
    assert_close(out, fn(a, b))
    assert len(_folded()) == 2, _folded()


def test_a_copy_read_elsewhere_too_is_not_written_by_its_producer():
    def fn(x):
        t = (torch.sigmoid(x) * 3.0 + 1.0).permute(0, 2, 1)
        return t.contiguous() * 2.0, t  # the permuted view is returned as well

    x = torch.randn(2, 5, 6)
    out, _ = run_fused(fn, x)
    assert_close(out, fn(x))
    # the first group keeps its layout (its permuted view is returned); the multiply, a
    # group of its own for the copy it takes in, reads that view through its strides
    assert _folded() == ["contiguous"]
    writers = [n for n in _fused_graph().nodes if getattr(n.target, "into", ())]
    assert writers == []


def test_strided_view_refuses_a_layout_it_was_not_worked_out_for():
    base = torch.arange(24.0).view(2, 3, 4)
    view = strided_view(base, (2, 4, 3), (12, 1, 4), 0, ((12, 4, 1), 0))
    assert torch.equal(view, base.transpose(1, 2))
    with pytest.raises(RuntimeError, match=r"expects its source with strides \(12, 4, 1\)"):
        strided_view(base.transpose(1, 2).contiguous().transpose(1, 2), (2, 4, 3), (12, 1, 4),
                     0, ((12, 4, 1), 0))  # fmt: skip


def test_positions_split_into_finer_dims_or_refused():
    base = torch.arange(2 * 6 * 4).view(2, 6, 4)
    # dim 1 of 6 as 2 x 3 with their strides swapped: one stride per finer dim
    moved = base.view(2, 2, 3, 4).permute(0, 2, 1, 3).contiguous().view(2, 6, 4)
    atoms, start = _atoms(moved)
    assert start == 0
    assert atoms == [[(2, 24)], [(3, 4), (2, 12)], [(4, 1)]]
    # a roll wraps around: no stride per dim gives it
    assert _atoms(torch.roll(base, 1, 1)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_window_block_on_the_gpu_folds_its_copies_and_equals_eager(dtype):
    torch.manual_seed(5)
    model = WindowBlock(dim=24, window=7).eval().to("cuda", dtype)
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):  # the 2nd call captures, the 3rd replays
            x = torch.randn(3, 14, 21, 24, device="cuda", dtype=dtype)
            assert_close(compiled(x), model(x))
    assert len(_folded()) == 2, str(fusebackend.last_report())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_timm_swin_folds_its_window_copies_and_equals_eager():
    timm_fp16_replayed("swin_tiny_patch4_window7_224", 224, seed=6)
    # the partition and reverse of the 5 blocks without a shift and whose windows are not
    # the whole image (10 copies), and of the 5 shifted blocks (10 copies and their 10 rolls,
    # by row numbers), and the 3 patch merges' 2 x 2 regroupings read by their LayerNorm's
    # group: 33, as a CPU trace in fp32 folds
    assert len(_folded()) == 33, str(fusebackend.last_report())
    assert not any(n.target is torch.roll for n in _fused_graph().nodes)


def test_a_row_order_built_here_is_gathered_without_the_index_assert():
    """Token ids trip the kernel's assert, which needs Triton's debug build (5% slower);
    a row order the backend built and checked needs neither."""
    from fusebackend.kernels import KernelOptions
    from fusebackend.kernels.ir import Instr, Lookup, RowProgram, ValueRef
    from fusebackend.kernels.launch import kernel_source

    def program(checked: bool) -> RowProgram:
        relu = Instr("relu", (ValueRef(0),), torch.float32)
        return RowProgram((torch.float32, torch.int32), (Lookup(1, 0, checked),), (relu,), (1,))

    options = KernelOptions(index_checks=True)
    _, checked = kernel_source(program(True), 1, options)
    _, built = kernel_source(program(False), 1, options)
    assert "device_assert" in checked and "debug=True" in checked
    assert "device_assert" not in built and "debug=False" in built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_activation_takes_in_the_copy_of_its_operand(dtype):
    """LeViT's attention output: ``(attn @ v).transpose(1, 2).reshape(B, N, heads * d)``
    then a hardswish. Alone the hardswish would be one kernel as in eager, but it also
    takes in the reshape's copy (its row split into heads x d: an elementwise program's
    rows can be cut anywhere), so two kernels become one."""

    def fn(attn, v):
        x = (attn @ v).transpose(1, 2).reshape(2, 11, 3 * 7)
        return F.hardswish(x)

    attn, v = torch.randn(2, 3, 11, 11, dtype=dtype), torch.randn(2, 3, 11, 7, dtype=dtype)
    out, report = run_fused(fn, attn, v)
    assert_close(out, fn(attn, v))
    assert [g.nodes for g in report.groups] == [("hardswish",)], str(report)
    assert len(_folded()) == 1, _folded()


def test_a_lone_activation_without_a_copy_stays_aten():
    def fn(a, b):
        return F.hardswish(a @ b)

    a, b = torch.randn(4, 6), torch.randn(6, 5)
    out, report = run_fused(fn, a, b, expect_fused=False)
    assert_close(out, fn(a, b))
    # (four rows: the matmul group takes the hardswish as its tail, no row group)
    assert row_groups(report) == [], str(report)


def test_a_row_wise_group_keeps_its_rows_whole():
    """A softmax over ``heads * d`` reading the attention output's transposed copy: the
    copy would split its row into heads x d, which a row-wise program cannot take (its
    reduction spans the whole row): the copy stays, the result is eager's."""
    b = torch.randn(3 * 7)

    def fn(attn, v):
        x = (attn @ v).transpose(1, 2).reshape(2, 11, 3 * 7)
        return torch.softmax(x + b, dim=-1)

    attn, v = torch.randn(2, 3, 11, 11), torch.randn(2, 3, 11, 7)
    out, _ = run_fused(fn, attn, v)
    assert_close(out, fn(attn, v))
    assert _folded() == []


def test_a_group_reading_a_concatenation_keeps_its_parts_at_their_own_sizes():
    """GhostNet's second ghost module in fp32 channels-last: BatchNorms folded into the
    convolutions, the concatenation of the two (cuDNN's outputs) read by the residual add's
    group, whose output is written in the traced order. That write folds; the parts, half the
    group's channels each, are not reshaped to its shape (this compile failed on an assert
    before: 'a group's operand broadcasts to its shape')."""
    from test_batch_norm_folding import _randomize_statistics
    from test_depthwise import GhostResidual

    torch._dynamo.reset()
    model = _randomize_statistics(GhostResidual()).eval()
    x = torch.randn(2, 8, 9, 9)
    compiled = torch.compile(model, backend="infinifuse", options={"channels_last": True})
    with torch.no_grad():
        for _ in range(2):
            out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert set(runtime_modes()) == {"fusion"}
