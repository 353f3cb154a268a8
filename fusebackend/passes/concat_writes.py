"""Concatenations written in place by the groups that compute their parts (fused graph).

``torch.cat`` copies its parts into a new tensor: one more kernel, which reads and writes the
whole result once more. Where every part is an output of a fused row group, each group
writes its part straight into a view of the concatenation's buffer (a row kernel addresses
its outputs through strides: ``kernels/launch.row_kernel``'s ``out``), and the ``cat`` is
gone. A part that other nodes read too is stored twice by its kernel: as before, and into
the buffer. GhostNet's ghost modules (the activation of a 1x1 convolution beside that of the
depthwise convolution reading it), Inception's branches and CSP blocks end this way.
``torch.stack`` is the same, each part a ``select`` of the result: an interleaved rotary
embedding's ``stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)`` (GPT-J's layout) is one
group writing both halves into the result.

Before the groups are formed, ``push_into_concatenations`` runs an elementwise op that reads
a concatenation (perhaps sliced along its dim) on each part instead, where every part is
itself an elementwise op's result or, for an add of a tensor of the result's shape and
dtype, a depthwise convolution's launch:
``cat([a, b], 1)[:, :k] + r`` becomes ``cat([a + r_a, b + r_b], 1)``, each operand of the
full shape narrowed to its part. Each part's group then takes the op in, a depthwise launch
takes an add as its residual (``passes/depthwise.take_residual_adds``), and the op's own
kernel is gone (GhostNet's second ghost module of every bottleneck: BatchNorm, concatenation,
residual add).

A launcher of one value that takes a tensor to write it into (``out_position``: the
depthwise convolution's ``out``) writes its part the same way, where the cat is the value's
only reader (GhostNet's first ghost module of each bottleneck).

Left as traced: a part that is not a group's output (a cuDNN convolution's, a graph input), parts
of another dtype or device than the result, symbolic sizes, a part written in place anywhere
in the graph (its value at the ``cat`` would not be the one its kernel wrote), a tensor that
is two parts of one ``cat``, a group already paired with another (passes/pairing.py).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx

from fusebackend.passes.concatenation import CAT_FUNCTIONS
from fusebackend.passes.fx_util import (
    call_evaluated,
    empty_node,
    evaluate,
    example_value,
    static_layout,
)
from fusebackend.passes.graph import is_mutation
from fusebackend.passes.mutations import storage_id, written_storages
from fusebackend.passes.ops import OpKind, lookup_op

__all__ = ["join_written", "push_into_concatenations", "write_concatenations", "written_parts"]

_STACK = torch.stack  # the same, each part one index along a new dim (a select of the result)


@dataclasses.dataclass
class _Part:
    """One part of a concatenation, as the output ``k`` of the fused node ``fused``."""

    node: torch.fx.Node  # the cat's argument
    fused: torch.fx.Node
    k: int
    back: tuple[int, ...] | None  # the permute from the kernel's output to ``node``, if any
    item: torch.fx.Node  # the getitem of the kernel's output
    alone: bool  # the cat is the only reader of the kernel's output
    offset: int = 0  # where it starts along the cat's dim
    k_written: int = 0  # the output the kernel writes into the buffer


def write_concatenations(graph: torch.fx.Graph) -> list[str]:
    """Have the fused groups write the parts of each concatenation they compute into its
    buffer (module docstring); returns the names of the ``cat`` nodes replaced."""
    written = written_storages(graph.nodes)
    replaced = []
    targets = (*CAT_FUNCTIONS, _STACK)
    for cat in [n for n in graph.nodes if n.op == "call_function" and n.target in targets]:
        found = _parts(cat, written)
        if found is not None:
            _rewrite(graph, cat, *found)
            replaced.append(cat.name)
    if replaced:
        graph.lint()
    return replaced


def _cat_args(cat: torch.fx.Node) -> tuple[list[Any], int, torch.Tensor] | None:
    """(parts, dim made non-negative, result) of a ``cat``/``stack`` call of static sizes on
    distinct parts, or None."""
    if set(cat.kwargs) - {"dim"} or len(cat.args) > 2 or not isinstance(cat.args[0], list | tuple):
        return None
    nodes = list(cat.args[0])
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    result = example_value(cat)
    if not (
        static_layout(result) and isinstance(dim, int) and nodes and len(set(nodes)) == len(nodes)
    ):
        return None
    return nodes, dim % result.dim(), result


def _parts(cat: torch.fx.Node, written: set[int]) -> tuple[list[_Part], int] | None:
    """The parts of ``cat`` and its dim, where every part is a group's output."""
    found = _cat_args(cat)
    if found is None:
        return None
    nodes, dim, result = found
    stacked = cat.target is _STACK
    parts: list[_Part] = []
    offset = 0
    for node in nodes:
        part = _part(node, cat)
        value = example_value(node)
        if part is None or not static_layout(value) or value.dim() != result.dim() - stacked:
            return None
        if (value.dtype, value.device) != (result.dtype, result.device):
            return None
        if storage_id(value) in written:
            return None
        part.offset = offset
        offset += 1 if stacked else value.shape[dim]
        parts.append(part)
    return parts, dim


