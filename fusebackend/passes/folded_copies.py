"""Copies that only move elements, folded into the fused groups that write or read them.

A ``.contiguous()`` (or ``clone``, or a ``reshape`` that cannot be a view) after a chain of
views and permutes is a kernel of its own that reads and writes the whole tensor once more
to put its elements in another order. Swin's window partition (``x.view(B, H/7, 7, W/7, 7,
C).permute(0, 1, 3, 2, 4, 5).contiguous()`` after its LayerNorm) and window reverse (the
same after the attention's projection, before the residual add and the next LayerNorm) are
two per block.

A row kernel addresses every tensor through its own strides over the group's row dims
(kernels/launch.py), so such an order is free to it wherever it is strided: over the group's
row dims split finer (H into H/7 x 7), every element's place is one stride per dim. Here

- a group's output that only such a chain reads is written by the group straight into the
  copy's buffer (``FusedGroupOp.writing_into``), through a strided view of it;
- a group's operand that is such a chain's copy of a value is read through a strided view
  of that value itself;

and the group runs over the finer row dims: its other operands are split into them by views
(splitting a dim is always a view), its other outputs viewed back. An elementwise program
(no reduction) may have its row dim split too (LeViT's attention output, ``(attn @ v)
.transpose(1, 2).reshape(B, N, heads * d)``, read by a hardswish: rows of d); and a group of
one elementwise op forms only where it takes a copy in (passes/partition.py: two kernels
become one). Where each element goes
is worked out by running the chain on a tensor of positions (no rule per view op), and kept
only where it is one stride per finer dim, checked element by element. The row dim of a
row-wise program stays whole (the kernel steps along a row by one stride). A view of a value
is taken with the strides that value had when traced; ``strided_view`` checks them at each
call, so a layout other than the traced one raises (and falls back, its reason given)
instead of reading the wrong elements.

Where no strides give the order (a ``torch.roll`` wraps it around), rows are gathered by a
table of row numbers instead (passes/gathered_rows.py).

Left as traced: sizes that are not plain ints, chains that other nodes also read, operands
that broadcast, groups paired with another or already writing into a concatenation, several
choices of finer dims that do not agree (the first kept).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fusebackend.kernels.ir import Concat, Rotate
from fusebackend.passes.concat_writes import join_written
from fusebackend.passes.fx_util import (
    call_evaluated,
    empty_node,
    evaluate,
    example_value,
    layout_view,
    static_layout,
)
from fusebackend.passes.gathered_rows import gather_rows
from fusebackend.passes.reshapes import nested_cuts

__all__ = ["copy_folds_into", "fold_copies_into_groups", "moves_elements_by_copy", "strided_view"]

# Ops that pick, reorder or copy elements and compute nothing (as methods and functions).
_METHODS = {"view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "flatten",
            "unflatten", "contiguous", "clone", "narrow", "select", "movedim", "roll"}  # fmt: skip
_FUNCTIONS = {torch.reshape, torch.permute, torch.transpose, torch.t, torch.unsqueeze,
              torch.squeeze, torch.flatten, torch.unflatten, torch.clone, torch.narrow,
              torch.select, torch.movedim, torch.roll, operator.getitem}  # fmt: skip
_DROPOUTS = {torch.nn.functional.dropout, torch.dropout}
# Position maps are built on the CPU at compile time: 8 bytes per element, several copies.
_MAX_ELEMENTS = 1 << 25


def strided_view(
    base: torch.Tensor,
    size: Sequence[int],
    stride: Sequence[int],
    offset: int,
    traced: tuple[tuple[int, ...], int],
) -> torch.Tensor:
    """``base.as_strided(size, stride, offset)``, where ``base`` has the strides and storage
    offset it was traced with (``traced``), else a RuntimeError: the view was worked out
    for that layout."""
    if (tuple(base.stride()), base.storage_offset()) != traced:
        raise RuntimeError(
            f"a copy folded into a fused group expects its source with strides {traced[0]} "
            f"at offset {traced[1]}, got {tuple(base.stride())} at {base.storage_offset()}"
        )
    return base.as_strided(size, stride, offset)


def fold_copies_into_groups(graph: torch.fx.Graph, owner: torch.nn.Module) -> list[str]:
    """Fold element-moving copies into the groups that write or read them (module
    docstring); returns the names of the copies gone. ``owner``: the module whose
    attributes the graph's ``get_attr`` nodes read (row orders are kept there)."""
    folded: list[str] = []
    for node in list(graph.nodes):
        op = node.target
        if node.op == "call_function" and hasattr(op, "writing_into") and op.use_triton:
            if not op.into:
                folded += _fold(graph, owner, node)
    if folded:
        graph.eliminate_dead_code()
        graph.lint()
    return folded


