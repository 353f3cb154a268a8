"""Row kernels, step (c): rotary embeddings (``rotate_half``), softmax / log_softmax with the
scale and mask before them, and upstream growth (LayerNorm written with ``x.var``), each ONE
fused group, vs eager.

Widths: RoPE at head dims 2, 6, 7 (odd: ``rotate_half`` rotates by D // 2), 64 and 128;
softmax at 1 (every value narrow), 7, 127, 4097 (persistent, BLOCK_D = 8192) and 8193
(chunked: max, sum and store passes over the row).

Tolerances: helpers.TOLERANCES per output dtype. RoPE is two products and a sum per element,
each rounded to the dtype as eager does; in bf16 the interpreter truncates where eager rounds
to nearest, so where the two products nearly cancel the sum is up to two product ulps off
(0.03125 seen at |q| in [2, 4)): bf16 RoPE uses atol = 0.0625 (two ulps of |q| < 8).
softmax in fp32: rtol = atol = 1e-5 (the kernel
sums a row as a tree, eager in its own order: ~sqrt(n) * 6e-8 relative, 5e-6 at n = 8193).
Half-precision softmax is computed in fp32 and rounded once, as eager does: one ulp of the
result dtype (helpers' 1e-2 / 2e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import FLOAT_DTYPES, assert_close, eager, run_fused, single_group

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402


def rotate_half(x):
    """transformers' rotate_half."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_slices(q, cos, sin):
    return q * cos + rotate_half(q) * sin


def rope_chunk(q, cos, sin):
    a, b = q.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1) * sin + q * cos  # rotation first: it seeds the group


def rope_split(q, cos, sin):
    half = q.shape[-1] // 2
    a, b = torch.split(q, [half, q.shape[-1] - half], dim=-1)
    return q * cos + torch.cat([b.neg(), a], dim=-1) * sin


def rope_llama_views(x, w, cos, sin):
    """As LlamaAttention calls it: q a view of a projection, cos/sin [B, T, Dh] unsqueezed."""
    b, t, _ = x.shape
    q = (x @ w).view(b, t, 2, -1).transpose(1, 2)
    return rope_slices(q, cos.unsqueeze(1), sin.unsqueeze(1))


ROPE = {"slices": rope_slices, "chunk": rope_chunk, "split": rope_split}


def _rand(*shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype)


def _rope_tolerance(dtype):
    return {"rtol": 2e-2, "atol": 0.0625} if dtype == torch.bfloat16 else {}


@pytest.mark.parametrize("width", [2, 6, 7, 64, 128])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("form", sorted(ROPE))
def test_rope_is_one_group(form, dtype, width):
    fn = ROPE[form]
    g = torch.Generator().manual_seed(width)
    q = _rand(2, 3, 5, width, dtype=dtype, g=g)
    angles = torch.rand(5, width, generator=g) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = eager(fn, q, cos, sin)
    actual, report = run_fused(fn, q, cos, sin)
    assert_close(actual, expected, **_rope_tolerance(dtype))
    group = single_group(report)
    assert len(group.moves) == 1 and not group.reductions, str(report)
    assert "rotate(" in group.source and len(group.outputs) == 1
    assert len(group.inputs) == 3, str(report)  # q, cos and sin: no slice is an input


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_rope_of_strided_views_as_llama_calls_it(dtype):
    g = torch.Generator().manual_seed(3)
    x, w = _rand(2, 5, 16, dtype=dtype, g=g), _rand(16, 64, dtype=dtype, g=g)
    cos, sin = _rand(2, 5, 32, dtype=dtype, g=g), _rand(2, 5, 32, dtype=dtype, g=g)
    expected = eager(rope_llama_views, x, w, cos, sin)
    actual, report = run_fused(rope_llama_views, x, w, cos, sin)
    assert_close(actual, expected, **_rope_tolerance(dtype))
    assert len(single_group(report).moves) == 1, str(report)


