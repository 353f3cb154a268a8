"""The plain description of a fused group that the kernel generator consumes.

It names no FX node: inputs are numbered slots, values are numbered in program order,
and each instruction carries its ready-made Triton expression template. A ``GroupSpec``
is hashable and is the key of the compiled-kernel cache (together with the rank).

Values: the first ``len(lookups)`` values are the gathered table rows, one per lookup;
instruction ``i`` defines value ``len(lookups) + i``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

__all__ = ["Const", "GroupSpec", "InputRef", "Instr", "KernelOptions", "Lookup", "ValueRef"]


@dataclasses.dataclass(frozen=True)
class InputRef:
    """An external tensor read elementwise (broadcast to the group's shape)."""

    slot: int


@dataclasses.dataclass(frozen=True)
class ValueRef:
    """A value computed inside the kernel."""

    index: int


@dataclasses.dataclass(frozen=True)
class Const:
    """A Python number, already written as a Triton literal."""

    literal: str


Operand = InputRef | ValueRef | Const | None  # None: an optional operand left out (clamp)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """``table[indices]``: rows of a 2-D table gathered by an integer index tensor."""

    index_slot: int
    table_slot: int


@dataclasses.dataclass(frozen=True)
class Instr:
    """``value = template.format(*operands)``, rounded to ``dtype`` as eager would."""

    name: str  # canonical op name, for comments in the generated source
    template: str  # Python format string over the operand expressions: "({0} * {1})"
    operands: tuple[Operand, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Everything the generator needs; input tensors arrive in ``input_dtypes`` order."""

    input_dtypes: tuple[torch.dtype, ...]
    lookups: tuple[Lookup, ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[int, ...]  # value indices written out, in the order returned

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
