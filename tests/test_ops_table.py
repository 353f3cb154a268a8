"""One row per op of the elementwise op table (and per spelling), each run through the
compiled backend right after an embedding lookup and compared with eager.

Adding an op to ``fusebackend.passes.ops.OP_TABLE`` without a row here fails
``test_every_op_has_a_row``.
"""

from __future__ import annotations

import dataclasses
import operator
import zlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import FLOAT_DTYPES, assert_close, eager, rand_ids, rand_table, run_fused, single_group

from fusebackend.passes.ops import OP_TABLE, lookup_op

V, B, T, D = 23, 2, 5, 19


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    op: str  # canonical name in OP_TABLE
    fn: Callable  # fn(x, y): x = the lookup's value, y = a random float tensor like x
    domain: str = "any"  # table values: "any" (|v| in [0.05, 2.05), random sign),
    # "positive" (same magnitudes, positive), "ints" (integers in [-2, 2])
    nodes: int = 2  # nodes the group must absorb (lookup included)
    equal_nan: bool = False  # eager itself gives NaN somewhere; positions must agree
    other_groups: int = 0  # groups of ops on y alone, beside the lookup's group


def _rotate_half(x):
    """transformers' rotate_half (rotary embeddings)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _hi(y):
    return y.abs() + 0.5


ROWS = [
    # add: tensor + tensor, + scalar, alpha, reflected, broadcast [D]
    Row("add-operator", "add", lambda x, y: x + y),
    Row("add-torch-alpha", "add", lambda x, y: torch.add(x, y, alpha=2)),
    Row("add-method-scalar", "add", lambda x, y: x.add(1.5)),
    Row("add-scalar-float-alpha", "add", lambda x, y: torch.add(x, 2, alpha=-0.5)),
    Row("add-reflected", "add", lambda x, y: 3 + x),
    Row("add-broadcast-row", "add", lambda x, y: x + y[0, 0]),
    # sub
    Row("sub-operator", "sub", lambda x, y: x - y),
    Row("sub-torch-alpha", "sub", lambda x, y: torch.sub(x, y, alpha=0.5)),
    Row("sub-method-alpha", "sub", lambda x, y: x.sub(y, alpha=3)),
    Row("sub-reflected-scalar", "sub", lambda x, y: 1 - x),
    Row("sub-subtract", "sub", lambda x, y: torch.subtract(x, 0.25)),
    # mul
    Row("mul-operator", "mul", lambda x, y: x * y),
    Row("mul-torch-scalar", "mul", lambda x, y: torch.mul(x, 2.5)),
    Row("mul-method", "mul", lambda x, y: x.mul(y)),
    Row("mul-multiply", "mul", lambda x, y: torch.multiply(x, y[:, :1])),
    Row("mul-reflected", "mul", lambda x, y: 0.5 * x),
    Row("mul-0d-tensor", "mul", lambda x, y: x * y[0, 0, 0]),
    # div
    Row("div-operator", "div", lambda x, y: x / y),
    Row("div-torch-scalar", "div", lambda x, y: torch.div(x, 3.0)),
    Row("div-method", "div", lambda x, y: x.div(y)),
    Row("div-reflected", "div", lambda x, y: 2.0 / x),
    Row("div-true_divide", "div", lambda x, y: torch.true_divide(x, y)),
    Row("div-divide-int", "div", lambda x, y: torch.divide(x, 7)),
    # unary arithmetic
    Row("neg-operator", "neg", lambda x, y: -x),
    Row("neg-torch", "neg", lambda x, y: torch.neg(x)),
    Row("neg-method", "neg", lambda x, y: x.neg()),
    Row("neg-negative", "neg", lambda x, y: torch.negative(x)),
    Row("abs-builtin", "abs", lambda x, y: abs(x)),
    Row("abs-torch", "abs", lambda x, y: torch.abs(x)),
    Row("abs-method", "abs", lambda x, y: x.abs()),
    Row("abs-absolute", "abs", lambda x, y: torch.absolute(x)),
    Row("exp-torch", "exp", lambda x, y: torch.exp(x)),
    Row("exp-method", "exp", lambda x, y: x.exp()),
    Row("log-torch", "log", lambda x, y: torch.log(x), "positive"),
    Row("log-method", "log", lambda x, y: x.log(), "positive"),
    Row("log-negative-nan", "log", lambda x, y: torch.log(x), equal_nan=True),
    Row("sqrt-torch", "sqrt", lambda x, y: torch.sqrt(x), "positive"),
    Row("sqrt-method", "sqrt", lambda x, y: x.sqrt(), "positive"),
    Row("rsqrt-torch", "rsqrt", lambda x, y: torch.rsqrt(x), "positive"),
    Row("rsqrt-method", "rsqrt", lambda x, y: x.rsqrt(), "positive"),
    Row("reciprocal-torch", "reciprocal", lambda x, y: torch.reciprocal(x)),
    Row("reciprocal-method", "reciprocal", lambda x, y: x.reciprocal()),
    Row("square-torch", "square", lambda x, y: torch.square(x)),
    Row("square-method", "square", lambda x, y: x.square()),
    # pow: int, float, negative, fractional exponents
    Row("pow-int-2", "pow", lambda x, y: x**2),
    Row("pow-int-3", "pow", lambda x, y: x**3),
    Row("pow-float-2", "pow", lambda x, y: torch.pow(x, 2.0)),
    Row("pow-int-0", "pow", lambda x, y: x**0),
    Row("pow-neg-1", "pow", lambda x, y: x.pow(-1)),
    Row("pow-neg-2", "pow", lambda x, y: x**-2),
    Row("pow-neg-3", "pow", lambda x, y: torch.pow(x, -3)),
    Row("pow-int-9", "pow", lambda x, y: x**9),
    Row("pow-int-neg-11", "pow", lambda x, y: x**-11),
    Row("pow-half", "pow", lambda x, y: x**0.5, "positive"),
    Row("pow-1.5", "pow", lambda x, y: x**1.5, "positive"),
    Row("pow-neg-0.5", "pow", lambda x, y: torch.pow(x, -0.5), "positive"),
    Row("pow-2.5-negative-base-nan", "pow", lambda x, y: x**2.5, equal_nan=True),
    # transcendental
    Row("sigmoid-torch", "sigmoid", lambda x, y: torch.sigmoid(x * 3), nodes=3),
    Row("sigmoid-method", "sigmoid", lambda x, y: x.sigmoid()),
    Row("sigmoid-functional", "sigmoid", lambda x, y: F.sigmoid(x)),
    Row("sigmoid-expit", "sigmoid", lambda x, y: torch.special.expit(x)),
    Row("tanh-torch", "tanh", lambda x, y: torch.tanh(x)),
    Row("tanh-method", "tanh", lambda x, y: x.tanh()),
    Row("tanh-functional", "tanh", lambda x, y: F.tanh(x)),
    Row("tanh-tiny-inputs", "tanh", lambda x, y: torch.tanh(x * 1e-3), nodes=3),
    Row("erf-torch", "erf", lambda x, y: torch.erf(x)),
    Row("erf-method", "erf", lambda x, y: x.erf()),
    Row("erf-special", "erf", lambda x, y: torch.special.erf(x)),
    Row("sin-torch", "sin", lambda x, y: torch.sin(x * 2), nodes=3),
    Row("sin-method", "sin", lambda x, y: x.sin()),
    Row("cos-torch", "cos", lambda x, y: torch.cos(x * 2), nodes=3),
    Row("cos-method", "cos", lambda x, y: x.cos()),
    # activations
    Row("relu-functional", "relu", lambda x, y: F.relu(x)),
    Row("relu-torch", "relu", lambda x, y: torch.relu(x)),
    Row("relu-method", "relu", lambda x, y: x.relu()),
    Row("relu6", "relu6", lambda x, y: F.relu6(x * 4), nodes=3),
    Row("gelu-default", "gelu", lambda x, y: F.gelu(x * 2), nodes=3),
    Row("gelu-none", "gelu", lambda x, y: F.gelu(x, approximate="none")),
    Row("gelu-tanh", "gelu", lambda x, y: F.gelu(x * 2, approximate="tanh"), nodes=3),
    Row("silu", "silu", lambda x, y: F.silu(x * 2), nodes=3),
    Row("hardswish", "hardswish", lambda x, y: F.hardswish(x * 4), nodes=3),
    Row("hardsigmoid", "hardsigmoid", lambda x, y: F.hardsigmoid(x * 4), nodes=3),
    Row("leaky_relu-default", "leaky_relu", lambda x, y: F.leaky_relu(x)),
    Row("leaky_relu-slope", "leaky_relu", lambda x, y: F.leaky_relu(x, 0.2)),
    Row("leaky_relu-neg-slope", "leaky_relu", lambda x, y: F.leaky_relu(x, negative_slope=-0.5)),
    Row("hardtanh-default", "hardtanh", lambda x, y: F.hardtanh(x)),
    Row("hardtanh-bounds", "hardtanh", lambda x, y: F.hardtanh(x, -0.5, 0.75)),
    Row("hardtanh-kw-bounds", "hardtanh", lambda x, y: F.hardtanh(x, min_val=0.0, max_val=1.5)),
    # binary min/max
    Row("maximum-torch", "maximum", lambda x, y: torch.maximum(x, y)),
    Row("maximum-method", "maximum", lambda x, y: x.maximum(y[0])),
    Row("minimum-torch", "minimum", lambda x, y: torch.minimum(x, y)),
    Row("minimum-method", "minimum", lambda x, y: x.minimum(y[:, :, :1])),
    # clamp: min only, max only, both, tensor bounds, int bounds, clip
    Row("clamp-min-only", "clamp", lambda x, y: x.clamp(min=-0.5)),
    Row("clamp-max-only", "clamp", lambda x, y: x.clamp(max=0.5)),
    Row("clamp-both", "clamp", lambda x, y: torch.clamp(x, -0.5, 0.5)),
    Row("clamp-int-bounds", "clamp", lambda x, y: torch.clamp(x, 0, 1)),
    # the bounds are computed from y alone: each chain is a group of its own (growth runs
    # downstream only), read by the clamp's group as an operand
    Row(
        "clamp-tensor-bounds",
        "clamp",
        lambda x, y: x.clamp(min=-_hi(y), max=_hi(y)),
        # the bounds only clamp reads join its group (upstream growth); _hi(y), spelled
        # twice, is computed once (passes/common_values.py)
        nodes=5,
    ),
    Row("clamp-tensor-min-only", "clamp", lambda x, y: torch.clamp(x, min=y)),
    Row("clamp-min-above-max", "clamp", lambda x, y: torch.clamp(x, 0.5, -0.5)),
    Row("clip-torch", "clamp", lambda x, y: torch.clip(x, -1, 1)),
    Row("clip-method", "clamp", lambda x, y: x.clip(min=0.1)),
    Row("clamp_min-method", "clamp_min", lambda x, y: x.clamp_min(0.1)),
    Row("clamp_min-tensor", "clamp_min", lambda x, y: torch.clamp_min(x, y)),
    Row("clamp_max-method", "clamp_max", lambda x, y: x.clamp_max(0.3)),
    Row("clamp_max-tensor", "clamp_max", lambda x, y: torch.clamp_max(x, y[0, 0])),
    # where with a comparison condition computed in the group, or from outside
    Row("where-cond-in-group", "where", lambda x, y: torch.where(x > 0, x, y), nodes=3),
    Row("where-scalar-other", "where", lambda x, y: torch.where(x > 0.5, x, 0.0), nodes=3),
    Row("where-scalar-input", "where", lambda x, y: torch.where(x < 0, -1.0, x), nodes=3),
    Row("where-method", "where", lambda x, y: x.where(x < 0.5, -x), nodes=4),
    # the mask is computed from y for where alone: it joins where's group (upstream growth)
    Row("where-external-mask", "where", lambda x, y: torch.where(y > 0, x, y), nodes=3),
    # comparisons: bool results, written out as bool
    Row("eq-operator", "eq", lambda x, y: x == y, "ints"),
    Row("eq-scalar", "eq", lambda x, y: torch.eq(x, 1.0), "ints"),
    Row("ne-operator", "ne", lambda x, y: x != y, "ints"),
    Row("ne-method", "ne", lambda x, y: x.ne(-1), "ints"),
    Row("lt-operator", "lt", lambda x, y: x < y),
    Row("lt-method", "lt", lambda x, y: x.lt(0.25)),
    Row("le-operator", "le", lambda x, y: x <= y, "ints"),
    Row("le-torch", "le", lambda x, y: torch.le(x, 0), "ints"),
    Row("gt-operator", "gt", lambda x, y: x > y),
    Row("gt-torch", "gt", lambda x, y: torch.gt(x, 0.5)),
    Row("ge-operator", "ge", lambda x, y: x >= y, "ints"),
    Row("ge-method", "ge", lambda x, y: x.ge(1), "ints"),
    Row("greater-torch", "greater", lambda x, y: torch.greater(x, y)),
    Row("greater-method", "greater", lambda x, y: x.greater(0.0)),
    Row("less-torch", "less", lambda x, y: torch.less(x, y)),
    Row("less-method", "less", lambda x, y: x.less(0.0)),
    Row("compare-feeds-arith", "where", lambda x, y: torch.where(x >= y, x - y, y - x), nodes=5),
    # casts
    Row("cast-to-dtype-half", "cast", lambda x, y: x.to(torch.float16) * 2, nodes=3),
    Row("cast-to-kw-bf16", "cast", lambda x, y: x.to(dtype=torch.bfloat16) + 1, nodes=3),
    Row("cast-float", "cast", lambda x, y: (x * 3).float() / 7, nodes=4),
    Row("cast-half", "cast", lambda x, y: x.half() - 0.1, nodes=3),
    Row("cast-bfloat16", "cast", lambda x, y: x.bfloat16() * 1.5, nodes=3),
    Row("cast-double", "cast", lambda x, y: x.double() / 3, nodes=3),
    Row("cast-type_as", "cast", lambda x, y: x.type_as(y.double()) * 0.3, nodes=3),
    # dropout outside training: an alias of its input, no instruction of its own
    Row("dropout-eval", "dropout", lambda x, y: F.dropout(x * 2, 0.1, training=False) + y, nodes=4),
    Row("dropout-torch-p0", "dropout", lambda x, y: torch.dropout(x - y, 0.0, True) * 3, nodes=4),
    Row("cast-type", "cast", lambda x, y: x.type(torch.float32) + 0.5, nodes=3),
    Row("cast-bool-to-float", "cast", lambda x, y: (x > 0).float() * x, nodes=4),
    Row("cast-float-to-bool", "cast", lambda x, y: (x - 1).to(torch.bool), "ints", nodes=3),
    Row("cast-tensor-to", "cast", lambda x, y: x.to(y) * 2, nodes=3),
    # reductions along the last dim (keepdim), and norms: one row kernel with the lookup
    Row("sum-keepdim", "sum", lambda x, y: x.sum(-1, keepdim=True) * y, nodes=3),
    Row(
        "sum-torch-dim-list", "sum", lambda x, y: torch.sum(x, dim=[-1], keepdim=True) + x, nodes=3
    ),
    Row("mean-method", "mean", lambda x, y: x - x.mean(-1, keepdim=True), nodes=3),
    Row("mean-torch-positive-dim", "mean", lambda x, y: torch.mean(x, 2, True) * x, nodes=3),
    Row("amax-method", "amax", lambda x, y: x / x.amax(-1, keepdim=True), nodes=3),
    Row("amin-torch", "amin", lambda x, y: torch.amin(x, -1, keepdim=True) + y, nodes=3),
    Row("var-unbiased", "var", lambda x, y: x.var(-1, keepdim=True) + y, nodes=3),
    Row(
        "var-correction-0",
        "var",
        lambda x, y: torch.var(x, -1, keepdim=True, correction=0) * x,
        nodes=3,
    ),
    Row("std-method", "std", lambda x, y: x / x.std(-1, keepdim=True), nodes=3),
    Row(
        "layer_norm-functional",
        "layer_norm",
        lambda x, y: F.layer_norm(x, (D,), y[0, 0], y[1, 0], 1e-5),
    ),
    Row("layer_norm-torch-no-affine", "layer_norm", lambda x, y: torch.layer_norm(x, [D])),
    Row("rms_norm-functional", "rms_norm", lambda x, y: F.rms_norm(x, (D,), y[0, 0], 1e-6)),
    Row("rms_norm-default-eps", "rms_norm", lambda x, y: torch.rms_norm(x, [D])),
    # softmax along the last dim (the three spellings' signatures differ)
    Row("softmax-method", "softmax", lambda x, y: x.softmax(-1) * y, nodes=3),
    Row(
        "softmax-functional-fp32",
        "softmax",
        lambda x, y: F.softmax(x, dim=-1, dtype=torch.float32) + 1.0,
        nodes=3,
    ),
    Row(
        "log_softmax-torch-dim-2", "log_softmax", lambda x, y: torch.log_softmax(x, 2) - y, nodes=3
    ),  # fmt: skip
    Row("log_softmax-functional", "log_softmax", lambda x, y: F.log_softmax(x, -1) * 0.5, nodes=3),
    # prefix sums along the row: of floats, and of a bool mask (an int64 result, then float)
    Row("cumsum-torch", "cumsum", lambda x, y: torch.cumsum(x, -1) * y, nodes=3),
    Row("cumsum-method-of-bools", "cumsum", lambda x, y: (x > 0).cumsum(-1) * y, nodes=4),
    # mask logic on bools; integer casts and back
    Row(
        "logical_and-operator",
        "logical_and",
        lambda x, y: torch.where((x > 0) & (y < 0.5), x, y),
        nodes=5,
    ),
    Row(
        "logical_or-torch",
        "logical_or",
        lambda x, y: torch.where(torch.logical_or(x > 0, y < 0.5), x, y),
        nodes=5,
    ),
    Row("logical_not-operator", "logical_not", lambda x, y: torch.where(~(x > 0), x, y), nodes=4),
    Row("cast-long-round-trip", "cast", lambda x, y: (x * 4).long().to(x.dtype) + y, nodes=5),
    # infinities and NaNs where x <= 0.5 (x divided by 0.0 there; |x| >= 0.05, so x / 0 is
    # +-inf and 0 / 0 NaN), finite values elsewhere
    Row(
        "isinf-torch",
        "isinf",
        lambda x, y: torch.where(torch.isinf(x / (x > 0.5).to(x.dtype)), y, x),
        nodes=6,
    ),  # fmt: skip
    Row(
        "isnan-method",
        "isnan",
        lambda x, y: torch.where(((x - x) / (x > 0.5).to(x.dtype)).isnan(), y, x),
        nodes=7,
    ),  # fmt: skip
    Row(
        "isfinite-torch",
        "isfinite",
        lambda x, y: torch.where(torch.isfinite(x / (x > 0.5).to(x.dtype)), y, x),
        nodes=6,
    ),  # fmt: skip
    # any/all of each row of a boolean value (keepdim): one bool per row, broadcast back
    Row(
        "any-rows", "any", lambda x, y: torch.where((x > 1.0).any(-1, keepdim=True), y, x), nodes=4
    ),  # fmt: skip
    Row(
        "all-rows", "all", lambda x, y: torch.where((x > 0.06).all(-1, keepdim=True), y, x), nodes=4
    ),  # fmt: skip
    # rotate_half of an operand (the rotation of a lookup's value is not fused): the slices
    # and the negation join with the concatenation; D = 19 is odd, the rotation by D // 2
    Row("rotate-rotate-half", "rotate", lambda x, y: x + _rotate_half(y), nodes=6),
    Row(
        "rotate-chunk",
        "rotate",
        lambda x, y: x * torch.cat((-y.chunk(2, -1)[1], y.chunk(2, -1)[0]), -1),
        nodes=6,
    ),
    # any other torch.cat of tensors computed outside the group, read where they lie: along
    # a row dim (T = 5 split 3 + 2) and along the columns (D = 19 split 7 + 12); the slices
    # are views of y outside the group
    Row("concat-row-dim", "concat", lambda x, y: x + torch.cat((y[:, :3], y[:, 3:]), 1), nodes=3),
    Row(
        "concat-columns",
        "concat",
        lambda x, y: x * torch.cat((y[..., :7], y[..., 7:]), -1),
        nodes=3,
    ),  # fmt: skip
]


def _table(domain: str, dtype: torch.dtype) -> torch.Tensor:
    if domain == "ints":
        return torch.randint(-2, 3, (V, D)).to(dtype)
    table = rand_table(V, D, torch.float32)
    return (table.abs() if domain == "positive" else table).to(dtype)


def _other(domain: str, dtype: torch.dtype) -> torch.Tensor:
    if domain == "ints":
        return torch.randint(-2, 3, (B, T, D)).to(dtype)
    return rand_table(B * T, D, torch.float32).reshape(B, T, D).to(dtype)


def test_table_is_large_enough():
    assert len(OP_TABLE) >= 30


def test_every_op_has_a_row():
    covered = {row.op for row in ROWS}
    missing = set(OP_TABLE) - covered
    assert not missing, f"ops without a test row: {sorted(missing)}"
    unknown = covered - set(OP_TABLE)
    assert not unknown, f"rows naming ops not in the table: {sorted(unknown)}"


def test_row_ids_are_unique():
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_op_row(row, dtype):
    torch.manual_seed(zlib.crc32(row.id.encode()))
    table = _table(row.domain, dtype)
    y = _other(row.domain, dtype)
    ids = rand_ids(V, (B, T), torch.int32 if len(row.id) % 2 else torch.int64)

    def fn(ids, table, y):
        return row.fn(F.embedding(ids, table), y)

    expected = eager(fn, ids, table, y)
    actual, report = run_fused(fn, ids, table, y)
    # A chain through a narrower dtype (a cast back to fp32 after bf16 math) is only as
    # exact as that dtype: use the looser of the two tolerances.
    assert_close(actual, expected, equal_nan=row.equal_nan, floor_dtype=dtype)
    assert len(report.groups) == 1 + row.other_groups, str(report)
    (group,) = [g for g in report.groups if g.lookups]
    assert len(group.nodes) == row.nodes, str(report)
    assert all("belongs to another group" in r.reason for r in report.rejections), str(report)
    emitted = any(f"= {row.op}(" in line for line in group.source.splitlines())
    if OP_TABLE[row.op].kind in ("move", "concat"):
        assert len(group.moves) == 1 and not group.reductions and emitted, str(report)
    elif OP_TABLE[row.op].kind != "elementwise":
        # reductions and norms lower to several instructions; the report names the node
        assert len(group.reductions) == 1, str(report)
    elif row.op == "dropout":
        assert not emitted, group.source  # an alias: nothing to compute
    elif row.op == "cast" and _casts_alias(fn, ids, table, y):
        # a cast to the dtype it already has returns its input in eager: the group keeps it
        # as an alias of that value, with no instruction of its own
        assert not emitted, group.source
    else:
        assert emitted, group.source


class _CastProbe(torch.overrides.TorchFunctionMode):
    """Records, for each cast method called, whether eager returned its input itself."""

    NAMES = {"to", "float", "half", "bfloat16", "double", "type_as", "type"}

    def __init__(self):
        super().__init__()
        self.aliased: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in self.NAMES:
            self.aliased.append(out is args[0])
        return out


def _casts_alias(fn, *args):
    with torch.no_grad(), _CastProbe() as probe:
        fn(*args)
    return bool(probe.aliased) and all(probe.aliased)


# --- spellings map to one canonical op ---------------------------------------------------


@pytest.mark.parametrize(
    "kind, target, name",
    [
        ("call_function", torch.mul, "mul"),
        ("call_function", operator.mul, "mul"),
        ("call_function", torch.Tensor.mul, "mul"),
        ("call_method", "mul", "mul"),
        ("call_function", F.gelu, "gelu"),
        ("call_function", torch._C._nn.gelu, "gelu"),
        ("call_method", "sigmoid", "sigmoid"),
        ("call_function", torch.special.expit, "sigmoid"),
        ("call_function", operator.truediv, "div"),
        ("call_function", abs, "abs"),
        ("call_method", "type_as", "cast"),
        ("call_method", "float", "cast"),
        ("call_function", torch.clip, "clamp"),
        ("call_method", "where", "where"),
        ("call_function", operator.ge, "ge"),
        ("call_method", "mean", "mean"),
        ("call_function", torch.sum, "sum"),
        ("call_function", F.layer_norm, "layer_norm"),
        ("call_function", torch.rms_norm, "rms_norm"),
        ("call_function", torch.cumsum, "cumsum"),
        ("call_method", "cumsum", "cumsum"),
        ("call_method", "long", "cast"),
        ("call_method", "int", "cast"),
        ("call_function", operator.and_, "logical_and"),
        ("call_function", operator.or_, "logical_or"),
        ("call_function", operator.invert, "logical_not"),
    ],
)
def test_spellings(kind, target, name):
    row = lookup_op(kind, target)
    assert row is not None and row[0].name == name


@pytest.mark.parametrize(
    "kind, target",
    [
        ("call_method", "mul_"),  # in-place spellings are not elementwise ops of the table
        ("call_function", torch.Tensor.mul_),
        ("call_method", "add_"),
        ("call_function", torch.cumprod),
        ("call_method", "cumprod"),
        ("call_module", "mul"),
        ("call_function", [1, 2]),  # unhashable target
        ("placeholder", "x"),
    ],
)
def test_not_in_table(kind, target):
    assert lookup_op(kind, target) is None


def test_spellings_fuse_alike():
    # torch.mul, operator *, Tensor.mul, method mul: the same canonical op and result.
    torch.manual_seed(20)
    table, y = rand_table(V, D), _other("any", torch.float32)
    ids = rand_ids(V, (B, T))
    spellings = [
        lambda x: torch.mul(x, y),
        lambda x: x * y,
        lambda x: torch.Tensor.mul(x, y),
        lambda x: x.mul(y),
    ]
    results = []
    for spell in spellings:
        torch._dynamo.reset()
        out, report = run_fused(lambda ids, t, s=spell: s(F.embedding(ids, t)), ids, table)
        assert len(single_group(report).nodes) == 2
        results.append(out)
    for out in results:
        torch.testing.assert_close(out, F.embedding(ids, table) * y)


# --- NaN and Inf propagate as in eager -----------------------------------------------------

SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0]

NAN_ROWS = [
    ("relu", lambda x, y: torch.relu(x)),
    ("clamp", lambda x, y: x.clamp(-1.0, 1.0)),
    ("clamp-min", lambda x, y: x.clamp(min=0.0)),
    ("clamp-tensor", lambda x, y: torch.clamp(x, min=y)),
    ("maximum", lambda x, y: torch.maximum(x, y)),
    ("minimum", lambda x, y: torch.minimum(y, x)),
    ("hardtanh", lambda x, y: F.hardtanh(x)),
    ("relu6", lambda x, y: F.relu6(x)),
    ("hardswish", lambda x, y: F.hardswish(x)),
    ("hardsigmoid", lambda x, y: F.hardsigmoid(x)),
    ("leaky_relu", lambda x, y: F.leaky_relu(x, 0.1)),
    ("abs-neg", lambda x, y: -x.abs()),
    ("sigmoid", lambda x, y: torch.sigmoid(x)),
    ("tanh", lambda x, y: torch.tanh(x)),
    ("exp", lambda x, y: torch.exp(x)),
    # Inf is clamped away before gelu: eager's fp32 CPU gelu gives NaN for +inf (its
    # vectorised formula computes inf * 0), the kernel gives the mathematically right inf.
    ("clamp-gelu", lambda x, y: F.gelu(x.clamp(-5.0, 5.0))),
    ("where-gt", lambda x, y: torch.where(x > 0, x, y)),
    ("mul-add", lambda x, y: x * 2 + y),
    ("compare", lambda x, y: x >= 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name, fn", NAN_ROWS, ids=[r[0] for r in NAN_ROWS])
def test_nan_and_inf_propagate_like_eager(name, fn, dtype):
    torch.manual_seed(21)
    table = rand_table(V, D, torch.float32)
    table[0, :4] = torch.tensor(SPECIALS)
    table[1, 3:7] = torch.tensor(SPECIALS)
    table = table.to(dtype)
    y = _other("any", dtype)
    y[0, 0, 5] = float("nan")
    ids = rand_ids(V, (B, T))
    ids[0, :2] = torch.tensor([0, 1])  # make sure the special rows are looked up
    ids[1, 3] = 1

    def f(ids, table, y):
        return fn(F.embedding(ids, table), y)

    expected = eager(f, ids, table, y)
    assert expected.dtype == torch.bool or expected.isnan().any()
    actual, report = run_fused(f, ids, table, y)
    assert_close(actual, expected, equal_nan=True)
    single_group(report)


# --- Python scalars in comparisons are rounded to the tensor's dtype, as in eager ------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "name, fn",
    [
        ("eq", lambda x: x == 0.1),
        ("ge", lambda x: x >= 0.1),
        ("lt", lambda x: torch.lt(x, 0.1)),
        ("where-ne", lambda x: torch.where(x != 0.1, x, -x)),
    ],
    ids=["eq", "ge", "lt", "where-ne"],
)
def test_compare_with_python_scalar_like_eager(name, fn, dtype):
    # Eager compares an fp16/bf16 tensor with a Python number after rounding the number to
    # the tensor's dtype: fp16 x == 0.1 is True where x holds fp16(0.1) (0.0999755859375).
    # A kernel comparing against the fp32 literal 0.1 gets these rows wrong.
    torch.manual_seed(22)
    table = rand_table(V, D, dtype)
    table[::2, ::2] = 0.1  # stored as dtype(0.1), which is not fp32(0.1)
    ids = rand_ids(V, (B, T))

    def f(ids, table):
        return fn(F.embedding(ids, table))

    expected = eager(f, ids, table)
    actual, report = run_fused(f, ids, table)
    single_group(report)
    assert_close(actual, expected)


def test_dropout_in_training_is_not_fused_and_says_why():
    # A training-mode dropout draws a random mask: it must stay eager's own op.
    def fn(ids, table):
        return F.dropout(F.embedding(ids, table) * 2, 0.5, training=True) + 1

    torch.manual_seed(0)
    ids, table = rand_ids(V, (B, T)), _table("any", torch.float32)
    _, report = run_fused(fn, ids, table)
    assert [len(g.nodes) for g in report.groups] == [2], str(report)  # lookup * 2 only
    assert any("draws random numbers" in r.reason for r in report.rejections), str(report)
