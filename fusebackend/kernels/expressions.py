"""Triton spellings of the op table: canonical op name + params -> a Triton expression.

The op table in ``passes/ops.py`` says what each op means (its operands, params and result
kind); this module says how the kernel writes it. Every expression is computed in the
kernel's compute dtype (fp32, or fp64 when any value of the program is fp64); operands
arrive as variable names, so repeating one in an expression costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fusebackend.kernels.ir import format_scalar

__all__ = ["EXPRESSIONS", "expression", "format_scalar"]

Emitter = Callable[[Sequence[str | None], dict[str, Any]], str]

_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"  # torch.maximum/clamp propagate NaN


def _tanh(x: str) -> str:
    # libdevice.tanh does not run in the Triton interpreter (triton 3.6), so tanh is
    # built from exp: (1 - e^-2|x|) / (1 + e^-2|x|) loses relative precision for tiny x
    # (1e-3 at |x| = 1e-4), so below 1/16 an odd Taylor polynomial (error < 1e-9) is used.
    ax = f"tl.abs({x})"
    t = f"tl.exp(-2.0 * {ax})"
    big = f"tl.where({x} < 0, -1.0, 1.0) * ((1.0 - {t}) / (1.0 + {t}))"
    small = f"({x} * (1.0 - {x} * {x} * (0.3333333333333333 - 0.13333333333333333 * {x} * {x})))"
    return f"tl.where({ax} < 0.0625, {small}, {big})"


def _gelu(x: str, approximate: str) -> str:
    if approximate == "tanh":
        inner = f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})"
        return f"(0.5 * {x} * (1.0 + {_tanh(inner)}))"
    return f"(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"


def _int_power(x: str, n: int) -> str:
    """x**n for n >= 1 by repeated squaring: log2(n) roundings instead of n (x**-11 by
    exp2/log2 was 2.5e-6 off in fp32; squaring keeps it at a few ulp)."""
    factors, square = [], x
    while True:
        if n & 1:
            factors.append(square)
        n >>= 1
        if not n:
            break
        square = f"({square} * {square})"
    return "(" + " * ".join(factors) + ")"


def _pow(x: str, exponent: float) -> str:
    if float(exponent).is_integer() and abs(exponent) <= 64:
        n = int(abs(exponent))
        if n == 0:  # eager: nan ** 0 == 1, so no arithmetic on x
            return f"tl.where({x} != {x}, 1.0, 1.0)"
        product = _int_power(x, n)
        return f"(1.0 / {product})" if exponent < 0 else product
    if exponent == 0.5:
        return f"tl.sqrt({x})"
    e = format_scalar(exponent)
    magnitude = f"tl.exp2({e} * tl.log2(tl.abs({x})))"
    if float(exponent).is_integer():  # odd integer powers keep the sign
        sign = "1.0" if int(exponent) % 2 == 0 else f"tl.where({x} < 0, -1.0, 1.0)"
        return f"({sign} * {magnitude})"
    return f"tl.exp2({e} * tl.log2({x}))"  # negative base -> log2 gives NaN, as eager


def _scaled(x: str | None, alpha: Any) -> str:
    return str(x) if alpha == 1 else f"({format_scalar(alpha)} * {x})"


def _clamp(x: str | None, lo: str | None, hi: str | None) -> str:
    if lo is not None:
        x = f"tl.maximum({x}, {lo}, {_NAN_ALL})"
    if hi is not None:
        x = f"tl.minimum({x}, {hi}, {_NAN_ALL})"
    return str(x)


def _unary(expr: str) -> Emitter:
    return lambda a, p: expr.format(a[0])


def _binary(expr: str) -> Emitter:
    return lambda a, p: expr.format(a[0], a[1])


EXPRESSIONS: dict[str, Emitter] = {
    "add": lambda a, p: f"({a[0]} + {_scaled(a[1], p.get('alpha', 1))})",
    "sub": lambda a, p: f"({a[0]} - {_scaled(a[1], p.get('alpha', 1))})",
    "mul": _binary("({} * {})"),
    "div": _binary("({} / {})"),
    "neg": _unary("(-{})"),
    "abs": _unary("tl.abs({})"),
    "isinf": _unary('(tl.abs({}) == float("inf"))'),
    "isnan": _unary("({0} != {0})"),
    "isfinite": _unary('(tl.abs({}) < float("inf"))'),
    "exp": _unary("tl.exp({})"),
    "log": _unary("tl.log({})"),
    "sqrt": _unary("tl.sqrt({})"),
    "rsqrt": _unary("tl.rsqrt({})"),
    "reciprocal": _unary("(1.0 / {})"),
    "square": _unary("({0} * {0})"),
    "pow": lambda a, p: _pow(str(a[0]), p["exponent"]),
    "sigmoid": _unary("tl.sigmoid({})"),
    "tanh": lambda a, p: _tanh(str(a[0])),
    "erf": _unary("tl.erf({})"),
    "sin": _unary("tl.sin({})"),
    "cos": _unary("tl.cos({})"),
    "relu": lambda a, p: _clamp(a[0], "0.0", None),
    "relu6": lambda a, p: _clamp(a[0], "0.0", "6.0"),
    "gelu": lambda a, p: _gelu(str(a[0]), p.get("approximate", "none")),
    "silu": _unary("({0} * tl.sigmoid({0}))"),
    # as ATen's CUDA kernels write them: clamp(x + 3, 0, 6) times 1/6 (not divided by 6)
    "hardswish": lambda a, p: f"({a[0]} * {_clamp(f'({a[0]} + 3.0)', '0.0', '6.0')} * {1 / 6!r})",
    "hardsigmoid": lambda a, p: f"({_clamp(f'({a[0]} + 3.0)', '0.0', '6.0')} * {1 / 6!r})",
    "leaky_relu": lambda a, p: (
        f"tl.where({a[0]} > 0, {a[0]}, {a[0]} * {format_scalar(p['negative_slope'])})"
    ),
    "hardtanh": lambda a, p: _clamp(a[0], format_scalar(p["min_val"]), format_scalar(p["max_val"])),
    "maximum": _binary(f"tl.maximum({{}}, {{}}, {_NAN_ALL})"),
    "minimum": _binary(f"tl.minimum({{}}, {{}}, {_NAN_ALL})"),
    # clamp's bounds are optional operands: the emitter receives None for a missing one
    "clamp": lambda a, p: _clamp(a[0], a[1], a[2]),
    "clamp_min": lambda a, p: _clamp(a[0], a[1], None),
    "clamp_max": lambda a, p: _clamp(a[0], None, a[1]),
    "where": lambda a, p: f"tl.where({a[0]}, {a[1]}, {a[2]})",
    "eq": _binary("({} == {})"),
    "ne": _binary("({} != {})"),
    "lt": _binary("({} < {})"),
    "le": _binary("({} <= {})"),
    "gt": _binary("({} > {})"),
    "ge": _binary("({} >= {})"),
    "greater": _binary("({} > {})"),
    "less": _binary("({} < {})"),
    # bool operands only (passes/ops.py): Triton's int1 logic
    "logical_and": _binary("({} & {})"),
    "logical_or": _binary("({} | {})"),
    "logical_not": _unary("({} == 0)"),
    # the target dtype is the instruction's dtype; the kernel rounds to it like every value
    "cast": _unary("{}"),
    "dropout": _unary("{}"),  # outside training only (passes/ops.py): the identity
}


def expression(name: str, operands: Sequence[str | None], params: dict[str, Any]) -> str:
    """The Triton expression of op ``name`` over operand expressions (None: left out)."""
    return EXPRESSIONS[name](operands, params)
