"""Concatenations written in place by the groups that compute their parts
(passes/concat_writes.py).

GhostNet's ghost module (the activation of a 1x1 convolution, read by the depthwise
convolution and by the ``cat``, beside the depthwise convolution's own activation) and
plain elementwise parts along the last and the first dim: each group writes into a view of
the result, the fused graph has no ``cat`` left, outputs equal eager's. A part that is no
group's output, a part written in place and a tensor that is two parts stay as traced.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
from helpers import assert_close, compile_fused, run_fused, timm_fp16_replayed

import fusebackend
from fusebackend.kernels import RowProgram
from fusebackend.kernels.launch import row_kernel


class GhostModule(nn.Module):
    """timm's GhostModule with ReLU, its output cut to ``out`` channels (odd sizes)."""

    def __init__(self, inp: int = 6, init: int = 5, out: int = 9) -> None:
        super().__init__()
        self.primary = nn.Sequential(nn.Conv2d(inp, init, 1, bias=False), nn.BatchNorm2d(init))
        self.cheap = nn.Sequential(nn.Conv2d(init, init, 3, padding=1, groups=init, bias=False),
                                   nn.BatchNorm2d(init))  # fmt: skip
        self.out = out
        for bn in (self.primary[1], self.cheap[1]):
            bn.running_mean.uniform_(-1.0, 1.0)
            bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = torch.relu(self.primary(x))
        x2 = torch.relu(self.cheap(x1))
        return torch.cat([x1, x2], dim=1)[:, : self.out]


def _written() -> list[str]:
    return fusebackend.last_report().graphs[-1].rewrites.get("concatenations_written", [])


def _cats_left() -> int:
    graph = fusebackend.last_report().graphs[-1].runtime._fused.graph  # what runs fused
    return sum(n.op == "call_function" and n.target is torch.cat for n in graph.nodes)


