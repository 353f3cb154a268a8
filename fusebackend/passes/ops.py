"""The op table: every torch-level spelling -> one canonical op, as semantics only.

Each row says which argument names are operands (values read by the kernel: tensors or
Python numbers), which are optional, what the op's result holds ("float" or "bool") and
what kind of op it is: ``elementwise``, ``reduction`` (along the last dim), ``norm``
(layer_norm / rms_norm over the last dim), ``softmax`` (softmax / log_softmax along the last
dim), ``scan`` (cumsum along the last dim), ``move`` (a column rearrangement: ``rotate``,
matched by structure in ``passes/rotation.py``, not by a spelling) or ``concat``
(``torch.cat`` of tensors read where they lie: passes/concatenation.py). How an op is
written in Triton lives in ``kernels/expressions.py`` (passes never import Triton). Result
dtypes are never computed here: Dynamo's fake tensors already carry eager's type promotion
in each node's ``example_value``, and the kernel rounds every value to that dtype, as
eager does.

Adding an op is one ``_op(...)`` row here, its expression in kernels/expressions.py, plus a
row in tests/test_ops_table.py.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import inspect
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "FLOATING",
    "OpCall",
    "OpDef",
    "OpKind",
    "OP_TABLE",
    "bind_op",
    "lookup_op",
    "reduction_dim_reason",
]

# The floating dtypes a group computes in and an embedding table may hold.
FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class OpKind(str, enum.Enum):
    """What kind of op a table row is. A ``str`` enum: a kind compares equal to its name
    (``OpKind.NORM == "norm"``) and formats as it, so reports and reasons read the same."""

    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"  # along the last dim, keepdim
    NORM = "norm"  # layer_norm / rms_norm over the last dim
    SOFTMAX = "softmax"  # softmax / log_softmax along the last dim
    MOVE = "move"  # a column rearrangement (rotate)
    CONCAT = "concat"  # parts read where they lie, each over its range of one dim
    SCAN = "scan"  # an inclusive prefix sum along the last dim (cumsum)

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclasses.dataclass(frozen=True)
class OpDef:
    """One canonical op.

    Attributes:
        name: canonical name ("add", "gelu", "cast", "mean", "layer_norm", ...).
        operands: argument names that are read as values (tensor or Python number).
        result: "float" for arithmetic, "bool" for comparisons.
        check: returns a reason string when these params cannot be fused, else None.
        bool_operands: operand names that must be boolean (where's condition).
        optional: operand names that may be None (clamp's bounds, a norm's weight).
        kind: an ``OpKind``.
    """

    name: str
    operands: tuple[str, ...]
    result: str
    check: Callable[[dict[str, Any]], str | None] = lambda params: None
    bool_operands: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    kind: OpKind = OpKind.ELEMENTWISE


@dataclasses.dataclass(frozen=True)
class OpCall:
    """A node matched against the table: its op, operand values and other params."""

    op: OpDef
    operands: tuple[Any, ...]  # FX nodes or Python numbers, in ``op.operands`` order
    params: dict[str, Any]


def _reject_rounding_mode(params: dict[str, Any]) -> str | None:
    mode = params.get("rounding_mode")
    return None if mode is None else f"div with rounding_mode={mode!r} is not fused"


def _reject_inplace(params: dict[str, Any]) -> str | None:
    return "inplace=True mutates its input" if params.get("inplace") else None


def _check_dropout(params: dict[str, Any]) -> str | None:
    # In eval mode (or with p = 0) eager returns its input itself; in training it draws a
    # random mask, which a kernel cannot reproduce.
    training = params.get("training", params.get("train", True))
    if params.get("inplace"):
        return "inplace=True mutates its input"
    if training is False or params.get("p") == 0:
        return None
    return f"dropout with training={training!r} draws random numbers"


def _check_gelu(params: dict[str, Any]) -> str | None:
    approximate = params.get("approximate", "none")
    return None if approximate in ("none", "tanh") else f"gelu approximate={approximate!r}"


def _check_reduction(params: dict[str, Any]) -> str | None:
    if params.get("dtype") is not None:
        return f"a reduction with dtype={params['dtype']} is not fused"
    if not params.get("keepdim"):
        return "a reduction without keepdim=True is not fused (its result is not a row value)"
    return None


def _check_norm(params: dict[str, Any]) -> str | None:
    shape = params.get("normalized_shape")
    if not isinstance(shape, (list, tuple, torch.Size)) or len(shape) != 1:
        return f"normalized_shape {shape!r} is not one (last) dim"
    if not isinstance(params.get("eps"), (int, float, type(None))):
        return "eps is not a Python number"
    return None


def _check_scan(params: dict[str, Any]) -> str | None:
    dtype = params.get("dtype")
    return None if dtype is None else f"cumsum with dtype={dtype!r} is not fused"


def _check_softmax(params: dict[str, Any]) -> str | None:
    dtype = params.get("dtype")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return f"softmax with dtype={dtype!r}"
    return None


def reduction_dim_reason(params: dict[str, Any], ndim: int) -> str | None:
    """None when the reduction's ``dim`` is the last dim of an ``ndim``-d input."""
    dim = params.get("dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or isinstance(dim, bool):
        return f"reduces over dim={dim!r}, not the last dim"
    if dim not in (-1, ndim - 1):
        return f"reduces over dim={dim}, not the last dim of a {ndim}-d tensor"
    return None


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
def _sig_dropout(input, p=0.5, training=True, inplace=False): ...
def _sig_dropout_torch(input, p, train): ...
def _sig_sum(input, dim=None, keepdim=False, *, dtype=None, out=None): ...
def _sig_amax(input, dim=(), keepdim=False, *, out=None): ...
def _sig_var(input, dim=None, unbiased=None, keepdim=False, *, correction=None, out=None): ...
def _sig_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5,
                    cudnn_enable=True): ...  # fmt: skip
def _sig_rms_norm(input, normalized_shape, weight=None, eps=None): ...
def _sig_softmax_functional(input, dim=None, _stacklevel=3, dtype=None): ...
def _sig_softmax(input, dim, dtype=None): ...
def _sig_cumsum(input, dim, *, dtype=None, out=None): ...


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
_op(OpDef("add", _B, "float"), _sig_alpha, [*_both("add"), operator.add])
_op(OpDef("sub", _B, "float"), _sig_alpha, [*_both("sub"), *_both("subtract"), operator.sub])
_op(OpDef("mul", _B, "float"), _sig_binary, [*_both("mul"), *_both("multiply"), operator.mul])
_op(
    OpDef("div", _B, "float", _reject_rounding_mode),
    _sig_div,
    [*_both("div"), *_both("divide"), *_both("true_divide"), operator.truediv],
)
_op(OpDef("neg", _U, "float"), _sig_unary, [*_both("neg"), *_both("negative"), operator.neg])
_op(
    OpDef("abs", _U, "float"),
    _sig_unary,
    [*_both("abs"), *_both("absolute"), operator.abs, builtins.abs],
)
for _name in ("exp", "log", "sqrt", "rsqrt", "reciprocal", "square", "tanh", "erf", "sin", "cos"):
    _op(OpDef(_name, _U, "float"), _sig_unary, _both(_name))
# pow's exponent must be a number: bind_op checks it (the exponent is a param, not an operand)
_op(OpDef("pow", ("input",), "float"), _sig_pow, [*_both("pow"), operator.pow])
_op(OpDef("sigmoid", _U, "float"), _sig_unary, [*_both("sigmoid"), torch.special.expit])
_op(OpDef("relu", _U, "float", _reject_inplace), _sig_unary_inplace, _both("relu"))
_op(
    OpDef("relu6", _U, "float", _reject_inplace),
    _sig_unary_inplace,
    [F.relu6, torch._C._nn.relu6],
)
_op(
    OpDef("gelu", _U, "float", _check_gelu),
    _sig_gelu,
    [*_both("gelu"), torch._C._nn.gelu],
)
_op(OpDef("silu", _U, "float", _reject_inplace), _sig_unary_inplace, [F.silu, "silu"])
# MobileNetV3's activations (timm, torchvision); their in-place forms: passes/out_of_place.py
_op(
    OpDef("hardswish", _U, "float", _reject_inplace),
    _sig_unary_inplace,
    [F.hardswish, torch._C._nn.hardswish],
)
_op(
    OpDef("hardsigmoid", _U, "float", _reject_inplace),
    _sig_unary_inplace,
    [F.hardsigmoid, torch._C._nn.hardsigmoid],
)
_op(
    OpDef("leaky_relu", _U, "float", _reject_inplace),
    _sig_leaky_relu,
    [F.leaky_relu, torch._C._nn.leaky_relu],
)
_op(
    OpDef("hardtanh", _U, "float", _reject_inplace),
    _sig_hardtanh,
    [F.hardtanh, torch._C._nn.hardtanh],
)
_op(OpDef("maximum", _B, "float"), _sig_binary, _both("maximum"))
_op(OpDef("minimum", _B, "float"), _sig_binary, _both("minimum"))
_BOUNDS = ("min", "max")
_op(
    OpDef("clamp", ("input", "min", "max"), "float", optional=_BOUNDS),
    _sig_clamp,
    [*_both("clamp"), *_both("clip")],
)
_op(OpDef("clamp_min", ("input", "min"), "float"), _sig_clamp_min, _both("clamp_min"))
_op(OpDef("clamp_max", ("input", "max"), "float"), _sig_clamp_max, _both("clamp_max"))
_op(
    OpDef("where", ("condition", "input", "other"), "float", bool_operands=("condition",)),
    _sig_where,
    [torch.where],
)
_SPELLINGS["where"] = (OP_TABLE["where"], inspect.signature(_sig_where_method))
_SPELLINGS[torch.Tensor.where] = _SPELLINGS["where"]
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _op(OpDef(_name, _B, "bool"), _sig_binary, [*_both(_name), getattr(operator, _name)])
_op(OpDef("greater", _B, "bool"), _sig_binary, _both("greater"))
# Boolean logic on masks (transformers' mask functions combine causal and padding masks
# with ``&``); bitwise spellings only for bool operands (bool_operands checks the dtype).
for _name, _spellings in (
    ("logical_and", [*_both("logical_and"), *_both("bitwise_and"), operator.and_, "__and__"]),
    ("logical_or", [*_both("logical_or"), *_both("bitwise_or"), operator.or_, "__or__"]),
):
    _op(OpDef(_name, _B, "bool", bool_operands=_B), _sig_binary, _spellings)
_op(
    OpDef("logical_not", _U, "bool", bool_operands=_U),
    _sig_unary,
    [*_both("logical_not"), *_both("bitwise_not"), operator.invert, "__invert__"],
)
_op(OpDef("less", _B, "bool"), _sig_binary, _both("less"))
# Non-finite checks (T5's fp16 clamp tests isinf(h).any() after each sublayer).
for _name in ("isinf", "isnan", "isfinite"):
    _op(OpDef(_name, _U, "bool"), _sig_unary, _both(_name))
# Casts: the target dtype comes from the node's example_value; the kernel rounds to it like
# every other value, so the op itself only converts bool <-> float.
_CAST_SPELLINGS = [
    "to",
    "float",
    "half",
    "bfloat16",
    "double",
    "type_as",
    "type",
    "int",
    "long",
    "bool",
    torch.Tensor.to,
    torch.Tensor.float,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.double,
    torch.Tensor.type_as,
    torch.Tensor.int,
    torch.Tensor.long,
    torch.Tensor.bool,
]
_op(OpDef("cast", _U, "float"), _sig_cast, _CAST_SPELLINGS)
# Dropout outside training returns its input: an alias, like a same-dtype cast (GPT-2 and
# BERT call it after their embeddings, where it stopped the lookup's group before the norm).
_op(OpDef("dropout", _U, "float", _check_dropout), _sig_dropout, [F.dropout])
_SPELLINGS[torch.dropout] = (OP_TABLE["dropout"], inspect.signature(_sig_dropout_torch))

# Reductions along the last dim with keepdim=True (the dim is checked against the input's
# rank by reduction_dim_reason, where the rank is known). var/std take correction (or the
# legacy unbiased flag); the lowering writes var as mean((x - mean(x))**2, correction).
_R = OpKind.REDUCTION
_op(OpDef("sum", _U, "float", _check_reduction, kind=_R), _sig_sum, _both("sum"))
_op(OpDef("mean", _U, "float", _check_reduction, kind=_R), _sig_sum, _both("mean"))
_op(OpDef("amax", _U, "float", _check_reduction, kind=_R), _sig_amax, _both("amax"))
_op(OpDef("amin", _U, "float", _check_reduction, kind=_R), _sig_amax, _both("amin"))
_op(OpDef("var", _U, "float", _check_reduction, kind=_R), _sig_var, _both("var"))
# any/all of boolean rows (passes/full_reductions.py splits a whole-tensor one into these)
for _name in ("any", "all"):
    _op(OpDef(_name, _U, "bool", _check_reduction, kind=_R, bool_operands=_U), _sig_amax,
        _both(_name))  # fmt: skip
_op(OpDef("std", _U, "float", _check_reduction, kind=_R), _sig_var, _both("std"))

# Norms over the last dim. Eager computes both in fp32 for half inputs and rounds once.
_W = ("input", "weight", "bias")
_op(
    OpDef("layer_norm", _W, "float", _check_norm, optional=("weight", "bias"), kind=OpKind.NORM),
    _sig_layer_norm,
    [F.layer_norm, torch.layer_norm],
)
_op(
    OpDef("rms_norm", ("input", "weight"), "float", _check_norm, optional=("weight",),
          kind=OpKind.NORM),
    _sig_rms_norm,
    [F.rms_norm, torch.rms_norm],
)  # fmt: skip


# softmax / log_softmax along the last dim: max-subtracted, accumulated in fp32 (fp64 for
# fp64), rounded once, as eager's kernels do. F.softmax's third positional is _stacklevel,
# torch.softmax's and Tensor.softmax's is dtype: two signatures.
for _name in ("softmax", "log_softmax"):
    _op(OpDef(_name, _U, "float", _check_softmax, kind=OpKind.SOFTMAX), _sig_softmax_functional,
        [getattr(F, _name)])  # fmt: skip
    _SPELLINGS[getattr(torch, _name)] = (OP_TABLE[_name], inspect.signature(_sig_softmax))
    _SPELLINGS[getattr(torch.Tensor, _name)] = _SPELLINGS[getattr(torch, _name)]
    _SPELLINGS[_name] = _SPELLINGS[getattr(torch, _name)]
    _SPELLINGS[getattr(torch.special, _name)] = _SPELLINGS[getattr(torch, _name)]

# An inclusive prefix sum along the last dim (RoBERTa's and MPNet's position ids from the
# padding mask, BLOOM's ALiBi positions): whole rows per program, in the dtype eager gives
# (integers exactly, in int64; floats accumulated in fp32).
_op(OpDef("cumsum", _U, "float", _check_scan, kind=OpKind.SCAN), _sig_cumsum, _both("cumsum"))

# A column rotation (rotate_half): no spelling; passes/rotation.py matches the slices,
# negation and concatenation that spell it. Params: shift, signs.
OP_TABLE["rotate"] = OpDef("rotate", _U, "float", kind=OpKind.MOVE)
# torch.cat read by a group: no spelling of its own (passes/concatenation.py binds it: its
# operands are the parts, as many as there are; params: dim, counted from the end, sizes).
OP_TABLE["concat"] = OpDef("concat", ("tensors",), "float", kind=OpKind.CONCAT)


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
    if op.kind == OpKind.NORM or op.name in ("var", "std"):
        values = _norm_params(op, values)
    if op.name == "pow":
        exponent = values.get("exponent")
        if not _is_number(exponent):
            return "pow with a tensor exponent is not fused (only Tensor ** number)"
    reason = op.check(values)
    if reason:
        return reason
    return OpCall(op, operands, values)


def _norm_params(op: OpDef, values: dict[str, Any]) -> dict[str, Any]:
    """Defaults made explicit: var/std's correction; norm epsilons stay None (the
    lowering knows the input dtype that rms_norm's default eps depends on)."""
    if op.name in ("var", "std"):
        correction, unbiased = values.pop("correction"), values.pop("unbiased")
        if correction is None:
            correction = 0 if unbiased is False else 1
        values["correction"] = correction
    values.pop("cudnn_enable", None)
    return values


def _bind_cast(op: OpDef, args: Sequence[Any], kwargs: dict[str, Any]) -> OpCall | str:
    bad = sorted(set(kwargs) - {"dtype", "non_blocking", "copy", "device"})
    if bad:
        return f"cast with {bad} is not fused"
    if not args:
        return "cast without a tensor"
    return OpCall(op, (args[0],), {})


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, complex)
