"""Row kernels: norms, residual adds and gated activations, each ONE fused group, vs eager.

The matrix runs every pattern at fp32/fp16/bf16 over row widths that cover each code
layout: 1 (every value narrow), 7 and 127 (persistent, masked columns), 4097 (persistent,
BLOCK_D = 8192) and 8193 (chunked: two passes over the row), plus 0 rows. The interpreter
is slow, so the GPU-marked test in test_row_patterns_gpu.py runs the full widths (768,
2048, 8192, 11008).

Tolerances: helpers.TOLERANCES per output dtype (fp16 1e-2, bf16 2e-2: one ulp of the
final rounding; the interpreter truncates fp32 -> bf16, see helpers). fp32 reductions use
rtol = atol = 1e-5 instead of assert_close's 1.3e-6: the kernel sums a row as a tree,
eager in its own order, and the rounding error of a sum of n fp32 terms grows like
sqrt(n) * 6e-8 (5e-6 at n = 8193), which rsqrt and the product carry into the output.
bf16 norms: atol 0.0625, two bf16 ulps of the outputs' largest magnitudes ([4, 8)): a
decomposed norm rounds (x - mean), the product and the bias add to bf16 one after another,
as eager does, and the interpreter truncates each of those roundings where eager rounds to
nearest, so two ulps apart at an output near 5 was seen (0.047 at width 127).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import FLOAT_DTYPES, assert_close, eager, run_fused, single_group

V = 13  # table rows


def rms_decomposed(x, w):
    """transformers' LlamaRMSNorm.forward."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + 1e-6)
    return w * h.to(dtype)


def add_rms_functional(x, r, w):
    return F.rms_norm(x + r, (x.shape[-1],), w, 1e-6)


def add_layer_norm(x, r, w, b):
    return F.layer_norm(x + r, (x.shape[-1],), w, b, 1e-5)


def layer_norm_decomposed(x, w, b):
    mean = x.mean(-1, keepdim=True)
    centred = x - mean
    var = (centred * centred).mean(-1, keepdim=True)
    return centred * torch.rsqrt(var + 1e-5) * w + b


def residual_rms(x, r, w):
    """Two outputs: the residual sum (the next layer's residual) and its norm."""
    h = x + r
    return h, rms_decomposed(h, w)


def silu_gate(gate, up):
    return F.silu(gate) * up


def gelu_gate(x, y):
    return F.gelu(x, approximate="tanh") * y


def gelu_residual_layer_norm(x, r, w, b):
    return F.layer_norm(F.gelu(x) + r, (x.shape[-1],), w, b, 1e-12)


def lookup_rms(ids, table, w):
    """Llama: the lookup is the first residual and feeds the first RMSNorm."""
    h = F.embedding(ids, table)
    return h, rms_decomposed(h, w)


def bert_embeddings(ids, types, word, pos, typ, w, b):
    positions = torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)
    x = F.embedding(ids, word) + F.embedding(types, typ) + F.embedding(positions, pos)
    return F.layer_norm(x, (word.shape[-1],), w, b, 1e-12)


def _rand(*shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype)


def _args(name, lead, d, dtype, g):
    x = _rand(*lead, d, dtype=dtype, g=g)
    r = _rand(*lead, d, dtype=dtype, g=g)
    w = _rand(d, dtype=dtype, g=g)
    b = _rand(d, dtype=dtype, g=g)
    ids = torch.randint(0, V, lead, generator=g)
    table = _rand(V, d, dtype=dtype, g=g)
    return {
        "rms_decomposed": (x, w),
        "add_rms_functional": (x, r, w),
        "add_layer_norm": (x, r, w, b),
        "layer_norm_decomposed": (x, w, b),
        "residual_rms": (x, r, w),
        "silu_gate": (x, r),
        "gelu_gate": (x, r),
        "gelu_residual_layer_norm": (x, r, w, b),
        "lookup_rms": (ids, table, w),
        "bert_embeddings": (ids, torch.randint(0, 2, lead, generator=g), table,
                            _rand(64, d, dtype=dtype, g=g), _rand(2, d, dtype=dtype, g=g), w, b),
    }[name]  # fmt: skip


PATTERNS = {
    # name: (function, reductions in the group, lookups in the group)
    "rms_decomposed": (rms_decomposed, 1, 0),
    "add_rms_functional": (add_rms_functional, 1, 0),
    "add_layer_norm": (add_layer_norm, 1, 0),
    "layer_norm_decomposed": (layer_norm_decomposed, 2, 0),
    "residual_rms": (residual_rms, 1, 0),
    "silu_gate": (silu_gate, 0, 0),
    "gelu_gate": (gelu_gate, 0, 0),
    "gelu_residual_layer_norm": (gelu_residual_layer_norm, 1, 0),
    "lookup_rms": (lookup_rms, 1, 1),
    "bert_embeddings": (bert_embeddings, 1, 3),
}