def copy_folds_into(node: torch.fx.Node, operand: torch.fx.Node) -> bool:
    """Would a group of ``node`` alone take a copy in: is its ``operand`` a chain of views
    with a reordering copy in it that only ``node`` reads, or is its only reader such a
    chain? (The partition's test for a one-op group that pays: two kernels become one.)"""
    chain, value = operand, example_value(operand)
    if not (isinstance(value, torch.Tensor) and value.shape == example_value(node).shape):
        return False
    readers = [node]
    while _moves_elements(chain) and [*chain.users] == readers:
        if _copies(chain):
            return True
        readers, chain = [chain], chain.args[0]
    chain = node
    while len(chain.users) == 1:
        (user,) = chain.users
        if not (_moves_elements(user) and user.args[0] is chain):
            return False
        if _copies(user):
            return True
        chain = user
    return False


# -- which nodes move elements ------------------------------------------------------------


def moves_elements_by_copy(node: Any) -> bool:
    """Is ``node`` a copy (a kernel of its own) that only moves its input's elements?"""
    return _moves_elements(node) and _copies(node)


def _moves_elements(node: Any) -> bool:
    """Is ``node`` a view, permute or copy of its first argument, with every other argument
    a constant (so it can run on a tensor of positions)?"""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return False
    if node.op == "call_method":
        known = node.target in _METHODS
    elif node.op == "call_function":
        known = node.target in _FUNCTIONS or (node.target in _DROPOUTS and _eval_dropout(node))
    else:
        return False
    if not known or not isinstance(node.args[0], torch.fx.Node):
        return False
    if not isinstance(example_value(node.args[0]), torch.Tensor):
        return False  # a getitem of a tuple (a group's outputs, unbind's)
    found: list[Any] = []  # nodes and symbols among the other arguments (slices' included)
    torch.fx.node.map_aggregate((*node.args[1:], *node.kwargs.values()),
                                lambda v: found.append(v) if _is_variable(v) else None)  # fmt: skip
    return not found and static_layout(example_value(node))


def _is_variable(value: Any) -> bool:
    return isinstance(value, torch.fx.Node | torch.SymInt | torch.SymFloat | torch.Tensor)


def _eval_dropout(node: torch.fx.Node) -> bool:
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return training is False


