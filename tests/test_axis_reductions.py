"""Reductions over a dim other than the last join the group of the elementwise ops after them
(passes/axis_reductions.py): one kernel, equal to eager, at odd shapes and in three dtypes;
left to aten where the tensor is large, nothing elementwise follows, or keepdim is asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, compile_fused, eager, row_groups, single_group

import fusebackend
from fusebackend.passes.axis_reductions import MAX_ELEMENTS


def _rewritten() -> list[str]:
    return fusebackend.last_report().graphs[-1].rewrites.get("axis_reductions", [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_levit_head_mean_and_both_batch_norms_are_one_kernel(dtype):
    """timm LeViT's eval head: the mean over tokens, then each head's BatchNorm1d (as a
    folded scale and shift in fp32) and an eval dropout; two outputs."""
    torch.manual_seed(0)
    c = 37
    stats = [(torch.randn(c), torch.rand(c) + 0.5, torch.randn(c)) for _ in range(2)]

    def fn(x):
        m = x.mean(1)
        outs = []
        for center, scale, shift in stats:
            y = ((m.float() - center) * scale + shift).to(x.dtype)
            outs.append(F.dropout(y, 0.1, False))
        return outs

    report = check(fn, (torch.randn(3, 7, c) * 2).to(dtype))
    assert _rewritten() == ["m"]
    group = single_group(report)
    assert group.nodes[0] == "mean" and len(group.outputs) == 2, str(report)


@pytest.mark.parametrize(
    "shape,dim,kind",
    [
        ((2, 5, 3, 11), 1, "sum"),
        ((6, 9, 13), 0, "amax"),
        ((4, 3, 10), -2, "amin"),
        ((2, 9, 5), (1,), "mean"),
    ],  # fmt: skip
)
def test_reductions_over_other_dims_then_elementwise(shape, dim, kind):
    torch.manual_seed(1)
    bias = torch.randn(shape[-1])

    def fn(x, s):
        r = getattr(torch, kind)(x, dim)
        return torch.tanh(r * s + bias), r  # the reduction itself is an output too

    report = check(fn, torch.randn(shape), torch.tensor(0.7))
    assert len(_rewritten()) == 1
    group = single_group(report)
    assert group.nodes[0].startswith(kind), str(report)  # the reduction leads its group
    out, r = torch.compile(fn, backend="infinifuse")(torch.randn(shape), torch.tensor(0.7))
    assert r.shape == getattr(torch, kind)(torch.randn(shape), dim).shape  # squeezed back


def test_pooling_sum_divided_by_counts():
    """A masked mean pooling's last step, ``sum(h * mask, 1) / counts``: the sum and the
    division in one kernel."""
    torch.manual_seed(2)

    def fn(h, mask):
        summed = (h * mask[..., None]).sum(1)
        counts = torch.clamp(mask.sum(1, keepdim=True), min=1e-9)
        return summed / counts

    mask = (torch.rand(3, 8) > 0.3).float()
    check(fn, torch.randn(3, 8, 20), mask)
    assert _rewritten() == ["summed"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sentence_transformers_mean_pooling_is_one_kernel(dtype):
    """sentence-transformers' ``Pooling`` (mean) as it is written: the masked product, both
    sums over the tokens, the clamp and the division in one group."""
    torch.manual_seed(3)

    def pool(h, mask):
        expanded = mask.unsqueeze(-1).expand(h.size()).to(h.dtype)
        return torch.sum(h * expanded, 1) / torch.clamp(expanded.sum(1), min=1e-9)

    mask = (torch.rand(4, 11) > 0.4).to(torch.int64)
    mask[:, 0] = 1
    report = check(pool, torch.randn(4, 11, 24).to(dtype), mask)
    assert len(_rewritten()) == 2
    group = single_group(report)
    ops = {name.rstrip("_0123456789") for name in group.nodes}
    assert {"mul", "sum", "clamp", "truediv"} <= ops, str(report)


def test_two_reductions_divided_are_one_kernel():
    """``a.sum(1) / b.sum(1)``: the second reduction's only reader is the first's region."""
    torch.manual_seed(4)
    report = check(lambda a, b: a.sum(1) / b.sum(1), torch.randn(3, 6, 10), torch.rand(3, 6, 10))
    assert len(_rewritten()) == 2
    assert len(single_group(report).nodes) == 3, str(report)


def test_a_product_with_a_write_before_the_reduction_stays_where_it_is():
    """The product is not computed again after an in-place write it could read."""

    def fn(h, scale):
        p = h * scale
        scale.mul_(2.0)  # written between the product and the sum
        return torch.relu(p.sum(1)) + scale.sum()

    h = torch.randn(2, 5, 7)
    expected = eager(fn, h, torch.tensor(1.5))
    scale = torch.tensor(1.5)
    with torch.no_grad():
        actual = compile_fused(fn)(h, scale)
    assert_close(actual, expected)
    assert scale.item() == 3.0
    assert _rewritten() == ["sum_1"]
    (group,) = [g for g in row_groups(fusebackend.last_report().graphs[-1]) if "relu" in g.nodes]
    assert not any(name.startswith("mul") for name in group.nodes), group.nodes


def test_left_to_aten_without_elementwise_users_large_tensors_or_keepdim():
    def alone(x):
        return x.mean(1)  # nothing to fuse with: aten's reduction reads coalesced

    def kept(x):
        return torch.relu(x.mean(1, keepdim=True))

    def large(x):
        return torch.relu(x.sum(1))

    check(lambda x: (alone(x), torch.relu(x) * 2), torch.randn(2, 4, 8))  # (a group beside)
    assert _rewritten() == []
    # only an eval dropout after it (a classifier head's pool, dropout, linear): nothing saved
    check(lambda x: (F.dropout(alone(x), 0.1, False), torch.relu(x) * 2), torch.randn(2, 4, 8))
    assert _rewritten() == []
    check(lambda x: torch.relu(x) + kept(x), torch.randn(2, 4, 8))
    assert _rewritten() == []
    rows = MAX_ELEMENTS // 64 + 1
    report = check(lambda x: large(x) * 2, torch.randn(2, rows, 32))
    assert _rewritten() == []
    assert all(not g.nodes[0].startswith("sum") for g in row_groups(report))