def test_transformers_apply_rotary_pos_emb_q_and_k():
    # q and k have different head counts (grouped-query attention): one kernel each.
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 4, 5, 32, generator=g), torch.randn(2, 2, 5, 32, generator=g)
    cos, sin = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    expected = eager(apply_rotary_pos_emb, q, k, cos, sin)
    actual, report = run_fused(apply_rotary_pos_emb, q, k, cos, sin)
    assert_close(actual, expected)
    assert len(report.groups) == 2 and all(len(gr.moves) == 1 for gr in report.groups)


def test_rotation_of_a_computed_value_is_reported_and_correct():
    # h lives in the first kernel's registers: its columns cannot be reloaded permuted, so
    # the first kernel writes h out and the rotation's kernel reads it back by strides.
    def fn(q, cos, sin):
        h = q * 2.0 + 1.0
        return h * cos + rotate_half(h) * sin

    q, cos, sin = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    actual, report = run_fused(fn, q, cos, sin)
    assert_close(actual, eager(fn, q, cos, sin))
    assert any("rotate_half of h, a value computed in the group" in r.reason
               for r in report.rejections), str(report)  # fmt: skip
    assert len(report.groups) == 2 and len(report.groups[1].moves) == 1, str(report)


def test_cat_that_is_not_a_rotation_is_a_concatenation():
    """Overlapping slices rotate nothing: the cat is read as a concatenation of the two
    slices (passes/concatenation.py), not as a rotation."""

    def fn(x, y):
        return torch.cat((x[..., 1:], x[..., :2]), -1) * y  # overlapping slices

    x, y = torch.randn(3, 8), torch.randn(3, 9)
    actual, report = run_fused(fn, x, y)
    assert_close(actual, eager(fn, x, y))
    (group,) = report.groups
    assert group.moves == ("cat",) and "rotate(" not in group.source, str(report)


def test_rotation_whose_slice_is_used_elsewhere_stays_eager():
    def fn(q, sin):
        x1 = q[..., :4]
        return torch.cat((-q[..., 4:], x1), -1) * sin, x1 * 3.0

    q, sin = torch.randn(3, 8), torch.randn(8)
    actual, _ = run_fused(fn, q, sin, expect_fused=False)
    assert_close(actual, eager(fn, q, sin))


# -- softmax -------------------------------------------------------------------------------


def scaled_masked_softmax(x, mask):
    return (x * 0.125 + mask).softmax(-1)


def softmax_fp32(x, mask):
    """transformers' eager attention: softmax in fp32, then back to the input's dtype."""
    return F.softmax(x + mask, dim=-1, dtype=torch.float32).to(x.dtype)


def log_softmax_scaled(x, mask):
    return torch.log_softmax(x * 2.0 + mask, dim=-1)


SOFTMAX = {"scaled_masked": scaled_masked_softmax, "fp32": softmax_fp32,
           "log": log_softmax_scaled}  # fmt: skip


def _mask(lead, width, dtype, g):
    """An additive mask: 0 or dtype's most negative value (transformers' causal mask)."""
    keep = torch.rand(*lead[:-1], 1, width, generator=g) < 0.7
    keep[..., 0] = True  # every row keeps a column
    return torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)


@pytest.mark.parametrize("width", [1, 7, 127, 4097, 8193])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SOFTMAX))
def test_softmax_is_one_group(name, dtype, width):
    if width >= 4097 and (dtype != torch.float32 and name != "scaled_masked"):
        pytest.skip("wide rows: fp32 for each form, every dtype for one (interpreter time)")
    fn = SOFTMAX[name]
    lead = (2, 2, 3) if width < 4097 else (1, 3)
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(*lead, width, generator=g) * 3).to(dtype)
    mask = _mask(lead, width, dtype, g)
    expected = eager(fn, x, mask)
    actual, report = run_fused(fn, x, mask)
    override = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    assert_close(actual, expected, **override)
    group = single_group(report)
    assert len(group.reductions) == 1 and len(group.outputs) == 1, str(report)
    if width > 8192:
        assert "layout: chunked" in group.source


def test_softmax_with_zero_rows():
    x, mask = torch.randn(0, 4, 7), torch.zeros(4, 7)
    actual, report = run_fused(scaled_masked_softmax, x, mask)
    assert actual.shape == (0, 4, 7) and len(single_group(report).reductions) == 1