def _copies(node: torch.fx.Node) -> bool:
    """Does ``node`` write a new tensor (a kernel), rather than view its input? Decided by
    layouts: passes re-evaluate example values, so fake storages are no guide."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    source, value = example_value(node.args[0]), example_value(node)
    if name in ("clone", "roll"):
        return True
    if name == "contiguous":
        return not source.is_contiguous()
    if name in ("reshape", "flatten", "unflatten"):
        return layout_view(source, value.shape) is None
    return False


def _run_chain(chain: Sequence[torch.fx.Node], start: torch.Tensor) -> torch.Tensor:
    """The chain's ops applied to ``start`` in place of the chain's first input."""
    value = start
    for node in chain:
        value = evaluate(node, lambda n, first=node.args[0], v=value: v if n is first else n)
    return value


# -- where each element goes: one stride per finer dim ------------------------------------

Atoms = list[list[tuple[int, int]]]  # per dim of the group: (size, stride), outer first


def _atoms(offsets: torch.Tensor) -> tuple[Atoms, int] | None:
    """``offsets`` (one storage offset per element) as ``base + sum(i_k * stride_k)`` over a
    split of each dim into finer dims; (per dim its finer dims, base) or None."""
    shape = offsets.shape
    base = int(offsets.flatten()[0]) if offsets.numel() else 0
    atoms: Atoms = []
    for d, n in enumerate(shape):
        if n <= 1:
            atoms.append([(n, 0)])
            continue
        along = offsets[tuple(slice(None) if k == d else 0 for k in range(len(shape)))] - base
        dim_atoms, inner = [], 1
        while inner < n:
            stride, m = int(along[inner]), 2
            while inner * m < n and int(along[inner * m]) == m * stride:
                m += 1
            size = max((k for k in range(1, m + 1) if (n // inner) % k == 0), default=1)
            if size == 1:
                return None
            dim_atoms.insert(0, (size, stride))
            inner *= size
        atoms.append(dim_atoms)
    if _rebuilt(atoms, base, shape).ne(offsets).any():
        return None
    return atoms, base


def _rebuilt(atoms: Atoms, base: int, shape: torch.Size) -> torch.Tensor:
    sizes = [size for dim in atoms for size, _ in dim]
    strides = [stride for dim in atoms for _, stride in dim]
    flat = torch.zeros(sizes, dtype=torch.int64) + base
    for k, (size, stride) in enumerate(zip(sizes, strides)):
        step = torch.arange(size, dtype=torch.int64) * stride
        flat += step.view([size if j == k else 1 for j in range(len(sizes))])
    return flat.reshape(shape)


def _finer(choices: list[Atoms], dims: int) -> list[list[int]] | None:
    """Per dim, the sizes of a split finer than every choice's (None where they cross)."""
    finest = []
    for d in range(dims):
        bounds = {1}
        total = 1
        for atoms in choices:
            inner = 1
            for size, _ in reversed(atoms[d]):
                inner *= size
                bounds.add(inner)
            total = inner
        ordered = nested_cuts(bounds)
        if ordered is None:
            return None
        sizes = [b // a for a, b in zip(ordered, ordered[1:])] or [total]
        finest.append(list(reversed(sizes)))
    return finest


def _on_finer(atoms: Atoms, finer: list[list[int]]) -> tuple[list[int], list[int]]:
    """Sizes and strides of ``atoms`` split into the ``finer`` dims (each of its own dims
    is a run of them: ``_finer``)."""
    sizes, strides = [], []
    for dim_atoms, dim_sizes in zip(atoms, finer):
        if dim_sizes == [1] or dim_sizes == [0]:
            sizes.append(dim_sizes[0])
            strides.append(0)
            continue
        pieces = list(reversed(dim_sizes))  # inner first
        inner_first = []
        for size, stride in reversed(dim_atoms):
            covered = 1
            while covered < size:
                piece = pieces.pop(0)
                inner_first.append((piece, stride * covered))
                covered *= piece
        for size, stride in reversed(inner_first):
            sizes.append(size)
            strides.append(stride)
    return sizes, strides


def _split_shape(
    shape: Sequence[int], align: Sequence[int], finer: list[list[int]]
) -> list[int] | None:
    """``shape``, broadcasting to ``align`` (right-aligned), with each of its dims split as
    ``finer`` splits ``align``'s (a dim of 1 into as many 1s), or None."""
    start = len(align) - len(shape)
    if start < 0:
        return None
    out: list[int] = []
    for i, n in enumerate(shape):
        if n == align[start + i]:
            out += finer[start + i]
        elif n == 1:
            out += [1] * len(finer[start + i])
        else:
            return None
    return out


# -- the rewrite ----------------------------------------------------------------------------


class _Write:
    """Output ``k`` of the group (read only by ``chain``, which ends in a copy) written
    straight into a buffer of ``stride`` (the copy's) that takes the copy's place;
    ``offsets``: where each of the output's elements goes in it."""

    def __init__(self, k: int, item: torch.fx.Node, chain: list[torch.fx.Node],
                 stride: tuple[int, ...], offsets: torch.Tensor) -> None:  # fmt: skip
        self.k, self.item, self.chain, self.stride, self.offsets = k, item, chain, stride, offsets
        found = _atoms(offsets)
        self.atoms, self.base = found if found is not None else (None, 0)


class _Read:
    """Input ``slot`` of the group (``chain`` from ``source``, with a copy in it) read
    through a strided view of ``source``; ``offsets``: where each of its elements is in
    ``source``'s storage."""

    def __init__(self, slot: int, source: torch.fx.Node, chain: list[torch.fx.Node],
                 offsets: torch.Tensor) -> None:  # fmt: skip
        self.slot, self.source, self.chain, self.offsets = slot, source, chain, offsets
        found = _atoms(offsets)
        self.atoms, self.base = found if found is not None else (None, 0)


def _group_shape(node: torch.fx.Node) -> torch.Size | None:
    """The shape of the group's full-width outputs, where every output is that shape or
    one value per row of it, its sizes plain ints."""
    outs = example_value(node)
    if not isinstance(outs, tuple) or not outs:
        return None
    shape = max((o.shape for o in outs), key=lambda s: s[-1] if len(s) else 0)
    if len(shape) < 2 or not all(isinstance(n, int) and n > 0 for n in shape):
        return None
    narrow = torch.Size((*shape[:-1], 1))
    if any(o.shape not in (shape, narrow) for o in outs) or shape.numel() > _MAX_ELEMENTS:
        return None
    return shape


def _write_of(k: int, item: torch.fx.Node, shape: torch.Size) -> _Write | None:
    chain, node = [], item
    while len(node.users) == 1:
        (user,) = node.users
        if not (_moves_elements(user) and user.args[0] is node):
            break
        chain.append(user)
        node = user
    copies = [i for i, n in enumerate(chain) if _copies(n)]
    if not copies:
        return None
    chain = chain[: copies[-1] + 1]
    stride = tuple(example_value(chain[-1]).stride())
    last = example_value(chain[-1])
    numel = shape.numel()
    layout = torch.empty_strided(last.shape, stride, device="meta")
    if last.numel() != numel or _dense_size(layout) != numel:
        return None
    positions = _run_chain(chain, torch.arange(numel, dtype=torch.int64).view(shape))
    flat = positions.flatten()
    if torch.bincount(flat, minlength=numel).ne(1).any():
        return None  # an element dropped or repeated: not a reordering
    offsets = torch.empty(numel, dtype=torch.int64)
    offsets[flat] = _storage_offsets(layout).flatten()
    return _Write(k, item, chain, stride, offsets.view(shape))


def _read_of(slot: int, arg: Any, group: torch.fx.Node, shape: torch.Size) -> _Read | None:
    if not isinstance(arg, torch.fx.Node) or set(arg.users) != {group}:
        return None
    if group.args.count(arg) != 1 or getattr(example_value(arg), "shape", None) != shape:
        return None
    chain, node = [], arg
    while _moves_elements(node) and len(node.users) == 1:
        chain.insert(0, node)
        node = node.args[0]
    value = example_value(node)
    if not any(map(_copies, chain)) or not (
        isinstance(node, torch.fx.Node) and static_layout(value)
    ):
        return None
    if value.numel() > _MAX_ELEMENTS:
        return None
    return _Read(slot, node, chain, _run_chain(chain, _storage_offsets(value)))


def _elementwise(program: Any) -> bool:
    """Does ``program`` compute each element from the same element of its operands alone
    (no reduction, rotation, concatenation, lookup or one-value-per-row operand), so that
    its rows can be cut anywhere?"""
    return not (program.has_reduction or program.lookups or program.narrow_inputs
                or any(isinstance(i, Rotate | Concat) for i in program.instrs))  # fmt: skip


def _dense_size(value: torch.Tensor) -> int:
    """How many elements of its storage ``value`` spans from its offset."""
    return 1 + sum((n - 1) * abs(s) for n, s in zip(value.shape, value.stride()) if n > 0)


def _storage_offsets(value: torch.Tensor) -> torch.Tensor:
    """Each element's offset in ``value``'s storage, shaped like ``value``."""
    start = value.storage_offset()
    flat = torch.arange(start + _dense_size(value), dtype=torch.int64)
    return flat.as_strided(tuple(value.shape), tuple(value.stride()), start)


def _fold(graph: torch.fx.Graph, owner: torch.nn.Module, group: torch.fx.Node) -> list[str]:
    shape = _group_shape(group)
    if shape is None:
        return []
    op = group.target
    program = op.program
    items = [u for u in group.users if u.target is operator.getitem and isinstance(u.args[1], int)]
    if len(items) != len(group.users):
        return []
    choices: list[_Write | _Read] = []
    outs = example_value(group)
    for item in items:
        k = item.args[1]
        if outs[k].shape == shape and sum(i.args[1] == k for i in items) == 1:
            choices.append(_write_of(k, item, shape))
    skipped = program.table_slots | program.scalar_inputs | program.index_slots
    for slot, arg in enumerate(group.args):
        if slot not in skipped:
            choices.append(_read_of(slot, arg, group, shape))
    choices = [c for c in choices if c is not None]
    kept: list[_Write | _Read] = []
    for choice in choices:
        if choice.atoms is None or (len(choice.atoms[-1]) != 1 and not _elementwise(program)):
            continue  # no stride per dim, or a row split that a row-wise program cannot take
        if _finer([c.atoms for c in (*kept, choice)], len(shape)) is not None:
            kept.append(choice)
    if not kept:  # an order that wraps around (a roll): rows gathered by index instead
        for choice in choices:
            names = [n.name for n in choice.chain if _copies(n)]
            if gather_rows(graph, owner, group, shape, choice):
                _erase_backwards(graph, choice.chain[-1])
                return names
        return []
    finer = _finer([c.atoms for c in kept], len(shape))
    assert finer is not None
    if program.concat_parts and any(len(atoms) != 1 for atoms in finer):
        return []  # a concatenation's parts are read at their own sizes: none to cut finer
    names = [n.name for c in kept for n in c.chain if _copies(n)]
    _rewrite(graph, group, shape, finer, kept, items)
    return names


def _rewrite(
    graph: torch.fx.Graph,
    group: torch.fx.Node,
    shape: torch.Size,
    finer: list[list[int]],
    kept: list[_Write | _Read],
    items: list[torch.fx.Node],
) -> None:
    op = group.target
    program = op.program
    reads = {c.slot: c for c in kept if isinstance(c, _Read)}
    writes = {c.k: c for c in kept if isinstance(c, _Write)}
    args = list(group.args)
    dests = []
    with graph.inserting_before(group):
        for slot, arg in enumerate(args):
            value = example_value(arg) if isinstance(arg, torch.fx.Node) else None
            if slot in reads:
                read = reads[slot]
                source = example_value(read.source)
                sizes, strides = _on_finer(read.atoms, finer)
                traced = (tuple(source.stride()), source.storage_offset())
                view = (read.source, sizes, strides, read.base, traced)
                args[slot] = call_evaluated(graph, strided_view, view)
            elif (
                isinstance(value, torch.Tensor)
                and slot not in program.table_slots
                and slot not in program.concat_parts
            ):  # (parts: read at their own sizes)
                align = shape[:-1] if slot in program.index_slots else shape
                split = _split_shape(value.shape, align, finer[: len(align)])
                assert split is not None, "a group's operand broadcasts to its shape"
                if split != list(value.shape):
                    args[slot] = call_evaluated(graph, torch.reshape, (arg, tuple(split)))
        for k, write in sorted(writes.items()):
            last = example_value(write.chain[-1])
            buffer = empty_node(graph, last.shape, write.stride, last)
            sizes, strides = _on_finer(write.atoms, finer)
            view = (buffer, sizes, strides, write.base, (write.stride, 0))
            dest = call_evaluated(graph, strided_view, view)
            dests.append((k, buffer, dest))
    outs = list(example_value(group))
    lead = [n for dim in finer[:-1] for n in dim]
    for k, out in enumerate(outs):
        # an elementwise program's row may be split too: its finer dims lead but the last
        sizes = (*lead, *finer[-1]) if out.shape[-1] == shape[-1] else (*lead, 1)
        with out.fake_mode:
            outs[k] = torch.empty(sizes, dtype=out.dtype, device=out.device)
    for k, _, dest in dests:
        outs[k] = example_value(dest)
    if dests:
        group.target = op.writing_into([k for k, _, _ in dests], [])
    group.args = (*args, *(dest for _, _, dest in dests))
    group.meta["example_value"] = tuple(outs)
    for item in items:
        k = item.args[1]
        original = example_value(item)
        item.meta["example_value"] = outs[k]
        if k in writes:
            last = writes[k].chain[-1]
            buffer = next(b for j, b, _ in dests if j == k)
            with graph.inserting_before(last):
                last.replace_all_uses_with(join_written(graph, buffer, item))
            _erase_backwards(graph, last)
        else:
            with graph.inserting_after(item):
                back = graph.call_function(torch.reshape, (item, tuple(original.shape)))
            back.meta["example_value"] = evaluate(back)
            item.replace_all_uses_with(back, delete_user_cb=lambda user, b=back: user is not b)
    for read in reads.values():
        _erase_backwards(graph, read.chain[-1])


def _erase_backwards(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and the chain of element movers before it that nothing else reads."""
    while _moves_elements(node) and not node.users:
        before = node.args[0]
        graph.erase_node(node)
        node = before
