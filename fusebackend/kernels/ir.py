"""The row program: a plain, hashable description of one fused group (the kernel IR).

A row program computes values of shape ``lead + [D]`` ("row" values) or ``lead + [1]``
("narrow" values: row reductions with keepdim, operands whose last dim is 1) for every row
of ``lead``. It names no FX node: inputs are numbered slots, values are numbered in program
order, ops carry canonical names and hashable params. So the same group in two layers of a
model is the same program and compiles to one kernel (the program is the compiled-kernel
cache key, with the rank and the build options).

Values: the first ``len(lookups)`` values are the gathered table rows, one per lookup;
instruction ``i`` defines value ``len(lookups) + i``. Instructions are elementwise
(``Instr``: an op of the table in ``passes/ops.py``, written by ``kernels/expressions.py``)
reductions along the last dim (``Reduce``) or column rotations of an external operand
(``Rotate``: rotary embeddings' ``rotate_half``). Each value is rounded to its ``dtype`` as
eager rounds it (all math runs in fp32, fp64 when any value is fp64).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

__all__ = [
    "Const",
    "InputRef",
    "Instr",
    "KernelOptions",
    "Lookup",
    "Reduce",
    "Rotate",
    "RowProgram",
    "ValueRef",
    "accumulate_dtype",
    "format_scalar",
]


def format_scalar(value: Any) -> str:
    """A Python number as a Triton literal (fp32 math; non-finite values spelled out)."""
    value = float(value)
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(value)


@dataclasses.dataclass(frozen=True)
class InputRef:
    """An external tensor read elementwise (broadcast to the group's shape by strides)."""

    slot: int


@dataclasses.dataclass(frozen=True)
class ValueRef:
    """A value computed inside the kernel."""

    index: int


@dataclasses.dataclass(frozen=True)
class Const:
    """A Python number, already written as a Triton literal (``Const.of(0.5)``)."""

    literal: str

    @classmethod
    def of(cls, value: Any) -> Const:
        return cls(format_scalar(value))


Operand = InputRef | ValueRef | Const | None  # None: an optional operand left out (clamp)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """``table[indices]``: rows of a 2-D table gathered by an integer index tensor."""

    index_slot: int
    table_slot: int


@dataclasses.dataclass(frozen=True)
class Instr:
    """``value = op(*operands, **params)``, elementwise, rounded to ``dtype``."""

    name: str  # canonical op name (passes/ops.py); kernels/expressions.py writes it
    operands: tuple[Operand, ...]
    dtype: torch.dtype
    params: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs, hashable

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)


@dataclasses.dataclass(frozen=True)
class Reduce:
    """A reduction of ``operand`` along the last dim, keepdim: a narrow value.

    ``mean`` divides the sum by ``N - correction`` (N: the operand's last dim), so
    ``var(x, correction=c)`` is ``mean((x - mean(x))**2, correction=c)``. The sum
    accumulates in fp32 (fp64 for fp64 programs); masked columns never contribute.
    """

    kind: str  # "sum", "mean", "max" or "min"
    operand: InputRef | ValueRef
    dtype: torch.dtype
    correction: float = 0.0


