"""The elementwise op table: every torch-level spelling -> one canonical op.

Each row says which argument names are operands, how the op is written in Triton (an
expression over operand expressions, computed in fp32 or fp64) and what its result holds
("float" or "bool"). Result dtypes are never computed here: Dynamo's fake tensors already
carry eager's type promotion in each node's ``example_value``, and the kernel rounds every
intermediate to that dtype, as eager does.

Adding an op is one ``_op(...)`` row here plus a row in tests/test_ops_table.py.
"""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["OpCall", "OpDef", "OP_TABLE", "bind_op", "lookup_op", "format_scalar"]

Emitter = Callable[[Sequence[str], dict[str, Any]], str]


@dataclasses.dataclass(frozen=True)
class OpDef:
    """One canonical elementwise op.

    Attributes:
        name: canonical name ("add", "gelu", "cast", ...).
        operands: argument names that are read as values (tensor or Python number).
        result: "float" for arithmetic, "bool" for comparisons.
        emit: builds the Triton expression from operand expressions and params.
        check: returns a reason string when these params cannot be fused, else None.
        bool_operands: operand names that must be boolean (where's condition).
    """

    name: str
    operands: tuple[str, ...]
    result: str
    emit: Emitter
    check: Callable[[dict[str, Any]], str | None] = lambda params: None
    bool_operands: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class OpCall:
    """A node matched against the table: its op, operand values and other params."""

    op: OpDef
    operands: tuple[Any, ...]  # FX nodes or Python numbers, in ``op.operands`` order
    params: dict[str, Any]

    def emit(self, operand_exprs: Sequence[str]) -> str:
        return self.op.emit(operand_exprs, self.params)


def format_scalar(value: Any) -> str:
    """A Python number as a Triton literal (fp32 math; non-finite values spelled out)."""
    value = float(value)
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(value)


# --- Triton expressions -----------------------------------------------------------------
# Operands arrive as variable names, so repeating one in an expression costs nothing.

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


def _scaled(x: str, alpha: Any) -> str:
    return x if alpha == 1 else f"({format_scalar(alpha)} * {x})"


def _clamp(x: str, lo: str | None, hi: str | None) -> str:
    if lo is not None:
        x = f"tl.maximum({x}, {lo}, {_NAN_ALL})"
    if hi is not None:
        x = f"tl.minimum({x}, {hi}, {_NAN_ALL})"
    return x


def _unary(expr: str) -> Emitter:
    return lambda a, p: expr.format(a[0])


def _binary(expr: str) -> Emitter:
    return lambda a, p: expr.format(a[0], a[1])


def _reject_rounding_mode(params: dict[str, Any]) -> str | None:
    mode = params.get("rounding_mode")
    return None if mode is None else f"div with rounding_mode={mode!r} is not fused"


def _reject_inplace(params: dict[str, Any]) -> str | None:
    return "inplace=True mutates its input" if params.get("inplace") else None


def _check_pow(params: dict[str, Any]) -> str | None:
    return None  # the exponent's type is checked by the operand rules (must be a number)


def _check_gelu(params: dict[str, Any]) -> str | None:
    approximate = params.get("approximate", "none")
    return None if approximate in ("none", "tanh") else f"gelu approximate={approximate!r}"


# --- Signatures: one per spelling family, used with inspect.Signature.bind ---------------
# Method spellings pass the tensor as the first positional argument, so they share the
# function signatures.  ``out=`` is accepted by the signature and rejected by bind_op.


def _sig_unary(input, *, out=None): ...
def _sig_unary_inplace(input, inplace=False): ...
def _sig_alpha(input, other, *, alpha=1, out=None): ...
def _sig_binary(input, other, *, out=None): ...
def _sig_div(input, other, *, rounding_mode=None, out=None): ...
def _sig_pow(input, exponent, *, out=None): ...
def _sig_gelu(input, approximate="none"): ...
def _sig_clamp(input, min=None, max=None, *, out=None): ...
def _sig_clamp_min(input, min, *, out=None): ...
def _sig_clamp_max(input, max, *, out=None): ...
def _sig_where(condition, input, other, *, out=None): ...
def _sig_where_method(input, condition, other): ...
def _sig_leaky_relu(input, negative_slope=0.01, inplace=False): ...
def _sig_hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False): ...
def _sig_cast(input, *args, **kwargs): ...


# --- The table --------------------------------------------------------------------------

OP_TABLE: dict[str, OpDef] = {}
_SPELLINGS: dict[Any, tuple[OpDef, inspect.Signature]] = {}


