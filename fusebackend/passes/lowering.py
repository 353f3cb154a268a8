"""A group of FX nodes -> a RowProgram (the kernel IR), its input nodes and its outputs.

Each member becomes instructions: a lookup a gather; an elementwise op one ``Instr``; a
reduction a ``Reduce``; a ``cumsum`` a ``Scan``; a ``rotate_half`` one ``Rotate`` (its
slices and negation, the candidate's ``parts``, none); a ``torch.cat`` one ``Concat``
(each part an input slot of its own); ``var``/``std``, the norms and softmax several
instructions, written the way eager computes them for half-precision inputs: in fp32 (fp64 for fp64
inputs), rounded once at the end. Intermediate values of those sequences carry the
accumulation dtype, so ``round_intermediates`` never rounds them. The program names no FX
node: the same group in two layers lowers to an equal program.

An elementwise group over tensors stored in another dim order than their shape's (a
channels-last image: ``[N, C, H, W]`` stored ``[N, H, W, C]``) is lowered over its tensors
in storage order (``LoweredGroup.order``: the rewrite reads them through ``permute`` views),
so the kernel's rows run along the contiguous dim and its outputs keep the layout, as
eager's elementwise ops keep it. Walked in shape order, a channels-last row of ``W``
values sits ``C`` elements apart in memory, and the outputs would come out in another
layout than eager's (the next convolution then transposes them back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

from fusebackend.kernels.ir import (
    Concat,
    Const,
    InputRef,
    Instr,
    Lookup,
    Operand,
    Reduce,
    Rotate,
    RowProgram,
    Scan,
    ValueRef,
    accumulate_dtype,
)
from fusebackend.passes.embedding_fusion import embedding_args
from fusebackend.passes.fx_util import example_value, known_channels_last
from fusebackend.passes.groups import (
    Candidate,
    LoweredGroup,
    is_alias,
    is_graph_scalar,
    match,
)
from fusebackend.passes.ops import OpCall, OpKind

__all__ = ["in_order", "lower", "lower_tail"]

_REDUCE_KIND = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min"}


def _scalar_for(call: OpCall, value: Any) -> Any:
    """Comparisons run in the tensor operand's dtype in eager, the scalar rounded to it
    (``x == 0.1`` is True where an fp16 x holds fp16(0.1)); arithmetic keeps it in fp32."""
    if call.op.result != "bool":
        return value
    for operand in call.operands:
        if isinstance(operand, torch.fx.Node):
            dtype = example_value(operand).dtype
            if dtype.is_floating_point:
                return torch.tensor(value, dtype=dtype).item()
    return value


def _params(call: OpCall) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in call.params.items() if k != "inplace"))


def in_order(shape: Any, order: tuple[int, ...]) -> tuple[Any, ...]:
    """``shape`` broadcast to ``len(order)`` dims (leading 1s) and its dims in ``order``."""
    padded = (1,) * (len(order) - len(shape)) + tuple(shape)
    return tuple(padded[d] for d in order)


def _walk_order(candidate: Candidate) -> tuple[int, ...] | None:
    """The dim order to lower ``candidate`` in (``LoweredGroup.order``), or None for the
    shape's own: only elementwise groups (no lookup, reduction, norm or rotation: those
    work along the last dim) of rank >= 3 whose outputs have the group's whole shape and
    are stored, static, in one other order: the layout Dynamo's example values give them,
    which is eager's (its elementwise ops' outputs follow their inputs' layout)."""
    if candidate.lookups or candidate.parts:
        return None
    if any(call.op.kind not in (OpKind.ELEMENTWISE, OpKind.CONCAT)
           for call in candidate.calls.values()):  # fmt: skip
        return None
    values = [example_value(m) for m in candidate.members]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    shape = torch.broadcast_shapes(*(v.shape for v in values))
    members = set(candidate.members)
    outputs = [example_value(m) for m in candidate.members
               if any(u not in members for u in m.users)]  # fmt: skip
    if len(shape) < 3 or any(v.shape != shape for v in outputs):
        return None  # (an output is permuted back from the kernel's: it needs every dim)
    if not all(isinstance(n, int) for v in outputs for n in (*v.shape, *v.stride())):
        # symbolic sizes (dynamic=True, a second batch size): channels-last is recognised
        # from its stride formula, asked without adding a guard
        return (0, 2, 3, 1) if all(map(known_channels_last, outputs)) else None
    orders = {tuple(compute_elementwise_output_logical_to_physical_perm(v)[0]) for v in outputs}
    if len(orders) != 1:
        return None  # outputs in several layouts: each written contiguous, as before
    (order,) = orders
    # Only where the contiguous dim is not the last: with it last (a transposed [B, H, T, D])
    # the rows already run along memory, and the output stays contiguous as it was measured.
    return None if order[-1] == len(shape) - 1 else order