def _check_pattern(name, lead, width, dtype, seed):
    fn, reductions, lookups = PATTERNS[name]
    g = torch.Generator().manual_seed(seed)
    args = _args(name, lead, width, dtype, g)
    expected = eager(fn, *args)
    actual, report = run_fused(fn, *args)
    override = {}
    if dtype == torch.float32 and reductions:
        override = {"rtol": 1e-5, "atol": 1e-5}
    elif dtype == torch.bfloat16 and reductions:
        override = {"rtol": 2e-2, "atol": 0.0625}  # two bf16 ulps of |x| in [4, 8)
    assert_close(actual, expected, **override)
    group = single_group(report)  # the whole pattern is ONE kernel
    assert len(group.reductions) == reductions, str(report)
    assert len(group.lookups) == lookups, str(report)
    outputs = len(expected) if isinstance(expected, tuple) else 1
    assert len(group.outputs) == outputs, str(report)
    return group


@pytest.mark.parametrize("width", [1, 7, 127, 4097, 8193])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_is_one_group(name, dtype, width):
    if width >= 4097 and dtype != torch.float32 and name not in ("rms_decomposed", "lookup_rms"):
        pytest.skip("wide rows: fp32 for every pattern, fp16/bf16 for the two RMSNorms "
                    "(interpreter time); the GPU test covers the rest")  # fmt: skip
    lead = (2, 3) if width < 4097 else (3,)
    group = _check_pattern(name, lead, width, dtype, seed=width)
    layout = "chunked" if width > 8192 and group.reductions else None
    if layout:
        assert "layout: chunked" in group.source


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_with_zero_rows(name, dtype):
    _check_pattern(name, (0, 5), 7, dtype, seed=1)


@pytest.mark.parametrize("name", ["rms_decomposed", "add_layer_norm", "bert_embeddings"])
def test_pattern_with_one_leading_dim(name):
    _check_pattern(name, (5,), 33, torch.float32, seed=2)


def test_lone_softmax_is_not_fused_and_says_why():
    # softmax alone is one kernel in eager too: fusing it would buy nothing.
    x = torch.randn(3, 16)
    out, report = run_fused(lambda x: x.softmax(-1), x, expect_fused=False)
    assert report.groups == []
    assert any("alone" in r.reason for r in report.rejections), str(report)
    assert_close(out, x.softmax(-1))


def test_lone_layer_norm_is_a_group():
    # aten's LayerNorm reads short rows slowly (ConvNeXt's 96-768 channels): a lone one runs
    # as a row kernel.
    x, w, b = torch.randn(5, 7, 96), torch.randn(96), torch.randn(96)
    out, report = run_fused(lambda x, w, b: F.layer_norm(x, (96,), w, b), x, w, b)
    assert [g.nodes for g in report.groups] == [("layer_norm",)], str(report)
    assert_close(out, F.layer_norm(x, (96,), w, b), rtol=1e-5, atol=1e-5)


def test_lone_elementwise_op_is_not_fused():
    x = torch.randn(3, 16)
    out, report = run_fused(lambda x: x * 2.0, x, expect_fused=False)
    assert report.groups == [] and report.graphs[0].path == "unfused (nothing to fuse)"
    assert_close(out, x * 2.0)


def test_identical_groups_share_one_kernel():
    # Two RMSNorms with different weights: one canonical program, one kernel name.
    def two_norms(x, w1, w2):
        return rms_decomposed(rms_decomposed(x, w1) @ torch.eye(16), w2)

    x, w1, w2 = torch.randn(2, 3, 16), torch.randn(16), torch.randn(16)
    expected = eager(two_norms, x, w1, w2)
    # matmul groups off: with them the first norm is the `@ eye` group's prologue
    actual, report = run_fused(two_norms, x, w1, w2, options={"matmul_groups": False})
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert len(report.groups) == 2, str(report)
    assert report.groups[0].kernel_name == report.groups[1].kernel_name


def test_non_keepdim_reduction_is_reported():
    x = torch.randn(3, 16)
    out, report = run_fused(lambda x: (x * 2).sum(-1) + 1, x, expect_fused=False)
    assert any("without keepdim=True" in r.reason for r in report.rejections), str(report)
    assert_close(out, (x * 2).sum(-1) + 1)