def _op(op: OpDef, sig: Callable[..., Any], spellings: Sequence[Any]) -> None:
    OP_TABLE[op.name] = op
    signature = inspect.signature(sig)
    for spelling in spellings:
        _SPELLINGS[spelling] = (op, signature)


def _both(name: str) -> list[Any]:
    """torch.<name> and Tensor.<name> (as function and as method name), where they exist."""
    found: list[Any] = [name]
    for owner in (torch, torch.Tensor, torch.special, F):
        if hasattr(owner, name):
            found.append(getattr(owner, name))
    return found


_U, _B = ("input",), ("input", "other")
_op(
    OpDef("add", _B, "float", lambda a, p: f"({a[0]} + {_scaled(a[1], p['alpha'])})"),
    _sig_alpha,
    [*_both("add"), operator.add],
)
_op(
    OpDef("sub", _B, "float", lambda a, p: f"({a[0]} - {_scaled(a[1], p['alpha'])})"),
    _sig_alpha,
    [*_both("sub"), *_both("subtract"), operator.sub],
)
_op(
    OpDef("mul", _B, "float", _binary("({} * {})")),
    _sig_binary,
    [*_both("mul"), *_both("multiply"), operator.mul],
)
_op(
    OpDef("div", _B, "float", _binary("({} / {})"), _reject_rounding_mode),
    _sig_div,
    [*_both("div"), *_both("divide"), *_both("true_divide"), operator.truediv],
)
_op(
    OpDef("neg", _U, "float", _unary("(-{})")),
    _sig_unary,
    [*_both("neg"), *_both("negative"), operator.neg],
)
_op(
    OpDef("abs", _U, "float", _unary("tl.abs({})")),
    _sig_unary,
    [*_both("abs"), *_both("absolute"), operator.abs, builtins.abs],
)
_op(OpDef("exp", _U, "float", _unary("tl.exp({})")), _sig_unary, _both("exp"))
_op(OpDef("log", _U, "float", _unary("tl.log({})")), _sig_unary, _both("log"))
_op(OpDef("sqrt", _U, "float", _unary("tl.sqrt({})")), _sig_unary, _both("sqrt"))
_op(OpDef("rsqrt", _U, "float", _unary("tl.rsqrt({})")), _sig_unary, _both("rsqrt"))
_op(OpDef("reciprocal", _U, "float", _unary("(1.0 / {})")), _sig_unary, _both("reciprocal"))
_op(OpDef("square", _U, "float", _unary("({0} * {0})")), _sig_unary, _both("square"))
_op(
    OpDef("pow", ("input",), "float", lambda a, p: _pow(a[0], p["exponent"]), _check_pow),
    _sig_pow,
    [*_both("pow"), operator.pow],
)
_op(
    OpDef("sigmoid", _U, "float", _unary("tl.sigmoid({})")),
    _sig_unary,
    [*_both("sigmoid"), torch.special.expit],
)
_op(OpDef("tanh", _U, "float", lambda a, p: _tanh(a[0])), _sig_unary, _both("tanh"))
_op(OpDef("erf", _U, "float", _unary("tl.erf({})")), _sig_unary, _both("erf"))
_op(OpDef("sin", _U, "float", _unary("tl.sin({})")), _sig_unary, _both("sin"))
_op(OpDef("cos", _U, "float", _unary("tl.cos({})")), _sig_unary, _both("cos"))
_op(
    OpDef("relu", _U, "float", lambda a, p: _clamp(a[0], "0.0", None), _reject_inplace),
    _sig_unary_inplace,
    _both("relu"),
)
_op(
    OpDef("relu6", _U, "float", lambda a, p: _clamp(a[0], "0.0", "6.0"), _reject_inplace),
    _sig_unary_inplace,
    [F.relu6, torch._C._nn.relu6],
)
_op(
    OpDef("gelu", _U, "float", lambda a, p: _gelu(a[0], p["approximate"]), _check_gelu),
    _sig_gelu,
    [*_both("gelu"), torch._C._nn.gelu],
)
_op(
    OpDef("silu", _U, "float", _unary("({0} * tl.sigmoid({0}))"), _reject_inplace),
    _sig_unary_inplace,
    [F.silu, "silu"],
)
_op(
    OpDef(
        "leaky_relu",
        _U,
        "float",
        lambda a, p: f"tl.where({a[0]} > 0, {a[0]}, {a[0]} * {format_scalar(p['negative_slope'])})",
        _reject_inplace,
    ),
    _sig_leaky_relu,
    [F.leaky_relu, torch._C._nn.leaky_relu],
)
_op(
    OpDef(
        "hardtanh",
        _U,
        "float",
        lambda a, p: _clamp(a[0], format_scalar(p["min_val"]), format_scalar(p["max_val"])),
        _reject_inplace,
    ),
    _sig_hardtanh,
    [F.hardtanh, torch._C._nn.hardtanh],
)
_op(
    OpDef("maximum", _B, "float", _binary(f"tl.maximum({{}}, {{}}, {_NAN_ALL})")),
    _sig_binary,
    _both("maximum"),
)
_op(
    OpDef("minimum", _B, "float", _binary(f"tl.minimum({{}}, {{}}, {_NAN_ALL})")),
    _sig_binary,
    _both("minimum"),
)
# clamp's bounds are optional operands: emit receives None for a missing one.
_op(
    OpDef("clamp", ("input", "min", "max"), "float", lambda a, p: _clamp(a[0], a[1], a[2])),
    _sig_clamp,
    [*_both("clamp"), *_both("clip")],
)
_op(
    OpDef("clamp_min", ("input", "min"), "float", lambda a, p: _clamp(a[0], a[1], None)),
    _sig_clamp_min,
    _both("clamp_min"),
)
_op(
    OpDef("clamp_max", ("input", "max"), "float", lambda a, p: _clamp(a[0], None, a[1])),
    _sig_clamp_max,
    _both("clamp_max"),
)
_op(
    OpDef(
        "where",
        ("condition", "input", "other"),
        "float",
        lambda a, p: f"tl.where({a[0]}, {a[1]}, {a[2]})",
        bool_operands=("condition",),
    ),
    _sig_where,
    [torch.where],
)
_SPELLINGS["where"] = (OP_TABLE["where"], inspect.signature(_sig_where_method))
_SPELLINGS[torch.Tensor.where] = _SPELLINGS["where"]
for _name, _sym in (
    ("eq", "=="),
    ("ne", "!="),
    ("lt", "<"),
    ("le", "<="),
    ("gt", ">"),
    ("ge", ">="),
):
    _op(
        OpDef(_name, _B, "bool", _binary(f"({{}} {_sym} {{}})")),
        _sig_binary,
        [*_both(_name), getattr(operator, _name)],
    )