@pytest.mark.parametrize("channels_last", [False, True])
def test_ghost_module_parts_are_written_into_the_concatenation(channels_last):
    torch.manual_seed(0)
    model = GhostModule().eval()
    x = torch.randn(2, 6, 7, 5)
    out, _ = run_fused(model, x, options={"channels_last": channels_last})
    assert_close(out, model(x))
    assert _written() == ["cat"], str(fusebackend.last_report())
    assert _cats_left() == 0
    # built in place, the cat is no longer listed as not fused
    assert "cat" not in [r.node for r in fusebackend.last_report().rejections]
    graph = fusebackend.last_report().graphs[-1].runtime._fused.graph
    writers = [n.target for n in graph.nodes if getattr(n.target, "into", ())]
    # x1, which the depthwise convolution reads too, is stored twice: the convolution reads
    # a tensor of its own, not a slice of the concatenation (which it would copy first)
    assert sorted(op.repeats for op in writers) == [(), (0,)]
    with torch.no_grad():  # replayed: the buffer's both halves are written again
        x = torch.randn(2, 6, 7, 5)
        assert_close(compile_fused(model, {"channels_last": channels_last})(x), model(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [-1, 0])
def test_elementwise_parts_along_any_dim(dtype, dim):
    w = torch.randn(7, 3, dtype=dtype)

    def fn(a, b):
        both = torch.cat([torch.sigmoid(a) * 2.0, torch.tanh(b) - a], dim=dim)
        return both @ w if dim == 0 else both.sum(0)

    g = torch.Generator().manual_seed(1)
    a = torch.randn(5, 7, generator=g).to(dtype)
    b = torch.randn(5, 7, generator=g).to(dtype)
    out, _ = run_fused(fn, a, b)
    assert_close(out, fn(a, b))
    assert _written() == ["both"], str(fusebackend.last_report())
    assert _cats_left() == 0


def _interleaved_rotary(x, cos, sin):
    # GPT-J's layout: even and odd columns rotated, stacked back and interleaved
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_interleaved_rotary_embedding_is_stacked_in_place(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 5, 14, generator=g).to(dtype)  # [B, heads, T, head_dim]
    angles = torch.randn(5, 7, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    out, _ = run_fused(_interleaved_rotary, x, cos, sin)
    assert_close(out, _interleaved_rotary(x, cos, sin))
    assert _written() == ["stack"], str(fusebackend.last_report())
    graph = fusebackend.last_report().graphs[-1].runtime._fused.graph
    assert not any(n.target is torch.stack for n in graph.nodes)
    # the two halves' groups write every other column of the result (a select each)
    assert sum(len(getattr(n.target, "into", ())) for n in graph.nodes) == 2


def _pushed() -> list[str]:
    return fusebackend.last_report().graphs[-1].rewrites.get("pushed_into_cats", [])


class GhostResidual(GhostModule):
    """A ghost module whose concatenation, cut to ``out`` channels, takes a residual add."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x[:, : self.out] * 0.5


def test_a_residual_add_after_the_concatenation_runs_in_the_parts_groups():
    torch.manual_seed(7)
    model = GhostResidual(inp=12, init=6, out=12).eval()
    x = torch.randn(2, 12, 5, 7)
    out, _ = run_fused(model, x)
    assert_close(out, model(x))
    assert _pushed() == ["add"], str(fusebackend.last_report())  # (x * 0.5 joins its group)
    assert len(_written()) == 1 and _cats_left() == 0
    graph = fusebackend.last_report().graphs[-1].runtime._fused.graph
    assert not any(n.target is operator.add for n in graph.nodes)  # no kernel of its own


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ops_after_a_sliced_concatenation_run_on_the_parts_it_keeps(dtype):
    def fn(a, b, c, r, scale):
        parts = [torch.sigmoid(a) * 2.0, torch.tanh(b) - 1.0, torch.relu(c) + 0.5]
        both = torch.cat(parts, dim=1)[:, 3:12]  # the first part sliced away
        return (both + r) * scale  # r: the slice's shape; scale: one per row

    g = torch.Generator().manual_seed(8)
    a, b, c = (torch.randn(4, n, generator=g).to(dtype) for n in (3, 4, 5))
    r, scale = torch.randn(4, 9, generator=g).to(dtype), torch.randn(4, 1, generator=g).to(dtype)
    out, _ = run_fused(fn, a, b, c, r, scale)
    assert_close(out, fn(a, b, c, r, scale))
    assert len(_pushed()) == 2, str(fusebackend.last_report())
    assert len(_written()) == 1 and _cats_left() == 0


def test_ops_stay_after_a_slice_that_cuts_a_part_or_with_an_operand_along_the_dim():
    # a part cut by the slice would be narrowed after its group: nothing gained
    model = GhostResidual(inp=11, init=6, out=11).eval()  # 12 channels cut to 11
    x = torch.randn(2, 11, 5, 7)
    with torch.no_grad():
        assert_close(compile_fused(model)(x), model(x))
    assert _pushed() == [] and len(_written()) == 1, str(fusebackend.last_report())

    def bias_along_the_dim(a, b, bias):  # (a vector over the cat's dim: not split here)
        return torch.cat([torch.sigmoid(a) * 2.0, torch.tanh(b) - 1.0], dim=1) + bias

    g = torch.Generator().manual_seed(9)
    a, b, bias = (torch.randn(*shape, generator=g) for shape in ((4, 3), (4, 5), (8,)))
    torch._dynamo.reset()
    with torch.no_grad():
        assert_close(compile_fused(bias_along_the_dim)(a, b, bias), bias_along_the_dim(a, b, bias))
    assert _pushed() == [], str(fusebackend.last_report())


def test_symbolic_sizes_keep_the_cat():
    # dynamic=True: the buffer's sizes would be symbols; the cat stays, outputs equal eager's
    def fn(a, b):
        return torch.cat([torch.sigmoid(a) * 2.0, torch.tanh(b) - a], dim=-1).sum(-1)

    compiled = torch.compile(fn, backend="infinifuse", dynamic=True,
                             options={"validate": False})  # fmt: skip
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for rows in (5, 9):
            a, b = torch.randn(rows, 7, generator=g), torch.randn(rows, 7, generator=g)
            assert_close(compiled(a, b), fn(a, b))
    assert fusebackend.last_report().graphs[-1].path == "fused"
    assert _written() == []


def test_what_is_left_as_traced():
    def a_matmul_part(a, w):
        return torch.cat([torch.relu(a) * 3.0, a @ w], dim=-1).sum(-1)  # a matmul's output

    def a_part_written_in_place(a):
        part = torch.relu(a) * 3.0
        part[:, 1] = 0.0  # written before the cat: the kernel's value is not the cat's
        return torch.cat([part, torch.sigmoid(a) + 1.0], dim=-1) * 2.0

    def one_tensor_twice(a):
        part = torch.relu(a) * 3.0
        return torch.cat([part, part], dim=0) * 2.0

    g = torch.Generator().manual_seed(2)
    a, w = torch.rand(4, 5, generator=g) + 0.1, torch.randn(5, 3, generator=g)
    cases = [(a_matmul_part, (a, w)), (a_part_written_in_place, (a,)),
             (one_tensor_twice, (a,))]  # fmt: skip
    for fn, args in cases:
        torch._dynamo.reset()
        with torch.no_grad():
            want = fn(*[t.clone() for t in args])
            assert_close(compile_fused(fn)(*[t.clone() for t in args]), want)
        assert _written() == [], (fn.__name__, str(fusebackend.last_report()))


def test_a_destination_of_another_shape_is_refused():
    program = _relu_program()
    x = torch.randn(3, 4)
    buffer = torch.zeros(3, 8)
    (written,) = row_kernel(program, [x], out=[buffer[:, 2:6]])
    assert written.data_ptr() == buffer[:, 2:6].data_ptr()
    assert_close(buffer[:, 2:6], torch.relu(x) * 1.5)
    assert not buffer[:, :2].any() and not buffer[:, 6:].any()  # nothing written beside it
    with pytest.raises(ValueError, match="output 0 is"):
        row_kernel(program, [x], out=[torch.empty(3, 5)])
    with pytest.raises(ValueError, match="out has 2 entries"):
        row_kernel(program, [x], out=[None, None])


def _relu_program() -> RowProgram:
    run_fused(lambda x: torch.relu(x) * 1.5, torch.randn(3, 4))
    graph = fusebackend.last_report().graphs[-1].runtime._fused.graph
    return next(n.target.program for n in graph.nodes
                if isinstance(n.target, fusebackend.backend.FusedGroupOp))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_ghost_module_on_the_gpu_replays_equal_eager(dtype):
    # fp16 convolutions run channels-last by default: the parts come permuted back
    torch.manual_seed(3)
    model = GhostModule(inp=16, init=12, out=20).eval().to("cuda", dtype)
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):  # the 2nd call captures, the 3rd replays
            x = torch.randn(3, 16, 13, 11, device="cuda", dtype=dtype)
            assert_close(compiled(x), model(x))
    assert _written() == ["cat"], str(fusebackend.last_report())
    assert fusebackend.stats()["recordings"] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_timm_ghostnet_writes_its_concatenations_and_equals_eager():
    timm_fp16_replayed("ghostnet_100", 96, seed=4)
    # all 32: in fp16 each BatchNorm is a scale and shift after its convolution (a group);
    # and the 16 residual adds after a second ghost module run in its parts' groups (as a
    # bf16 trace on the CPU gives)
    assert len(_written()) == 32, str(fusebackend.last_report())
    assert len(_pushed()) == 16, str(fusebackend.last_report())