def test_softmax_of_a_fully_masked_row_is_nan_as_eager():
    x = torch.randn(2, 5)
    mask = torch.zeros(2, 5)
    mask[1] = float("-inf")
    actual, _ = run_fused(scaled_masked_softmax, x, mask)
    expected = eager(scaled_masked_softmax, x, mask)
    assert torch.isnan(expected[1]).all()
    assert_close(actual, expected, equal_nan=True)


def test_softmax_over_another_dim_is_not_fused():
    x = torch.randn(3, 4, 5)
    out, report = run_fused(lambda x: (x * 2).softmax(1), x, expect_fused=False)
    assert_close(out, (x * 2).softmax(1))
    assert any("not the last dim" in r.reason for r in report.rejections), str(report)


# -- upstream growth -----------------------------------------------------------------------


def layer_norm_var(x, w, b):
    """LayerNorm written with x.var: the mean seeds, the variance joins upstream."""
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)
    return (x - mean) / torch.sqrt(var + 1e-5) * w + b


@pytest.mark.parametrize("width", [1, 7, 127])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_layer_norm_with_var_is_one_group(dtype, width):
    g = torch.Generator().manual_seed(width)
    x, w, b = (_rand(*s, dtype=dtype, g=g) for s in ((2, 3, width), (width,), (width,)))
    expected = eager(layer_norm_var, x, w, b)
    actual, report = run_fused(layer_norm_var, x, w, b)
    override = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    if dtype == torch.bfloat16:
        override = {"rtol": 2e-2, "atol": 0.0625}  # as test_row_patterns: two bf16 ulps
    assert_close(actual, expected, **override)
    group = single_group(report)
    assert len(group.reductions) == 2, str(report)  # mean and var in one kernel


def test_producer_read_outside_the_group_stays_an_operand():
    # t feeds the first group but is also reduced outside it: taking it in upstream would
    # need an output the group does not have, so it stays an operand (its own group).
    def fn(x, y):
        h = x * 2.0 + 1.0
        t = torch.sigmoid(y) * 3.0
        return h * t, t.sum(-1)

    x, y = torch.randn(3, 8), torch.randn(3, 8)
    actual, report = run_fused(fn, x, y)
    assert_close(actual, eager(fn, x, y))
    assert len(report.groups) == 2, str(report)
    first = next(g for g in report.groups if "mul" in g.nodes)
    assert "sigmoid" not in first.nodes, str(report)


# --- a row max over padded columns: rows whose every value is negative


def _half_softmax(x):
    return (x * 0.5).softmax(-1)


def _half_log_softmax(x):
    return torch.log_softmax(x * 0.5, dim=-1)


def _half_minus_row_max(x):
    y = x * 0.5
    return y - y.amax(-1, keepdim=True)


ROW_MAX_FORMS = {
    "softmax": _half_softmax,
    "log_softmax": _half_log_softmax,
    "minus_amax": _half_minus_row_max,
}


@pytest.mark.parametrize("width", [7, 127])  # not powers of two: the kernel pads the row
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("form", sorted(ROW_MAX_FORMS))
def test_row_max_of_rows_whose_every_value_is_negative(form, dtype, width):
    """Log-probabilities, scores far below zero: the row max is negative, and a softmax of
    such rows underflows to 0 / 0 unless it subtracts the true max. Guards a row max that
    lets the padded columns count (as 0): tools/mutation_check.py's
    softmax_max_padding_is_zero."""
    fn = ROW_MAX_FORMS[form]
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(2, 3, width, generator=g) - 400.0).to(dtype)
    actual, _ = run_fused(fn, x)
    assert_close(actual, eager(fn, x))


def test_softmax_of_negative_rows_in_the_chunked_layout():
    """Rows wider than the persistent limit loop over chunks: the running max must start
    below every value, not at 0 (softmax_max_padding_is_zero)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 8193, generator=g) - 400.0
    actual, report = run_fused(_half_softmax, x)
    assert "layout: chunked" in report.groups[0].source
    assert_close(actual, eager(_half_softmax, x))


def rotate_every_two(x):
    """transformers' GPT-J (and CodeGen) rotate_every_two."""
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def rope_interleaved(q, cos, sin):
    return q * cos + rotate_every_two(q) * sin