def _part(node: Any, cat: torch.fx.Node) -> _Part | None:
    """``node`` as a fused group's output (a ``getitem``, perhaps permuted back from the
    kernel's storage order: passes/rewrite.py), or None."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_function" and len(node.args) == _out_position(node.target):
        # a launcher of one value that takes a tensor to write it into (a depthwise
        # convolution's), not yet given one, taken where the cat is its only reader
        return _Part(node, node, -1, None, node, True) if set(node.users) == {cat} else None
    item, back = node, None
    if node.op == "call_function" and node.target is torch.permute:
        item, back = node.args[0], tuple(node.args[1])
    if not (isinstance(item, torch.fx.Node) and item.target is operator.getitem):
        return None
    fused, k = item.args
    op = fused.target
    if not (hasattr(op, "writing_into") and not op.into and isinstance(k, int)):
        return None
    alone = set(node.users) == {cat} and (item is node or set(item.users) == {node})
    return _Part(node, fused, k, back, item, alone)


def _out_position(target: Any) -> int | None:
    """Where a launcher of one value takes the tensor to write it into (its ``out_position``:
    ``kernels.depthwise_conv.depthwise_conv2d``), or None."""
    return getattr(target, "out_position", None)


def _rewrite(graph: torch.fx.Graph, cat: torch.fx.Node, parts: list[_Part], dim: int) -> None:
    position = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min((p.fused for p in parts), key=position.__getitem__)):
        result = _buffer(graph, cat, parts, dim)
    by_group: dict[torch.fx.Node, list[_Part]] = {}
    for part in parts:
        by_group.setdefault(part.fused, []).append(part)
    for fused, own in by_group.items():
        op = fused.target
        if _out_position(op) is not None:  # (_part: one value, read by the cat alone)
            (part,) = own
            length = example_value(part.node).shape[dim]
            with graph.inserting_before(fused):
                target = call_evaluated(graph, torch.narrow, (result, dim, part.offset, length))
            fused.args = (*fused.args, target)
            fused.meta["example_value"] = example_value(target)
            continue
        outputs = list(example_value(fused))
        into, repeats, targets = [], [], []
        with graph.inserting_before(fused):
            for part in own:
                if cat.target is _STACK:
                    target = call_evaluated(graph, torch.select, (result, dim, part.offset))
                else:
                    length = example_value(part.node).shape[dim]
                    target = call_evaluated(graph, torch.narrow, (result, dim, part.offset, length))
                if part.back is not None:  # the kernel's output, before it was permuted back
                    inverse = tuple(sorted(range(len(part.back)), key=part.back.__getitem__))
                    target = call_evaluated(graph, torch.permute, (target, inverse))
                if part.alone:
                    part.k_written = part.k
                    outputs[part.k] = example_value(target)
                else:  # read elsewhere too: stored once more, into the buffer
                    part.k_written = len(outputs)
                    repeats.append(part.k)
                    outputs.append(example_value(target))
                into.append(part.k_written)
                targets.append(target)
        fused.target = op.writing_into(into, repeats)
        fused.args = (*fused.args, *targets)
        fused.meta["example_value"] = tuple(outputs)
    written = []
    for part in parts:
        if part.alone and part.node is not part.item:
            part.node.replace_all_uses_with(part.item)  # (the cat, erased below)
            graph.erase_node(part.node)  # the permute back, which only the cat read
        if part.alone:
            written.append(part.item)
        else:
            with graph.inserting_after(part.fused):
                item = graph.call_function(operator.getitem, (part.fused, part.k_written))
            item.meta["example_value"] = example_value(part.fused)[part.k_written]
            written.append(item)
    with graph.inserting_before(cat):
        joined = join_written(graph, result, *written)
    cat.replace_all_uses_with(joined)
    graph.erase_node(cat)


def join_written(graph: torch.fx.Graph, buffer: torch.fx.Node, *parts: torch.fx.Node) -> Any:
    """A ``written_parts`` node (where the graph inserts now): ``buffer`` once ``parts``, the
    fused nodes' outputs written into it, are."""
    joined = graph.call_function(written_parts, (buffer, *parts))
    joined.meta["example_value"] = example_value(buffer)
    return joined


