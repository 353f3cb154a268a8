"""Reshapes moved ahead of the elementwise ops they follow (passes/reshapes.py).

LeViT's ``bn(linear(x).flatten(0, 1)).reshape_as(x)`` followed by a hardswish and a residual
add, written as timm writes it: the BatchNorm's scale and shift, the activation and the add
run in one group (they were two, split at the reshape); outputs equal eager's. Reshapes that
cannot move (the op is read elsewhere, a per-row operand) stay, with eager's outputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, check, eager, run_fused

import fusebackend
from fusebackend.passes.reshapes import _broadcast_after, move_reshapes_up


class LinearNorm(nn.Module):
    """timm LeViT's ``LinearNorm``: a linear layer and a BatchNorm1d over its tokens."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, out, bias=False)
        self.bn = nn.BatchNorm1d(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class LevitMlp(nn.Module):
    """LeViT's residual MLP: LinearNorm, hardswish, LinearNorm, + x."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = LinearNorm(width, 2 * width), LinearNorm(2 * width, width)
        self.act = nn.Hardswish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ln2(self.act(self.ln1(x)))


def _randomized(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_levit_mlp_runs_norm_activation_and_residual_in_one_group(dtype):
    torch.manual_seed(0)
    model = _randomized(LevitMlp(12), seed=1).to(dtype)
    x = torch.randn(2, 7, 12, dtype=dtype)
    report = check(model, x)
    moved = report.graphs[-1].rewrites.get("reshapes_moved", [])
    assert moved, str(report)
    assert not any("reshape_as" in r.reason for r in report.rejections), str(report)
    # ln1's scale and shift with the hardswish; ln2's with the residual add
    assert any(len(g.nodes) >= 4 and any("hardswish" in n for n in g.nodes)
               for g in report.groups), str(report)  # fmt: skip


def _graph_of(fn, *args):
    """Dynamo's graph of ``fn`` (with example values) and the inputs in its order."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    return graphs[0]


def test_a_chain_is_moved_and_the_reshape_back_dropped():
    def fn(x, scale, shift):
        y = x.flatten(0, 1)
        return F.relu((y - shift) * scale + 1.0).reshape(x.shape) * 2.0

    x, scale, shift = torch.randn(3, 5, 8), torch.rand(8) + 0.5, torch.randn(1, 8)
    gm, inputs = _graph_of(fn, x, scale, shift)
    moved = move_reshapes_up(gm.graph)
    gm.recompile()
    assert len(moved) == 4, moved  # sub, mul, add, relu
    reshapes = [n for n in gm.graph.nodes if n.op == "call_method"
                and n.target in ("flatten", "reshape")]  # fmt: skip
    assert not reshapes, gm.code
    assert_close(gm(*inputs)[0], fn(x, scale, shift))


def test_what_cannot_move_stays():
    def fn(x, per_row, other):
        y = x.flatten(0, 1)
        a = (y * per_row).reshape_as(x)  # (B*N, 1) per row: (B, N, 1) after, so it moves
        b = torch.sigmoid(y)
        return a, b.reshape_as(x) + b.sum(), (y.t() + 1).reshape(x.shape[::-1]) + other

    x, per_row = torch.randn(2, 3, 4), torch.randn(6, 1)
    other = torch.randn(4, 3, 2)
    gm, inputs = _graph_of(fn, x, per_row, other)
    # sigmoid is read twice; y.t() is not contiguous
    assert move_reshapes_up(gm.graph) == ["mul"]
    gm.recompile()
    for got, want in zip(gm(*inputs), fn(x, per_row, other), strict=True):
        assert_close(got, want)
    out, _ = run_fused(fn, x, per_row, other, expect_fused=False)
    for got, want in zip(out, fn(x, per_row, other), strict=True):
        assert_close(got, want)


def test_symbolic_sizes_move_and_match_eager():
    torch.manual_seed(2)
    model = _randomized(LevitMlp(12), seed=3)
    compiled = torch.compile(model, backend="infinifuse", dynamic=True,
                             options={"validate": False})  # fmt: skip
    with torch.no_grad():
        for batch, tokens in ((2, 7), (3, 5)):
            x = torch.randn(batch, tokens, 12)
            assert_close(compiled(x), model(x))
    graph = fusebackend.last_report().graphs[-1]
    assert graph.rewrites.get("reshapes_moved"), str(fusebackend.last_report())
    assert any(any("hardswish" in n for n in g.nodes) and len(g.nodes) >= 4
               for g in graph.groups), str(fusebackend.last_report())  # fmt: skip


class ShiftedWindowScores(nn.Module):
    """timm's WindowAttention scores with a shift mask (its non-fused path): the relative
    position bias added per head, the mask per window through a 5-d view, a softmax over
    the 4-d view back."""

    def __init__(self, heads: int = 2, tokens: int = 5, windows: int = 3, module=True) -> None:
        super().__init__()
        # timm's nn.Softmax(dim=-1) passes its dim positionally; torch.softmax(x, dim=-1) not
        self.softmax = nn.Softmax(dim=-1) if module else lambda x: torch.softmax(x, dim=-1)
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens))
        mask = torch.zeros(windows, tokens, tokens)
        mask[1:, : tokens // 2, tokens // 2 :] = -100.0  # as Swin's shifted windows mask
        self.register_buffer("mask", mask)
        self.heads, self.windows = heads, windows

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        n = scores.shape[-1]
        attn = scores + self.bias.unsqueeze(0)
        attn = attn.view(-1, self.windows, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        return self.softmax(attn.view(-1, self.heads, n, n))


@pytest.mark.parametrize("module", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shifted_window_bias_mask_and_softmax_in_one_group(dtype, module):
    torch.manual_seed(4)
    model = ShiftedWindowScores(module=module).eval().to(dtype)
    scores = torch.randn(2 * 3, 2, 5, 5, dtype=dtype)
    out, report = run_fused(model, scores)
    assert_close(out, model(scores))
    # the 5-d view moved above the bias add (the bias viewed (1, 1, heads, N, N)), the 4-d
    # view below the softmax: one group of add, add, softmax
    assert len(report.groups) == 1, str(report)
    assert len(report.groups[0].nodes) == 3, str(report)


def test_broadcast_shapes_across_a_regrouping():
    def shape(operand, before, after):
        return _broadcast_after(torch.empty(operand), torch.empty(before), torch.empty(after))

    assert shape((1, 2, 7, 7), (8, 2, 7, 7), (2, 4, 2, 7, 7)) == (1, 1, 2, 7, 7)
    assert shape((5, 1), (3, 5, 7), (15, 7)) is None  # the merged dim mixes both kinds
    assert shape((3, 1, 1), (3, 5, 7), (3, 35)) == (3, 1)
    assert shape((6, 1), (6, 4), (2, 3, 4)) == (2, 3, 1)
    assert shape((4, 1), (4, 6), (8, 3)) is None  # 6 split 2 x 3 crosses 4 x 6 -> 8 x 3


def test_a_softmax_along_another_dim_keeps_its_reshape():
    def fn(x):
        y = (x * 2.0 + 1.0).view(6, 4)
        return torch.softmax(y.view(2, 3, 4), dim=1)

    x = torch.randn(2, 3, 4)
    gm, inputs = _graph_of(fn, x)
    move_reshapes_up(gm.graph)
    gm.recompile()
    softmax = next(n for n in gm.graph.nodes if "softmax" in str(n.target))
    assert softmax.kwargs.get("dim", softmax.args[1:2] and softmax.args[1]) == 1
    assert_close(gm(*inputs)[0], fn(x))


def _attention_in_fp32(q, k, cos, sin):
    """GPT-J's attention: the rotated q and k moved to [B, heads, T, D], cast to fp32."""
    q = (q * cos + q.flip(-1) * sin).permute(0, 2, 1, 3).to(torch.float32)
    k = (k * cos + k.flip(-1) * sin).permute(0, 2, 1, 3).to(torch.float32)
    return torch.matmul(q, k.transpose(-1, -2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_cast_after_a_permute_joins_the_group_before_it(dtype):
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 7, 3, 16, generator=g).to(dtype) for _ in range(2))
    cos, sin = (torch.randn(7, 1, 16, generator=g).to(dtype) for _ in range(2))
    actual, report = run_fused(_attention_in_fp32, q, k, cos, sin)
    # bf16: the interpreter truncates each rounding to bf16 where eager rounds to nearest
    # (helpers), about an ulp of q and k (0.0156 at [2, 4)); 16 products carry it into a sum
    tolerance = {"rtol": 0.05, "atol": 0.3} if dtype == torch.bfloat16 else {}
    assert_close(actual, eager(_attention_in_fp32, q, k, cos, sin), floor_dtype=dtype,
                 **tolerance)  # fmt: skip
    assert len(report.graphs[-1].rewrites.get("casts_moved", [])) == 2, report
    for group in report.groups:  # each group writes its rows in fp32: no cast kernel after it
        assert any(n.startswith("to") for n in group.nodes), str(report)