def test_view_of_a_group_value_stops_growth_with_the_reason():
    def fn(x, r):
        h = (x + r) * 2.0
        return h.view(-1) + 1.0, h  # (h is read twice: passes/reshapes.py leaves its view)

    x, r = torch.randn(2, 8), torch.randn(2, 8)
    out, report = run_fused(fn, x, r)
    assert any("a view (view) of a value computed in the group" in r.reason
               for r in report.rejections), str(report)  # fmt: skip
    assert_close(out, fn(x, r))


def test_views_of_external_operands_are_read_by_strides():
    # The transpose and the slice run outside the kernel; the kernel reads their strides.
    def fn(x, up, w):
        gate = x.transpose(0, 1)
        return rms_decomposed(F.silu(gate) * up[:, ::2], w)

    x, up, w = torch.randn(24, 5), torch.randn(5, 48), torch.randn(24)
    expected = eager(fn, x, up, w)
    actual, report = run_fused(fn, x, up, w)
    assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert len(single_group(report).reductions) == 1


def test_seed_whose_lookup_operand_closes_a_cycle():
    # Found by the fuzzer: maximum seeds a group, the lookup would join it as an operand,
    # but the matmul between them reads the lookup and feeds maximum. Before the cycle
    # check ran for seeds, the rewrite raised "the rewritten graph has a cycle".
    def fn(ids, table, square):
        e = F.embedding(ids, table)
        return torch.maximum(e @ square, e) * 2.0

    ids, table, square = torch.randint(0, V, (2, 3)), torch.randn(V, 8), torch.randn(8, 8)
    out, report = run_fused(fn, ids, table, square)
    assert_close(out, eager(fn, ids, table, square))
    assert "embedding" not in single_group(report).nodes, str(report)
    assert any("(a cycle)" in r.reason for r in report.rejections), str(report)


def t5_clamp_then_rms(h, w):
    """transformers' T5 (fp16): clamp to a bound chosen by whether any element is inf, then
    T5's RMSNorm."""
    clamp_value = torch.where(
        torch.isinf(h).any(),
        torch.finfo(h.dtype).max - 1000,
        torch.finfo(h.dtype).max,
    )
    h = torch.clamp(h, min=-clamp_value, max=clamp_value)
    return h, rms_decomposed(h, w)


@pytest.mark.parametrize("with_inf", [False, True])
def test_a_bound_computed_from_a_flag_joins_the_group_that_reads_it(with_inf):
    # The 0-d bound (where of the 0-d flag, and its negation) is computed in the kernel that
    # clamps: two launches fewer per clamp; the flag's last step (a bool per row reduced to
    # one) stays outside. With an inf the bound is max - 1000 and large values clamp.
    torch.manual_seed(5)
    h = (torch.randn(2, 5, 33) * 2e4).half()
    if with_inf:
        h[1, 2, 7] = float("-inf")
    w = torch.randn(33).half()
    expected = eager(t5_clamp_then_rms, h, w)
    actual, report = run_fused(t5_clamp_then_rms, h, w)
    assert_close(actual, expected)
    (nodes,) = [g.nodes for g in report.groups if "clamp_value" in g.nodes]
    assert {"clamp_value", "neg", "h"} <= set(nodes), str(report)  # h: the clamp
    # the flag: isinf and each row's any in one kernel (passes/full_reductions.py)
    assert any("isinf" in g.nodes and len(g.nodes) == 2 for g in report.groups), str(report)
    assert (expected[0].abs() == 64504).any() == with_inf  # the data reached each bound


def _flags(x):
    """Whole-tensor checks as models write them, each picking a value."""
    has_inf = torch.isinf(x).any()
    has_nan = torch.isnan(x).any()
    finite = torch.isfinite(x).all()
    return (
        torch.where(has_inf, 1.0, 0.0)
        + torch.where(has_nan, 2.0, 0.0)
        + torch.where(finite, 4.0, 0.0)
    )


@pytest.mark.parametrize("planted", ["none", "inf", "nan", "both"])
def test_whole_tensor_checks_reduce_rows_in_the_group_of_their_test(planted):
    # x.any() -> x.any(-1, keepdim=True).any() (passes/full_reductions.py): isinf/isnan/
    # isfinite and each row's any/all are one kernel, the last reduction a bool per row.
    torch.manual_seed(6)
    x = torch.randn(3, 4, 37)
    if planted in ("inf", "both"):
        x[2, 1, 36] = float("-inf")
    if planted in ("nan", "both"):
        x[0, 3, 0] = float("nan")
    actual, report = run_fused(_flags, x)
    assert actual.item() == eager(_flags, x).item()
    assert len(report.graphs[-1].rewrites.get("full_reductions", [])) == 3, str(report)
    tests = {n for g in report.groups for n in g.nodes if n.startswith("is")}
    assert tests == {"isinf", "isnan", "isfinite"}, str(report)
