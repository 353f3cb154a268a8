"""Shape inference for row programs: the shapes of a program's values from its inputs'.

``value_shapes`` broadcasts every value as eager would (the launcher's full path);
``ShapeRecipe`` is what it derives once per pattern of inputs, so that a new size (a new
sequence length under dynamic shapes) only reads sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fusebackend.kernels.ir import InputRef, RowProgram, ValueRef, broadcast_shapes

__all__ = ["ShapeRecipe", "shape_pattern", "shape_recipe", "value_shapes"]


def value_shapes(
    program: RowProgram, inputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Size], torch.Size]:
    """(shape of every value, the group's shape), from the input shapes (eager broadcasting).

    The group's shape also covers the operands of reductions, whose rows the kernel reads
    although no value of the program has their width.
    """
    shapes: list[torch.Size] = []
    reduced: list[torch.Size] = []
    for lookup in program.lookups:
        index, table = inputs[lookup.index_slot], inputs[lookup.table_slot]
        shapes.append(torch.Size((*index.shape, table.shape[1])))
    for instr in program.instrs:
        operand_shapes = []
        for operand in instr.operands:
            if isinstance(operand, ValueRef):
                operand_shapes.append(shapes[operand.index])
            elif isinstance(operand, InputRef):
                operand_shapes.append(_shape(inputs[operand.slot]))
        shapes.append(instr.shape(operand_shapes))
        if instr.spans_row and not program.operand_is_narrow(instr.operands[0]):
            reduced.append(operand_shapes[0])
    group_shape = broadcast_shapes(*shapes, *reduced)
    for shape in reduced:
        if shape[-1] != group_shape[-1]:
            raise ValueError(
                f"a reduction or rotation reads rows of width {shape[-1]} in a group of width "
                f"{group_shape[-1]} (shape {tuple(group_shape)})"
            )
    return shapes, group_shape


_NO_DIMS = torch.Size(())


def _shape(value: Any) -> torch.Size:
    """A tensor's shape; a number (a scalar input) has none."""
    return value.shape if isinstance(value, torch.Tensor) else _NO_DIMS


@dataclasses.dataclass(frozen=True)
class ShapeRecipe:
    """How a launch's group shape and output shapes follow from its inputs' sizes, for
    inputs of one pattern (``shape_pattern``: dtypes, ranks, which dims are 1, row widths).

    ``value_shapes`` broadcasts every value of the program (~35 us for BERT's embeddings
    group of 3 lookups and 2 norms on a CPU); under dynamic shapes a new sequence length
    keeps the pattern, so the broadcast is derived once per pattern and a new length only
    reads the sizes: each group dim's from one input dim, with every other non-1 input dim
    checked equal to it (a mismatch takes the full path, which raises eager's error)."""

    group: tuple[tuple[int, int], ...]  # per group dim: (slot, dim) giving its size; (-1, 0): 1
    checks: tuple[tuple[int, int, int], ...]  # (slot, dim, group dim): non-1 sizes to compare
    outputs: tuple[tuple[int, ...], ...]  # per output: the group dim of each dim, -1 for 1

    def shapes(self, inputs: Sequence[Any]) -> tuple[list[torch.Size], torch.Size] | None:
        group = [1 if slot < 0 else inputs[slot].shape[dim] for slot, dim in self.group]
        for slot, dim, j in self.checks:
            if inputs[slot].shape[dim] != group[j]:
                return None
        outputs = [torch.Size([1 if j < 0 else group[j] for j in dims]) for dims in self.outputs]
        return outputs, torch.Size(group)


def _aligned_dims(
    program: RowProgram, inputs: Sequence[Any], rank: int
) -> Iterator[tuple[int, int, int]]:
    """(slot, dim, group dim) of every input dim that lines up with a dim of a group of
    ``rank`` dims (an index's dims with the row dims, a table's width with the last)."""
    for slot, t in enumerate(inputs):
        if slot in program.scalar_inputs:
            continue
        if slot in program.table_slots:
            yield slot, 1, rank - 1
        elif slot in program.index_slots:
            yield from ((slot, d, rank - 1 - t.dim() + d) for d in range(t.dim()))
        else:
            yield from ((slot, d, rank - t.dim() + d) for d in range(t.dim()))


def shape_recipe(
    program: RowProgram,
    inputs: Sequence[Any],
    outputs: Sequence[torch.Size],
    group_shape: torch.Size,
) -> ShapeRecipe | None:
    if program.concat_parts:
        return None  # a part's size along its dim is none of the group's: the full path
    rank = len(group_shape)
    group: list[tuple[int, int] | None] = [None if n != 1 else (-1, 0) for n in group_shape]
    checks = []
    for slot, dim, j in _aligned_dims(program, inputs, rank):
        if j < 0 or inputs[slot].shape[dim] == 1:
            continue
        if group[j] is None:
            group[j] = (slot, dim)
        else:
            checks.append((slot, dim, j))
    if any(g is None for g in group):
        return None  # a size no input gives (cannot happen): the full path every time
    maps = []
    for shape in outputs:
        offset = rank - len(shape)
        maps.append(tuple(-1 if n == 1 and group_shape[offset + i] != 1 else offset + i
                          for i, n in enumerate(shape)))  # fmt: skip
    return ShapeRecipe(tuple(group), tuple(checks), tuple(maps))  # type: ignore[arg-type]


def shape_pattern(program: RowProgram, inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What a ``ShapeRecipe`` holds for: per input its dtype, device, which dims are 1 and
    its row width (not an index's last dim: that is a row dim)."""
    key: list[Any] = []
    for slot, t in enumerate(inputs):
        if slot in program.scalar_inputs:
            key.append(None)
            continue
        ones = tuple(n == 1 for n in t.shape)
        width = None if slot in program.index_slots or not ones else t.shape[-1]
        key.append((t.dtype, t.device, ones, width))
    return tuple(key)