class _Builder:
    def __init__(self, order: tuple[int, ...] | None = None) -> None:
        self.order = order  # the dim order the group is lowered in (None: as shaped)
        self.slots: dict[tuple[torch.fx.Node, str], int] = {}
        self.inputs: list[torch.fx.Node] = []
        self.dtypes: list[torch.dtype] = []
        self.narrow: set[int] = set()
        self.scalars: set[int] = set()
        self.lookups: list[Lookup] = []
        self.instrs: list[Instr | Reduce | Scan | Rotate | Concat] = []
        self.values: dict[torch.fx.Node, int] = {}

    def slot(self, node: torch.fx.Node, role: str) -> int:
        key = (node, role)
        if key not in self.slots:
            value = example_value(node)
            self.slots[key] = len(self.inputs)
            self.inputs.append(node)
            self.dtypes.append(value.dtype)
            shape = in_order(value.shape, self.order) if self.order else value.shape
            width = shape[-1] if len(shape) else 1
            part = role.startswith("part")  # read over its range, never once per row
            if role != "index" and not part and isinstance(width, int) and width == 1:
                self.narrow.add(self.slots[key])
        return self.slots[key]

    def scalar(self, node: torch.fx.Node, dtype: torch.dtype) -> InputRef:
        """A number computed in the graph (a norm's eps under dynamic shapes): a scalar
        argument of the kernel, of ``dtype``, read at each call."""
        key = (node, f"scalar {dtype}")
        if key not in self.slots:
            self.slots[key] = len(self.inputs)
            self.inputs.append(node)
            self.dtypes.append(dtype)
            self.scalars.add(self.slots[key])
        return InputRef(self.slots[key])

    def eps(self, call: OpCall, default: float, acc: torch.dtype) -> Operand:
        eps = call.params.get("eps")
        if isinstance(eps, torch.fx.Node):
            return self.scalar(eps, acc)
        return Const.of(default if eps is None else eps)

    def ref(self, call: OpCall, operand: Any, dtype: torch.dtype) -> Operand:
        """``operand`` of an op whose result is of ``dtype``."""
        if operand is None:
            return None
        if isinstance(operand, torch.fx.Node):
            if operand in self.values:
                return ValueRef(self.values[operand])
            if is_graph_scalar(operand):  # used as eager uses a number: in fp32 (fp64 ops: fp64)
                return self.scalar(operand, accumulate_dtype(dtype))
            return InputRef(self.slot(operand, "tensor"))
        return Const.of(_scalar_for(call, operand))

    def add(self, instr: Instr | Reduce | Scan | Rotate | Concat) -> ValueRef:
        self.instrs.append(instr)
        return ValueRef(len(self.lookups) + len(self.instrs) - 1)

    def concat(self, node: torch.fx.Node, call: OpCall, dtype: torch.dtype) -> ValueRef:
        """Each part a slot of its own (its strides are a part's, not the group's), the dim
        counted from the end of the shape the kernel walks."""
        parts = tuple(InputRef(self.slot(p, f"part of {node.name}")) for p in call.operands)
        dim = call.params["dim"]
        if self.order is not None:
            dim = self.order.index(len(self.order) + dim) - len(self.order)
        return self.add(Concat(parts, dim, tuple(call.params["sizes"]), dtype))

    def member(self, node: torch.fx.Node, call: OpCall) -> None:
        dtype = example_value(node).dtype
        name, kind = call.op.name, call.op.kind
        if kind == OpKind.CONCAT:
            self.values[node] = self.concat(node, call, dtype).index
            return
        operands = [self.ref(call, op, dtype) for op in call.operands]
        lowering = _elementwise if kind == OpKind.ELEMENTWISE else _LOWERINGS.get(name)
        if lowering is None:  # the op table and this lowering disagree: a bug, never a user's
            raise AssertionError(f"no lowering for op {name!r} ({kind})")
        self.values[node] = lowering(self, call, operands, dtype).index


# -- each op kind's instructions, by op name (``_LOWERINGS``) --------------------------------

Lowering = Callable[[_Builder, OpCall, list[Operand], torch.dtype], ValueRef]
_LOWERINGS: dict[str, Lowering] = {}


def _lowers(*names: str) -> Callable[[Lowering], Lowering]:
    """Register a lowering for the table ops ``names`` (``_Builder.member`` looks it up)."""

    def register(lowering: Lowering) -> Lowering:
        for name in names:
            _LOWERINGS[name] = lowering
        return lowering

    return register


