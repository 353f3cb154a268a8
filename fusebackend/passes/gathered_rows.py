"""Copies whose order wraps around, folded into a group by a table of row numbers.

``passes/folded_copies.py`` folds a copy into the group that writes or reads it where every
element's place is one stride per dim. A ``torch.roll`` before the copy wraps its rows around
(Swin's shifted windows: ``roll(norm1(x), -3, (1, 2))`` then the window partition's copy;
the window reverse's copy then ``roll(..., 3, (1, 2))`` before the residual add and norm2),
which no strides give, so there rows move by a table of row numbers instead, built at
compile time (an ``int32`` per row; the row dim itself still one stride):

- a group operand that is such a copy of a value: each row is gathered from the value,
  viewed as a 2-d table of rows, by the table (an unchecked ``Lookup`` of the program);
- a group output that only such a chain reads: each row is stored at its row of the copy's
  buffer (``RowProgram.placed_outputs``); the group's other outputs are as they were.

Left as traced: an operand or a buffer that is not rows of one stride (its row dim split, its
rows not a table), and a rotated operand (the kernel rotates only what it loads itself).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import torch.fx

from fusebackend.kernels.ir import (
    Concat,
    InputRef,
    Lookup,
    Reduce,
    Rotate,
    RowProgram,
    Scan,
    ValueRef,
)
from fusebackend.passes.concat_writes import join_written
from fusebackend.passes.fx_util import (
    call_evaluated,
    empty_node,
    example_value,
    layout_view,
    static_fake,
)

__all__ = ["gather_rows"]

_ROW_ORDER = "_infinifuse_row_order_"  # the owner's attributes holding the tables
_names = itertools.count()


def gather_rows(
    graph: torch.fx.Graph,
    owner: torch.nn.Module,
    group: torch.fx.Node,
    shape: torch.Size,
    choice: Any,
) -> bool:
    """Fold ``choice`` (folded_copies' ``_Read`` or ``_Write``, its ``offsets`` worked out)
    into ``group`` by a table of rows (module docstring); False where it cannot. The chain
    it replaces is left for the caller to erase."""
    if hasattr(choice, "slot"):
        return _gathered_read(graph, owner, group, shape, choice)
    return _placed_write(graph, owner, group, shape, choice)


def _row_numbers(offsets: torch.Tensor, start: int, rows: int, row_stride: int,
                 col_stride: int) -> torch.Tensor | None:  # fmt: skip
    """Per row of ``offsets`` (storage offsets, last dim the row), its row in a table of
    ``rows`` rows at ``start`` with those strides, or None where they are not such rows."""
    width = offsets.shape[-1]
    first = offsets[..., 0]
    steps = torch.arange(width, dtype=torch.int64) * col_stride
    if offsets.ne(first.unsqueeze(-1) + steps).any():
        return None
    relative = first - start
    if row_stride <= 0 or relative.remainder(row_stride).ne(0).any():
        return None
    numbers = relative // row_stride
    if numbers.numel() and (numbers.min() < 0 or numbers.max() >= rows):
        return None
    return numbers


def _table_of(value: torch.Tensor, width: int) -> tuple[int, int, int] | None:
    """(rows, row stride, column stride) of ``value`` viewed as ``(-1, width)``, or None
    where that view is no view."""
    if value.dim() == 0 or value.shape[-1] != width:
        return None
    table = layout_view(value, (-1, width))
    if table is None:
        return None
    row_stride = table.stride(0) if table.shape[0] > 1 else width * table.stride(1)
    return table.shape[0], row_stride, table.stride(1)


def _order_attr(graph: torch.fx.Graph, owner: torch.nn.Module, numbers: torch.Tensor,
                device: torch.device, like: torch.Tensor) -> torch.fx.Node:  # fmt: skip
    """A ``get_attr`` of ``numbers`` as an ``int32`` tensor on ``device`` kept on ``owner``."""
    name = f"{_ROW_ORDER}{next(_names)}"
    table = numbers.to(torch.int32).to(device)
    setattr(owner, name, table)
    node = graph.get_attr(name)
    node.meta["example_value"] = static_fake(like, table)
    return node


def _with_lookups(program: RowProgram, tables: set[int]) -> RowProgram | None:
    """``program`` reading each operand slot in ``tables`` as rows of a table gathered by
    one new index slot (appended after the inputs), or None where an operand is rotated or
    a part of a concatenation (read over its own range: not a table's rows)."""
    first = len(program.lookups)
    index_slot = len(program.input_dtypes)
    lookups = list(program.lookups)
    value_of = {}
    for slot in sorted(tables):
        value_of[slot] = len(lookups)
        lookups.append(Lookup(index_slot, slot, checked=False))
    shift = len(lookups) - first

    def moved(operand: Any) -> Any:
        if isinstance(operand, InputRef) and operand.slot in value_of:
            return ValueRef(value_of[operand.slot])
        if isinstance(operand, ValueRef) and operand.index >= first:
            return ValueRef(operand.index + shift)
        return operand

    instrs = []
    for instr in program.instrs:
        if isinstance(instr, Rotate | Concat):
            if any(op.slot in value_of for op in instr.operands):
                return None
            instrs.append(instr)
        elif isinstance(instr, Reduce | Scan):
            instrs.append(dataclasses.replace(instr, operand=moved(instr.operand)))
        else:
            instrs.append(dataclasses.replace(instr, operands=tuple(map(moved, instr.operands))))
    return dataclasses.replace(
        program,
        input_dtypes=(*program.input_dtypes, torch.int32),
        lookups=tuple(lookups),
        instrs=tuple(instrs),
        outputs=tuple(v + shift if v >= first else v for v in program.outputs),
    )


def _new_op(group: torch.fx.Node, program: RowProgram) -> Any:
    op = group.target
    new = type(op)(program, op.__name__, op._reference_graph, op.device, op.options)
    new.group = op.group
    return new


def _gathered_read(graph: torch.fx.Graph, owner: torch.nn.Module, group: torch.fx.Node,
                   shape: torch.Size, read: Any) -> bool:  # fmt: skip
    program = group.target.program
    if read.slot in program.narrow_inputs:
        return False
    source = example_value(read.source)
    found = _table_of(source, shape[-1])
    if found is None:
        return False
    rows, row_stride, col_stride = found
    numbers = _row_numbers(read.offsets, source.storage_offset(), rows, row_stride, col_stride)
    new = _with_lookups(program, {read.slot})
    if numbers is None or new is None:
        return False
    with graph.inserting_before(group):
        table = call_evaluated(graph, torch.reshape, (read.source, (-1, shape[-1])))
        order = _order_attr(graph, owner, numbers, source.device, source)
    args = list(group.args)
    args[read.slot] = table
    group.target = _new_op(group, new)
    group.args = (*args, order)
    return True


def _placed_write(graph: torch.fx.Graph, owner: torch.nn.Module, group: torch.fx.Node,
                  shape: torch.Size, write: Any) -> bool:  # fmt: skip
    program = group.target.program
    width, last = shape[-1], example_value(write.chain[-1])
    contiguous = torch.empty(last.shape, device="meta").stride()
    if last.shape[-1] != width or tuple(write.stride) != tuple(contiguous):
        return False
    numbers = _row_numbers(write.offsets, 0, shape.numel() // width, width, 1)
    if numbers is None:
        return False
    slot = len(program.input_dtypes)
    new = dataclasses.replace(program, input_dtypes=(*program.input_dtypes, torch.int32),
                              placed_outputs=((write.k, slot),))  # fmt: skip
    with graph.inserting_before(group):
        order = _order_attr(graph, owner, numbers, last.device, last)
        buffer = empty_node(graph, last.shape, contiguous, last)
        rows = call_evaluated(graph, torch.reshape, (buffer, (-1, width)))
    group.target = _new_op(group, new).writing_into([write.k], [])
    group.args = (*group.args, order, rows)
    outs = list(example_value(group))
    outs[write.k] = example_value(rows)
    group.meta["example_value"] = tuple(outs)
    write.item.meta["example_value"] = example_value(rows)
    end = write.chain[-1]
    with graph.inserting_before(end):
        end.replace_all_uses_with(join_written(graph, buffer, write.item))
    return True