@pytest.mark.parametrize("width", [2, 6, 64])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_interleaved_rope_is_one_group(dtype, width):
    # Each pair of columns swapped, the first of the pair negated: the kernel loads q at
    # the pair's other column; the slices, negation, stack and flatten launch nothing.
    g = torch.Generator().manual_seed(width + 1)
    q = _rand(2, 5, 3, width, dtype=dtype, g=g)
    angles = torch.rand(5, 1, width, generator=g) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = eager(rope_interleaved, q, cos, sin)
    actual, report = run_fused(rope_interleaved, q, cos, sin)
    assert_close(actual, expected, **_rope_tolerance(dtype))
    group = single_group(report)
    assert {"x", "neg", "flatten"} <= set(group.nodes), str(report)  # x: the stack
    assert "swap_pairs(" in group.source and len(group.inputs) == 3, str(report)


def test_a_stack_of_every_other_column_that_swaps_nothing_is_left_alone():
    # stack((x[..., ::2], x[..., 1::2]), -1).flatten(-2) is x itself, not a rotation
    def fn(q, cos):
        same = torch.stack((q[:, :, :, ::2], q[:, :, :, 1::2]), dim=-1).flatten(-2)
        return q * cos + same * 2.0

    g = torch.Generator().manual_seed(9)
    q, cos = torch.randn(2, 3, 4, 8, generator=g), torch.randn(8, generator=g)
    actual, report = run_fused(fn, q, cos)
    assert_close(actual, eager(fn, q, cos))
    assert all("swap_pairs(" not in gr.source for gr in report.groups), str(report)


def rope_partial_neox(q, cos, sin, rotary):
    """transformers' GPT-NeoX / Phi / StableLM: only the first ``rotary`` columns rotate."""
    q_rot, q_pass = q[..., :rotary], q[..., rotary:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1)


def rope_partial_gptj(q, cos, sin, rotary):
    """transformers' GPT-J: the first ``rotary`` columns rotate pairwise."""
    q_rot, q_pass = q[:, :, :, :rotary], q[:, :, :, rotary:]
    q_rot = q_rot * cos + rotate_every_two(q_rot) * sin
    return torch.cat([q_rot, q_pass], dim=-1)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("form", [rope_partial_neox, rope_partial_gptj], ids=["neox", "gptj"])
def test_partial_rotary_is_one_group_over_the_whole_head(form, dtype):
    # x * cos' + rotate(x, width=r) * sin' over the head (cos' padded with ones, sin' with
    # zeros): the pass-through columns come out as x, and no cat runs.
    g = torch.Generator().manual_seed(11)
    q = _rand(2, 5, 3, 24, dtype=dtype, g=g)
    q[0, 0, 0, -1] = -0.0  # (a pass-through zero keeps its value)
    angles = torch.rand(5, 1, 8, generator=g) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = eager(form, q, cos, sin, 8)
    actual, report = run_fused(form, q, cos, sin, 8)
    assert_close(actual, expected, **_rope_tolerance(dtype))
    assert torch.equal(actual[..., 8:], q[..., 8:])  # passed through exactly
    graph = report.graphs[-1]
    assert len(graph.rewrites.get("partial_rotary", [])) == 1, graph.rewrites
    group = single_group(report)
    assert "width=8" in group.source and not any("cat" in n for n in group.nodes), str(report)


def test_partial_rotary_whose_pass_part_is_read_elsewhere_keeps_its_cat():
    def fn(q, cos, sin):
        q_pass = q[..., 8:]
        return rope_partial_neox(q, cos, sin, 8), q_pass * 2.0

    g = torch.Generator().manual_seed(12)
    q, cos, sin = torch.randn(2, 3, 4, 24, generator=g), torch.randn(4, 8), torch.randn(4, 8)
    actual, report = run_fused(fn, q, cos, sin)
    assert_close(actual, eager(fn, q, cos, sin))
    assert report.graphs[-1].rewrites.get("partial_rotary") in (None, []), report