def _elementwise(b: _Builder, call: OpCall, args: list[Operand], dtype: torch.dtype) -> ValueRef:
    """Any elementwise op: one ``Instr`` (kernels/expressions.py spells it)."""
    return b.add(Instr(call.op.name, tuple(args), dtype, _params(call)))


@_lowers(*_REDUCE_KIND)
def _reduction(b: _Builder, call: OpCall, args: list[Operand], dtype: torch.dtype) -> ValueRef:
    return b.add(Reduce(_REDUCE_KIND[call.op.name], args[0], dtype))


@_lowers("any", "all")
def _any_or_all(b: _Builder, call: OpCall, args: list[Operand], dtype: torch.dtype) -> ValueRef:
    """any(x) = sum(x) > 0 and all(x) = sum(not x) == 0 over a row, the bools summed as fp32
    (exact to 2**24 columns; a row of no columns: any False, all True, as eager's)."""
    x = args[0]
    if call.op.name == "all":
        x = b.add(Instr("logical_not", (x,), torch.bool))
    count = b.add(Reduce("sum", b.add(Instr("cast", (x,), torch.float32)), torch.float32))
    found = b.add(Instr("gt", (count, Const.of(0.0)), torch.bool))
    return found if call.op.name == "any" else b.add(Instr("logical_not", (found,), torch.bool))


@_lowers("cumsum")
def _scan(b: _Builder, call: OpCall, args: list[Operand], dtype: torch.dtype) -> ValueRef:
    return b.add(Scan(args[0], dtype))


@_lowers("var", "std")
def _var_or_std(b: _Builder, call: OpCall, args: list[Operand], dtype: torch.dtype) -> ValueRef:
    """var(x) = mean((x - mean(x))**2) over N - correction: two passes, as stable as eager's
    Welford for the row widths of interest (no catastrophic cancellation); std its root."""
    acc = accumulate_dtype(example_value(call.operands[0]).dtype)
    correction = float(call.params["correction"])
    is_var = call.op.name == "var"
    _, result = _centred_and_variance(b, args[0], acc, dtype if is_var else acc, correction)
    return result if is_var else b.add(Instr("sqrt", (result,), dtype))


def _centred_and_variance(
    b: _Builder, x: Operand, acc: torch.dtype, dtype: torch.dtype, correction: float = 0.0
) -> tuple[ValueRef, ValueRef]:
    """(x - mean(x), mean((x - mean(x))**2) over N - correction): var's two passes, and a
    LayerNorm's centring and variance."""
    mean = b.add(Reduce("mean", x, acc))
    centred = b.add(Instr("sub", (x, mean), acc))
    square = b.add(Instr("mul", (centred, centred), acc))
    return centred, b.add(Reduce("mean", square, dtype, correction))


def _normalized(b: _Builder, x: Operand, variance: Operand, eps: Operand, weight: Operand,
                acc: torch.dtype) -> ValueRef:  # fmt: skip
    """x * rsqrt(variance + eps), times ``weight`` where there is one: a norm's tail."""
    inv = b.add(Instr("rsqrt", (b.add(Instr("add", (variance, eps), acc)),), acc))
    y = b.add(Instr("mul", (x, inv), acc))
    return y if weight is None else b.add(Instr("mul", (y, weight), acc))


@_lowers("layer_norm")
def _layer_norm(b: _Builder, call: OpCall, args: list[Operand], dtype: torch.dtype) -> ValueRef:
    x, weight, bias = args
    acc = accumulate_dtype(example_value(call.operands[0]).dtype)
    eps = b.eps(call, 1e-5, acc)
    xf = b.add(Instr("cast", (x,), acc))
    centred, var = _centred_and_variance(b, xf, acc, acc)
    y = _normalized(b, centred, var, eps, weight, acc)
    if bias is not None:
        y = b.add(Instr("add", (y, bias), acc))
    return b.add(Instr("cast", (y,), dtype))


@_lowers("softmax", "log_softmax")
def _softmax(b: _Builder, call: OpCall, args: list[Operand], dtype: torch.dtype) -> ValueRef:
    """softmax = exp(x - max) / sum(exp(x - max)); log_softmax = x - max - log(sum):
    eager's max-subtracted form, in fp32 (fp64 when input or result is fp64) for any
    input dtype, rounded once (``dtype=torch.float32`` only changes the result dtype)."""
    source = example_value(call.operands[0]).dtype
    acc = accumulate_dtype(torch.float64 if torch.float64 in (source, dtype) else source)
    xf = b.add(Instr("cast", (args[0],), acc))
    peak = b.add(Reduce("max", xf, acc))
    shifted = b.add(Instr("sub", (xf, peak), acc))
    exp = b.add(Instr("exp", (shifted,), acc))
    total = b.add(Reduce("sum", exp, acc))
    if call.op.name == "softmax":
        y = b.add(Instr("div", (exp, total), acc))
    else:
        y = b.add(Instr("sub", (shifted, b.add(Instr("log", (total,), acc))), acc))
    return b.add(Instr("cast", (y,), dtype))