_op(OpDef("greater", _B, "bool", _binary("({} > {})")), _sig_binary, _both("greater"))
_op(OpDef("less", _B, "bool", _binary("({} < {})")), _sig_binary, _both("less"))
# Casts: the target dtype comes from the node's example_value; rounding to it is done by
# the kernel like every other value's, so the expression only converts bool <-> float.
_CAST_SPELLINGS = [
    "to",
    "float",
    "half",
    "bfloat16",
    "double",
    "type_as",
    "type",
    torch.Tensor.to,
    torch.Tensor.float,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.double,
    torch.Tensor.type_as,
]
_op(OpDef("cast", _U, "float", _unary("{}")), _sig_cast, _CAST_SPELLINGS)


def lookup_op(op_kind: str, target: Any) -> tuple[OpDef, inspect.Signature] | None:
    """The table row for an FX node's (op, target), or None when it is not elementwise."""
    if op_kind == "call_method":
        return _SPELLINGS.get(target) if isinstance(target, str) else None
    if op_kind == "call_function":
        try:
            return _SPELLINGS.get(target)
        except TypeError:  # unhashable target
            return None
    return None


def bind_op(
    op: OpDef, signature: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]
) -> OpCall | str:
    """Match a call's arguments to the op's operands and params, or give a reason."""
    if op.name == "cast":
        return _bind_cast(op, args, kwargs)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        return f"{op.name} called with unexpected arguments ({exc})"
    bound.apply_defaults()
    values = dict(bound.arguments)
    if values.pop("out", None) is not None:
        return f"{op.name} with out= writes into an existing tensor"
    operands = tuple(values.pop(name) for name in op.operands)
    if op.name == "pow":
        exponent = values.get("exponent")
        if not _is_number(exponent):
            return "pow with a tensor exponent is not fused (only Tensor ** number)"
    reason = op.check(values)
    if reason:
        return reason
    return OpCall(op, operands, values)


def _bind_cast(op: OpDef, args: Sequence[Any], kwargs: dict[str, Any]) -> OpCall | str:
    bad = sorted(set(kwargs) - {"dtype", "non_blocking", "copy", "device"})
    if bad:
        return f"cast with {bad} is not fused"
    if kwargs.get("memory_format") is not None:
        return "cast with memory_format is not fused"
    if not args:
        return "cast without a tensor"
    return OpCall(op, (args[0],), {})


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, complex)