@dataclasses.dataclass(frozen=True)
class Rotate:
    """A column rotation of an external operand, with a sign per part (a row value).

    ``value[..., j] = signs[0] * x[..., j + shift]`` for ``j < D - shift``, else
    ``signs[1] * x[..., j - (D - shift)]``: ``cat((-x[..., s:], x[..., :s]), -1)``, the
    ``rotate_half`` of rotary embeddings (shift ``D // 2``, signs ``(-1, 1)``). The kernel
    loads ``x`` at permuted column offsets, so only an input can be rotated: a value
    computed in the kernel sits in other threads' registers at the permuted columns.
    """

    operand: InputRef
    shift: int
    signs: tuple[int, int]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class RowProgram:
    """Everything the generator needs; input tensors arrive in ``input_dtypes`` order.

    ``narrow_inputs``: slots whose last dim is 1 (a table of width 1, an operand of shape
    ``[..., 1]`` or 0-d). They are read once per row, not broadcast along the row, so a
    reduction over them reduces one element, as eager does.

    ``scalar_inputs``: slots that are Python numbers at run time, not tensors (a norm's
    ``eps`` that Dynamo passes into the graph as an input under dynamic shapes). The kernel
    takes each as a scalar argument (fp32; fp64 in fp64 programs), read at every call, so
    the program holds no value of it. Their ``input_dtypes`` entry is that type.
    """

    input_dtypes: tuple[torch.dtype, ...]
    lookups: tuple[Lookup, ...]
    instrs: tuple[Instr | Reduce | Rotate, ...]
    outputs: tuple[int, ...]  # value indices written out, in the order returned
    narrow_inputs: frozenset[int] = frozenset()
    scalar_inputs: frozenset[int] = frozenset()

    def __hash__(self) -> int:
        # Computed once: a program keys the compiled-kernel cache at every new launch plan,
        # and hashing its nested tuples took ~70 hash calls (a third of a plan from a
        # recipe, launch._ShapeRecipe). Equal programs still hash alike (same fields).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        # str hashes differ between processes: a pickled program must not carry its hash
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def value_dtype(self, index: int) -> torch.dtype:
        if index < len(self.lookups):
            return self.input_dtypes[self.lookups[index].table_slot]
        return self.instrs[index - len(self.lookups)].dtype

    # Cached: the launcher asks for every input on every call. (cached_property writes the
    # instance __dict__ directly, so it works on a frozen dataclass; eq and hash use fields.)
    @functools.cached_property
    def index_slots(self) -> frozenset[int]:
        return frozenset(lookup.index_slot for lookup in self.lookups)

    @functools.cached_property
    def table_slots(self) -> frozenset[int]:
        return frozenset(lookup.table_slot for lookup in self.lookups)

    @functools.cached_property
    def has_reduction(self) -> bool:
        return any(isinstance(i, Reduce) for i in self.instrs)

    @functools.cached_property
    def narrow_values(self) -> frozenset[int]:
        """Values of width 1: reductions and values computed from narrow operands only."""
        narrow: set[int] = set()
        for j, lookup in enumerate(self.lookups):
            if lookup.table_slot in self.narrow_inputs:
                narrow.add(j)
        base = len(self.lookups)

        def is_narrow(op: Operand) -> bool:
            if isinstance(op, InputRef):
                return op.slot in self.narrow_inputs or op.slot in self.scalar_inputs
            return not isinstance(op, ValueRef) or op.index in narrow

        for i, instr in enumerate(self.instrs):
            if isinstance(instr, Rotate):
                continue  # a rotation needs a row of width > 1
            if isinstance(instr, Reduce) or all(is_narrow(op) for op in instr.operands):
                narrow.add(base + i)
        return frozenset(narrow)

    def operand_is_narrow(self, operand: Operand) -> bool:
        if isinstance(operand, InputRef):
            return operand.slot in self.narrow_inputs or operand.slot in self.scalar_inputs
        if isinstance(operand, ValueRef):
            return operand.index in self.narrow_values
        return True  # constants and left-out operands have no width

    @functools.cached_property
    def compute_dtype(self) -> torch.dtype:
        dtypes = set(self.input_dtypes) | {i.dtype for i in self.instrs}
        return torch.float64 if torch.float64 in dtypes else torch.float32


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype eager accumulates a reduction of ``dtype`` in (fp64 for fp64, else fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How a group's kernel is built (part of the compiled-kernel cache key).

    Attributes:
        index_checks: build in Triton's debug mode so ``tl.device_assert`` checks every
            index on the device (eager CUDA embedding does the same).
        round_intermediates: round every intermediate value to the dtype eager gives it
            (bit-for-bit eager's rounding for one-op chains); False rounds only the outputs,
            as Inductor does, which is closer to exact and saves two conversions per op.
    """

    index_checks: bool = True
    round_intermediates: bool = True