@_lowers("rms_norm")
def _rms_norm(b: _Builder, call: OpCall, args: list[Operand], dtype: torch.dtype) -> ValueRef:
    # torch 2.13's CPU rms_norm multiplies by the weight in fp32 and rounds once
    # (measured: bit-equal on fp16 rows of 4097; rounding before the weight, as the
    # composite does, was 0.0078 off).
    x, weight = args
    source = example_value(call.operands[0]).dtype
    acc = accumulate_dtype(source)
    eps = b.eps(call, torch.finfo(source).eps, acc)
    xf = b.add(Instr("cast", (x,), acc))
    square = b.add(Instr("mul", (xf, xf), acc))
    mean = b.add(Reduce("mean", square, acc))
    return b.add(Instr("cast", (_normalized(b, xf, mean, eps, weight, acc),), dtype))


@_lowers("rotate")
def _rotate(b: _Builder, call: OpCall, args: list[Operand], dtype: torch.dtype) -> ValueRef:
    (source,) = args
    assert isinstance(source, InputRef), source  # the partition rotates inputs only
    params = call.params
    return b.add(Rotate(source, params["shift"], tuple(params["signs"]), dtype,
                        params["interleaved"], params["width"]))  # fmt: skip


def lower(candidate: Candidate) -> LoweredGroup:
    """The group lowered to a ``RowProgram``, with the graph values it reads (``inputs``)
    and replaces (``outputs``): a new ``LoweredGroup``; the candidate is left as it was.
    Lowered from the nodes' current arguments (an earlier group's rewrite may have replaced
    an operand by that group's output), so the rewrite lowers each group as it comes."""
    return _lowered(candidate)


def _lowered(candidate: Candidate) -> LoweredGroup:
    order = _walk_order(candidate)
    b = _Builder(order)
    for node in candidate.lookups:
        args = embedding_args(node)
        lookup = Lookup(b.slot(args["input"], "index"), b.slot(args["weight"], "table"))
        b.lookups.append(lookup)
        b.values[node] = len(b.lookups) - 1
    calls: dict[torch.fx.Node, OpCall] = {}
    for node in candidate.ops:
        # Re-match from the node's current arguments: an earlier group's rewrite may have
        # replaced an operand by that group's output.
        call = match(node)
        assert isinstance(call, OpCall), call
        calls[node] = call
        if is_alias(call, node):
            b.values[node] = b.values[call.operands[0]]
            continue
        b.member(node, call)
    members = set(candidate.members)
    outputs = [m for m in candidate.members if any(u not in members for u in m.users)]
    distinct: list[int] = []
    output_slot: dict[torch.fx.Node, int] = {}
    for member in outputs:
        if b.values[member] not in distinct:
            distinct.append(b.values[member])
        output_slot[member] = distinct.index(b.values[member])
    values = [example_value(m) for m in candidate.members]  # a split's value is a tuple
    program = RowProgram(
        tuple(b.dtypes),
        tuple(b.lookups),
        tuple(b.instrs),
        tuple(distinct),
        frozenset(b.narrow),
        frozenset(b.scalars),
    )
    rank = max(v.dim() for v in values if isinstance(v, torch.Tensor)) - 1
    return LoweredGroup(program, rank, tuple(b.inputs), tuple(outputs), output_slot, calls,
                        order)  # fmt: skip


def lower_tail(source: torch.fx.Node, nodes: list[torch.fx.Node]) -> RowProgram | None:
    """Elementwise ``nodes`` (graph order) that read only ``source`` (slot 0), each other and
    numbers, lowered as a group's members are, their last node's value the one output: a
    matmul group's epilogue (passes/activations.py, kernels/epilogue.py). None where they
    read anything else or compute nothing (only aliases of ``source``)."""
    b = _Builder()
    b.slot(source, "tensor")
    for node in nodes:
        call = match(node)
        if not isinstance(call, OpCall) or call.op.kind != OpKind.ELEMENTWISE:
            return None
        if is_alias(call, node):
            operand = call.operands[0]
            if operand in b.values:
                b.values[node] = b.values[operand]
            else:  # an alias of an input (a cast to its own dtype): read as that input
                b.slots[(node, "tensor")] = b.slot(operand, "tensor")
            continue
        b.member(node, call)
    if len(b.inputs) != 1 or b.scalars or b.narrow or nodes[-1] not in b.values:
        return None
    return RowProgram(tuple(b.dtypes), (), tuple(b.instrs), (b.values[nodes[-1]],))