def written_parts(buffer: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
    """The concatenation ``buffer`` once ``parts``, views of it that fused groups write, are
    written: taking them as arguments keeps their groups ahead of its readers (and alive:
    dead-code elimination would drop a group whose outputs nothing reads)."""
    return buffer


def _buffer(graph: torch.fx.Graph, cat: torch.fx.Node, parts: list[_Part], dim: int) -> Any:
    """A node allocating the concatenation's result, with the strides ``torch.cat`` gives
    the parts as they are now (channels-last parts give a channels-last result)."""
    values = [example_value(p.node) for p in parts]
    meta = cat.target([torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                       for v in values], dim)  # fmt: skip
    return empty_node(graph, meta.shape, meta.stride(), values[0])


def push_into_concatenations(graph: torch.fx.Graph) -> list[str]:
    """Run each elementwise op that reads a concatenation of elementwise results on its
    parts instead (module docstring); returns the names of the ops pushed."""
    pushed: list[str] = []
    while True:
        cats = [n for n in graph.nodes if n.op == "call_function" and n.target in CAT_FUNCTIONS]
        name = next((name for cat in cats if (name := _push(graph, cat)) is not None), None)
        if name is None:
            break
        pushed.append(name)
    if pushed:
        graph.lint()
    return pushed


def _elementwise(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    row = lookup_op(node.op, node.target)
    return row is not None and row[0].kind == OpKind.ELEMENTWISE and not is_mutation(node)


def _takes_a_residual(node: Any) -> bool:
    """Is ``node`` a launcher of one value that can still add a tensor to it (an empty
    ``residual_position``: the depthwise convolution's)? Only an add is pushed onto it
    (``_residual_add``), which becomes its residual (``passes/depthwise.take_residual_adds``):
    any other op would be a launch of its own there."""
    position = getattr(getattr(node, "target", None), "residual_position", None)
    return (position is not None and node.op == "call_function" and len(node.args) > position
            and node.args[position] is None)  # fmt: skip


def _residual_add(op: torch.fx.Node, read: torch.fx.Node, full: list[Any], value: Any) -> bool:
    """Is ``op`` ``read + t`` (alpha 1) with ``t`` of ``read``'s shape and dtype: the add
    that ``passes/depthwise.take_residual_adds`` makes a depthwise launch's residual?"""
    row = lookup_op(op.op, op.target)
    if row is None or row[0].name != "add" or op.kwargs.get("alpha", 1) != 1:
        return False
    others = [n for n in op.all_input_nodes if n is not read]
    return (len(op.args) == 2 and len(others) == 1 and others[0] in full
            and example_value(others[0]).dtype == value.dtype)  # fmt: skip


def _slice_along(node: torch.fx.Node, dim: int, size: int) -> tuple[int, int] | None:
    """[start, stop) of ``node``, a getitem slicing only ``dim`` with step 1, or None."""
    index = node.args[1] if node.target is operator.getitem and len(node.args) == 2 else None
    index = index if isinstance(index, tuple) else (index,)
    if len(index) <= dim or not all(isinstance(i, slice) for i in index):
        return None
    if any(i != slice(None) for k, i in enumerate(index) if k != dim):
        return None
    start, stop, step = index[dim].start, index[dim].stop, index[dim].step
    if step not in (None, 1) or not all(x is None or type(x) is int for x in (start, stop)):
        return None
    return slice(start, stop).indices(size)[:2]


def _push(graph: torch.fx.Graph, cat: torch.fx.Node) -> str | None:
    """Push the one elementwise op reading ``cat`` onto its parts; its name, or None."""
    found = _cat_args(cat)
    pushable = lambda part: _elementwise(part) or _takes_a_residual(part)  # noqa: E731
    if found is None or len(cat.users) != 1 or not all(map(pushable, found[0])):
        return None
    parts, dim, result = found
    read, (op,) = cat, cat.users
    lo, hi = 0, result.shape[dim]
    if op.target is operator.getitem:  # a slice along the dim first
        span = _slice_along(op, dim, hi)
        if span is None or len(op.users) != 1:
            return None
        (lo, hi), read, (op,) = span, op, op.users
    value = example_value(read)
    if not _elementwise(op) or op.all_input_nodes.count(read) != 1:
        return None
    if not (static_layout(value) and tuple(example_value(op).shape) == tuple(value.shape)):
        return None
    bounds = [0]
    for part in parts:
        bounds.append(bounds[-1] + example_value(part).shape[dim])
    if lo not in bounds or hi not in bounds:
        return None  # a part cut by the slice: its narrowed view would end its group there
    operands = [n for n in op.all_input_nodes if n is not read]
    full = [n for n in operands if _shape_of(n) == tuple(value.shape)]
    if not all(n in full or _broadcast_along(_shape_of(n), value.dim(), dim) for n in operands):
        return None
    if not all(map(_elementwise, parts)) and not _residual_add(op, read, full, value):
        return None  # (on a depthwise part any other op would be a launch of its own)
    pieces = []
    with graph.inserting_before(op):
        for part, start, stop in zip(parts, bounds, bounds[1:]):
            if stop <= lo or start >= hi:
                continue  # sliced away (the slice cuts at part bounds only)
            narrowed = {n: call_evaluated(graph, torch.narrow, (n, dim, start - lo, stop - start))
                        for n in full}  # fmt: skip
            mapping = {read: part, **narrowed}
            args = torch.fx.node.map_arg(op.args, lambda n, m=mapping: m.get(n, n))
            kwargs = torch.fx.node.map_arg(op.kwargs, lambda n, m=mapping: m.get(n, n))
            new = graph.create_node(op.op, op.target, args, kwargs)
            new.meta["example_value"] = evaluate(new)
            pieces.append(new)
        joined = call_evaluated(graph, cat.target, (pieces, dim))
    name = op.name
    op.replace_all_uses_with(joined)
    for node in (op, read, cat):
        if not node.users and node in graph.nodes:
            graph.erase_node(node)
    return name


def _shape_of(node: torch.fx.Node) -> tuple[int, ...] | None:
    value = example_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _broadcast_along(shape: tuple[int, ...] | None, rank: int, dim: int) -> bool:
    """Does a tensor of ``shape`` broadcast along ``dim`` of a ``rank``-d value (a number,
    a 0-d tensor, or size 1 or absent at that dim)?"""
    if shape is None:
        return True  # a number
    at = dim - (rank - len(shape))
    return len(shape) <= rank and (at < 0 or shape[at] == 1)
