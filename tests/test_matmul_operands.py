"""Batched-matmul operands copied once where they come from (passes/matmul_operands.py).

Attention written by hand over a packed q/k/v projection, as LeViT (split, then a permute
per piece) and Swin (one permute, then unbind) write it, at odd sizes and batch 3: outputs
equal eager's, one copy is made per attention, and every matmul operand left in the fused
graph goes to bmm uncopied. Batch 1 (the batch dims merge already) and separate q/k/v
projections (one operand per value) are left as traced. Swin's q scaled by a number is
scaled in the product (a baddbmm's alpha); a scale read elsewhere or a tensor scale is not.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
from helpers import assert_close, run_fused, timm_fp16_replayed

import fusebackend
from fusebackend.passes.matmul_operands import _bmm_ready


class PackedAttention(nn.Module):
    """Attention over one q/k/v projection. ``style``: "levit" (``view(B, N, heads, -1)
    .split(...)``, each piece permuted; k to (B, heads, d, N)), "swin" (``reshape(B, N, 3,
    heads, d).permute(2, 0, 3, 1, 4).unbind(0)``, q scaled) or "heads_first" (the pieces
    permuted to (heads, B, N, d): a layout order that is not its own inverse)."""

    def __init__(self, dim: int = 20, heads: int = 2, key: int = 6, value: int = 8,
                 style: str = "levit") -> None:  # fmt: skip
        super().__init__()
        if style == "swin":  # q, k and v of one width
            value = key
        self.heads, self.key, self.value, self.style = heads, key, value, style
        self.qkv = nn.Linear(dim, heads * (2 * key + value))
        self.proj = nn.Linear(heads * value, dim)
        # per head, as a relative position bias (heads lead in "heads_first")
        self.bias = nn.Parameter(torch.randn(heads, *[1] * (3 if style == "heads_first" else 2)))
        self.scale = key**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        if self.style == "swin":
            qkv = self.qkv(x).reshape(B, N, 3, self.heads, self.key).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            attn = (q * self.scale) @ k.transpose(-2, -1) + self.bias
            out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, N, -1)
            return self.proj(out)
        sizes = [self.key, self.key, self.value]
        q, k, v = self.qkv(x).view(B, N, self.heads, -1).split(sizes, dim=3)
        if self.style == "heads_first":
            q, k, v = (t.permute(2, 0, 1, 3) for t in (q, k, v))
            attn = (q @ k.transpose(-2, -1)) * self.scale + self.bias
            out = (attn.softmax(dim=-1) @ v).permute(1, 2, 0, 3).reshape(B, N, -1)
            return self.proj(out)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)
        attn = (q @ k) * self.scale + self.bias
        out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, N, -1)
        return self.proj(out)


def _matmul_operands(report) -> list[torch.Tensor]:
    graph = report.graphs[-1].runtime._fused.graph
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (operator.matmul, torch.matmul):
            values = [a.meta["example_value"] for a in node.args]
            batch = torch.broadcast_shapes(values[0].shape[:-2], values[1].shape[:-2])
            found += [(v, batch) for v in values]
    return found


def _meta(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(value.shape, value.stride(), device="meta")


@pytest.mark.parametrize("style", ["levit", "swin", "heads_first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_copies_its_operands_once_and_equals_eager(style, dtype):
    torch.manual_seed(3)
    model = PackedAttention(style=style).eval().to(dtype)
    x = torch.randn(3, 11, 20, dtype=dtype)
    before = [(v, b) for v, b in _traced_operands(model, x)]
    assert sum(not _bmm_ready(_meta(v), b) for v, b in before) >= 2  # what ATen would copy
    out, report = run_fused(model, x)
    with torch.no_grad():
        assert_close(out, model(x))
    copies = report.graphs[-1].rewrites.get("matmul_operands_copied", [])
    assert len(copies) == 1, report
    operands = _matmul_operands(report)
    assert operands and all(_bmm_ready(_meta(v), b) for v, b in operands)


def _traced_operands(model: nn.Module, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Size]]:
    """The matmul operands of ``model(x)`` as eager computes them (their strides)."""
    found = []
    original = torch.Tensor.__matmul__

    def spy(a, b):
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        if a.dim() >= 3 and b.dim() >= 3:
            found.extend([(a, batch), (b, batch)])
        return original(a, b)

    torch.Tensor.__matmul__ = spy
    try:
        with torch.no_grad():
            model(x)
    finally:
        torch.Tensor.__matmul__ = original
    return found


def test_batch_one_and_separate_projections_are_left_as_traced():
    torch.manual_seed(4)
    model = PackedAttention(style="levit").eval()
    _, report = run_fused(model, torch.randn(1, 9, 20))  # batch dims of one merge already
    assert not report.graphs[-1].rewrites.get("matmul_operands_copied")

    class Separate(nn.Module):  # transformers' eager attention: one value per operand
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(12, 12), nn.Linear(12, 12)

        def forward(self, x):
            B, N, _ = x.shape
            q = self.q(x).view(B, N, 2, 6).transpose(1, 2)
            k = self.k(x).view(B, N, 2, 6).transpose(1, 2)
            return (q @ k.transpose(-2, -1)).softmax(-1)

    model = Separate().eval()
    x = torch.randn(3, 7, 12)
    out, report = run_fused(model, x, expect_fused=False)
    with torch.no_grad():
        assert_close(out, model(x))
    assert not report.graphs[-1].rewrites.get("matmul_operands_copied")


def test_bmm_ready_follows_atens_copy_rule():
    packed = torch.empty(3, 11, 2, 20, device="meta")  # (B, N, heads, c)
    q = packed[..., :6].permute(0, 2, 1, 3)  # (B, heads, N, d): batch strides do not merge
    assert not _bmm_ready(q, torch.Size([3, 2]))
    assert _bmm_ready(q[:1], torch.Size([1, 2]))  # a batch of one merges
    assert _bmm_ready(q.contiguous().transpose(-2, -1), torch.Size([3, 2]))  # column-major
    every_other = torch.empty(3, 2, 11, 12, device="meta")[..., ::2]  # no unit stride
    assert not _bmm_ready(every_other, torch.Size([3, 2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("name", "copies", "left"),
    [("levit_128s", 11, 2), ("swin_tiny_patch4_window7_224", 12, 0)],
)
def test_timm_attention_copies_its_packed_qkv_once_and_equals_eager(name, copies, left):
    # LeViT: its 11 attentions' q, k and v split from one projection (batch 2: the batch dims
    # do not merge); left copied by ATen: the q of its 2 subsampling attentions, each from a
    # projection of its own. Swin: its 12 blocks' k and v unbound from one (windows x heads)
    timm_fp16_replayed(name, 224, seed=7)
    report = fusebackend.last_report()
    assert len(report.graphs[-1].rewrites.get("matmul_operands_copied", [])) == copies, report
    assert sum(not _bmm_ready(_meta(v), b) for v, b in _matmul_operands(report)) == left


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_scaled_by_a_number_is_scaled_in_the_matmul(dtype):
    torch.manual_seed(8)
    model = PackedAttention(style="swin").eval().to(dtype)
    x = torch.randn(3, 11, 20, dtype=dtype)
    out, report = run_fused(model, x)
    with torch.no_grad():
        assert_close(out, model(x))
    graph = report.graphs[-1]
    assert graph.rewrites.get("matmul_scales") == ["mul"], report
    fused = graph.runtime._fused.graph
    assert [n.kwargs["alpha"] for n in fused.nodes if n.target is torch.baddbmm] == [
        pytest.approx(model.scale)
    ]
    assert not any(n.target is operator.mul for n in fused.nodes)


def test_a_scale_read_elsewhere_or_a_tensor_stays_a_multiply():
    class Scaled(nn.Module):
        def forward(self, q, k, s):
            by_number = q * 0.25
            return (by_number @ k).softmax(-1), by_number + 1.0, ((q * s) @ k).softmax(-1)

    q, k, s = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 8, 5), torch.randn(())
    out, report = run_fused(Scaled(), q, k, s)
    with torch.no_grad():
        assert_close(out, Scaled()(q, k, s))
    assert not report.graphs[-1].rewrites.get("matmul_scales")


def test_symbolic_sizes_are_left_as_traced_and_equal_eager():
    # dynamic=True: layouts are decided from plain-int strides, so nothing is copied or scaled
    torch.manual_seed(9)
    model = PackedAttention(style="swin").eval()
    compiled = torch.compile(model, backend="infinifuse", dynamic=True,
                             options={"validate": False})  # fmt: skip
    for length in (5, 9, 13):
        x = torch.randn(3, length, 20)
        with torch.no_grad():
            assert_close(compiled(x), model(x))
    rewrites = fusebackend.last_report().graphs[-1].rewrites
    assert fusebackend.last_report().graphs[-1].path == "fused"
    assert not rewrites.get("matmul_operands_copied") and not rewrites.get("matmul_scales")
