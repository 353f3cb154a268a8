"""Copies that no group takes in, run as a row kernel of their own (passes/lone_copies.py).

A packed q/k/v permuted and copied after its linear, and an attention output's
``transpose(1, 2).reshape`` read by a linear (Swin's two such copies a block), at odd sizes:
outputs equal eager's, each copy is a group of its own node in the report, no copy is left
in the fused graph, and a copy returned from the graph is contiguous as ``.contiguous()``
makes it. A transpose of the last two dims, short rows, integer tensors and a clone that keeps
its source's strides stay ATen's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import assert_close, run_fused

from fusebackend.passes.folded_copies import moves_elements_by_copy


class PermutedLinear(nn.Module):
    """A linear's output permuted to (3, B, heads, N, d) and copied; attention over its
    parts, whose (B, heads, N, d) output a transposing reshape makes (B, N, heads * d), read
    by another linear."""

    def __init__(self, dim: int = 20, heads: int = 2, d: int = 17) -> None:
        super().__init__()
        self.heads, self.d = heads, d
        self.qkv = nn.Linear(dim, 3 * heads * d)
        self.proj = nn.Linear(heads * d, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        qkv = qkv.contiguous()
        mixed = (qkv[0] @ qkv[1].transpose(-2, -1)).softmax(-1) @ qkv[2]
        out = mixed.transpose(1, 2).reshape(B, N, -1)
        return (self.proj(out) + 1.0).relu(), qkv


def _fused_copies(report) -> list[str]:
    graph = report.graphs[-1].runtime._fused.graph
    return [n.name for n in graph.nodes if moves_elements_by_copy(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copies_after_a_linear_and_before_one_run_as_row_kernels(dtype):
    torch.manual_seed(2)
    model = PermutedLinear().eval().to(dtype)
    x = torch.randn(3, 13, 20, dtype=dtype)
    (out, qkv), report = run_fused(model, x)
    with torch.no_grad():
        expected, expected_qkv = model(x)
    assert_close(out, expected)
    assert torch.equal(qkv, expected_qkv)  # a copy moves values, computes nothing
    assert qkv.is_contiguous() and qkv.stride() == expected_qkv.stride()
    graph = report.graphs[-1]
    copies = graph.rewrites.get("copies_as_row_kernels", [])
    assert len(copies) == 2, report
    alone = [g for g in graph.groups if g.nodes in ((c,) for c in copies)]
    assert len(alone) == 2 and all(g.backend == "triton" for g in alone)
    assert not _fused_copies(report)


def test_transposed_rows_short_rows_and_integers_stay_atens():
    class Left(nn.Module):
        def forward(self, x, w, ids) -> tuple[torch.Tensor, ...]:
            y = x @ w  # not a group's output: no group takes the copies in
            return (
                (x + 1.0).relu(),  # a group, so the graph is fused
                y.transpose(-1, -2).contiguous(),  # its last dim is not unit-stride
                y[..., :8].permute(1, 0, 2).contiguous(),  # rows of 8
                ids.permute(1, 0, 2).contiguous(),  # integers
                y.permute(1, 0, 2).clone(),  # keeps its dense source's strides
            )

    x, w, ids = torch.randn(5, 20, 24), torch.randn(24, 24), torch.randint(0, 9, (5, 6, 24))
    out, report = run_fused(Left(), x, w, ids)
    with torch.no_grad():
        for got, want in zip(out, Left()(x, w, ids), strict=True):
            assert_close(got, want)
            assert got.stride() == want.stride()
    assert not report.graphs[-1].rewrites.get("copies_as_row_kernels")
    assert len(_fused_copies(report)) == 4
