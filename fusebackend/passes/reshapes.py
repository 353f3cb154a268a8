"""Reshapes moved ahead of the elementwise ops they follow (fused graph only).

A group's kernel computes its values in one shape and writes them contiguous, so a reshape of a
value computed in a group ends the group there, and the ops after it start another kernel.
timm's LeViT runs each linear layer's BatchNorm1d over its tokens flattened,
``bn(x.flatten(0, 1)).reshape_as(x)``: once the BatchNorm is a scale and shift
(``batch_norm_folding``), its ops run on ``[B*N, C]`` and the hardswish or residual add after
the reshape on ``[B, N, C]``, two kernels where one does (LeViT-128S: 40 such reshapes a call).

A reshape of a contiguous value into another contiguous shape keeps the elements' order, so an
elementwise op before it can run in the reshaped shape instead: ``view(f(a, b))`` becomes
``f(view(a), view(b))``, where each operand of the op's full shape is reshaped the same way
(the reshape node copied onto it) and each broadcast operand must broadcast the same way in
both shapes (a number, a 0-d tensor, or a vector along a last dim both shapes share: the
BatchNorm's per-channel scale), or, for static sizes, be viewed so that it does (each dim of
the new shape that it covers whole or broadcasts over entirely: ``_broadcast_after``).
Repeated, the reshape climbs the chain until it meets what produced the chain's input, where
a reshape back to that value's own shape is dropped. The ops then sit between the producer
and the consumers in one shape, and one group takes them.

A softmax along the last dim of a reshape that keeps that dim runs before the reshape instead
(``_move_down``): Swin's shifted windows add their mask in a 5-d view of the scores and take
the softmax in the 4-d one, and the adds and the softmax become one group.

Left alone: an op read elsewhere too (it would run twice), non-contiguous operands (the copied
reshape would copy), and broadcasts that change meaning with the shape.

A cast of a permuted value (``move_casts_above_permutes``) runs on the value before the permute
instead, and the permute views its result: ``x.permute(p).to(dtype)`` is ``x.to(dtype).permute
(p)``, element for element and stride for stride (a cast keeps its input's dense layout), and
the cast joins the group computing ``x``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.fx

from fusebackend.passes.fx_util import (
    evaluate,
    example_value,
    known_contiguous,
    known_equal,
    layout_view,
)
from fusebackend.passes.graph import is_mutation
from fusebackend.passes.ops import OpKind, lookup_op

__all__ = ["move_casts_above_permutes", "move_reshapes_up", "nested_cuts"]

_METHODS = {"view", "reshape", "reshape_as", "view_as", "flatten", "unflatten"}
_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten}


def _source(node: torch.fx.Node) -> torch.fx.Node | None:
    """What ``node`` reshapes, where it is a reshape of a node (else None)."""
    method = node.op == "call_method" and node.target in _METHODS
    if not method and not (node.op == "call_function" and node.target in _FUNCTIONS):
        return None
    source = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    return source if isinstance(source, torch.fx.Node) else None


def _tensor(node: object) -> torch.Tensor | None:
    value = example_value(node) if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(map(known_equal, a.shape, b.shape))


def _order_kept(before: torch.Tensor, after: torch.Tensor) -> bool:
    """A reshape between two contiguous values of one count and dtype keeps the order."""
    return (
        before.dtype == after.dtype
        and known_equal(before.numel(), after.numel())
        and known_contiguous(before)
        and known_contiguous(after)
    )


def _broadcasts_alike(operand: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> bool:
    """Does ``operand`` broadcast the same way against both shapes? A 0-d or all-ones shape
    does; so does a vector along the last dim where both shapes end in that dim."""
    sizes = list(operand.shape)
    while sizes and sizes[0] == 1:
        sizes.pop(0)
    if not sizes:
        return operand.dim() <= after.dim()
    return (
        len(sizes) == 1
        and operand.dim() <= after.dim()
        and before.dim() > 0
        and after.dim() > 0
        and known_equal(sizes[0], before.shape[-1])
        and known_equal(sizes[0], after.shape[-1])
    )


def _broadcast_after(
    operand: torch.Tensor, before: torch.Tensor, after: torch.Tensor
) -> tuple[int, ...] | None:
    """The shape ``operand`` (broadcast against ``before``) takes to broadcast the same way
    against ``after``, for static sizes, or None. Both shapes split into their common finer
    dims; a dim of ``after`` whose finer dims the operand covers whole keeps its size, one
    it broadcasts over entirely becomes 1, one mixing both has no such shape. Swin's
    shifted windows: a ``(nW*B, heads, N, N)`` score plus a ``(1, heads, N, N)`` bias, viewed
    ``(B, nW, heads, N, N)``, gives a ``(1, 1, heads, N, N)`` bias."""
    shapes = (operand.shape, before.shape, after.shape)
    if not all(isinstance(n, int) for shape in shapes for n in shape):
        return None
    if operand.dim() > before.dim():
        return None
    sizes = [1] * (before.dim() - operand.dim()) + list(operand.shape)
    if any(n not in (1, m) for n, m in zip(sizes, before.shape)):
        return None
    full = [n == m for n, m in zip(sizes, before.shape)]
    atoms = _finer_dims(before.shape, after.shape)
    if atoms is None:
        return None
    in_before, in_after = _owners(before.shape, atoms), _owners(after.shape, atoms)
    out = []
    for j, size in enumerate(after.shape):
        kinds = {full[in_before[a]] for a in atoms if in_after[a] == j}
        if size == 1 or kinds == {True}:
            out.append(size)
        elif kinds == {False}:
            out.append(1)
        else:
            return None
    return tuple(out)


def _inner_products(shape: Sequence[int]) -> list[int]:
    """Per dim, the product of its size and the sizes after it."""
    products, inner = [], 1
    for n in reversed(shape):
        inner *= n
        products.append(inner)
    return list(reversed(products))


def nested_cuts(cuts: Iterable[int]) -> list[int] | None:
    """Element counts at which dims start (inner products, 1 included), sorted, where each
    divides the next: the finer dims that several splits of one extent share; None where
    two splits cross (6 as 2 x 3 and as 3 x 2)."""
    ordered = sorted(set(cuts))
    if any(hi % lo for lo, hi in zip(ordered, ordered[1:])):
        return None
    return ordered


def _finer_dims(a: Sequence[int], b: Sequence[int]) -> list[int] | None:
    """The finer dims that both shapes split into, each named by the element count from
    its start to the end (its inner product), or None where the shapes' dims cross."""
    cuts = nested_cuts({1, *_inner_products(a), *_inner_products(b)})
    return None if cuts is None else cuts[1:]


def _owners(shape: Sequence[int], atoms: list[int]) -> dict[int, int]:
    """Which dim of ``shape`` each finer dim lies in."""
    products = _inner_products(shape)
    owners = {}
    for atom in atoms:
        for d, outer in enumerate(products):
            inner = products[d + 1] if d + 1 < len(products) else 1
            if inner < atom <= outer:
                owners[atom] = d
    return owners


def _reshaped(
    graph: torch.fx.Graph, reshape: torch.fx.Node, operand: torch.fx.Node
) -> torch.fx.Node:
    """``reshape`` applied to ``operand`` instead (placed before ``reshape``); where
    ``operand`` is itself a reshape of a value of the result's shape, that value."""
    target = example_value(reshape)
    below = _source(operand)
    if below is not None:
        value = _tensor(below)
        if value is not None and _same_shape(value, target) and _order_kept(value, target):
            return below
    args = (operand, *reshape.args[1:]) if reshape.args else reshape.args
    kwargs = dict(reshape.kwargs)
    if not reshape.args:
        kwargs["input" if "input" in kwargs else "self"] = operand
    with graph.inserting_before(reshape):
        node = graph.create_node(reshape.op, reshape.target, args, kwargs)
    node.meta["example_value"] = evaluate(node)
    return node


def _move_up(graph: torch.fx.Graph, reshape: torch.fx.Node, erased: set[torch.fx.Node]) -> bool:
    """Run the elementwise op that ``reshape`` reads in the reshaped shape (the module
    docstring), adding the nodes it erases to ``erased``; False where it cannot."""
    op = _source(reshape)
    before, after = _tensor(op), _tensor(reshape)
    if op is None or before is None or after is None or len(op.users) != 1:
        return False
    row = lookup_op(op.op, op.target)
    if row is None or row[0].kind != OpKind.ELEMENTWISE or is_mutation(op):
        return False
    if not _order_kept(before, after) or _same_shape(before, after):
        return False
    operands = [n for n in op.all_input_nodes if _tensor(n) is not None]
    full_shape = [n for n in operands if _same_shape(_tensor(n), before)]
    regrouped: dict[torch.fx.Node, tuple[int, ...]] = {}  # broadcast operands given a shape
    for operand in operands:
        value = _tensor(operand)
        if operand in full_shape:
            if not known_contiguous(value):
                return False
        elif not _broadcasts_alike(value, before, after):
            shape = _broadcast_after(value, before, after)
            if shape is None or layout_view(value, shape) is None:
                return False
            regrouped[operand] = shape
    full = {n: _reshaped(graph, reshape, n) for n in full_shape}
    with graph.inserting_before(reshape):
        for operand, shape in regrouped.items():
            full[operand] = graph.call_function(torch.reshape, (operand, shape))
            full[operand].meta["example_value"] = evaluate(full[operand])
    args = torch.fx.node.map_arg(op.args, lambda n: full.get(n, n))
    kwargs = torch.fx.node.map_arg(op.kwargs, lambda n: full.get(n, n))
    with graph.inserting_before(reshape):
        moved = graph.create_node(op.op, op.target, args, kwargs)
    moved.meta["example_value"] = evaluate(moved)
    assert _same_shape(example_value(moved), after), (moved, after.shape)
    reshape.replace_all_uses_with(moved)
    graph.erase_node(reshape)
    graph.erase_node(op)
    erased.update((reshape, op))
    for operand in operands:  # a reshape of an operand that now nothing reads
        if _source(operand) is not None and not operand.users:
            graph.erase_node(operand)
            erased.add(operand)
    return True


_SOFTMAXES = {torch.softmax, torch.log_softmax, torch.nn.functional.softmax,
              torch.nn.functional.log_softmax}  # fmt: skip


def _last_dim_softmax(node: torch.fx.Node) -> bool:
    """Is ``node`` a softmax (or log_softmax) along its input's last dim?"""
    is_call = node.op == "call_function" and node.target in _SOFTMAXES
    if not (is_call or node.op == "call_method" and node.target in ("softmax", "log_softmax")):
        return False
    value = _tensor(node.args[0]) if node.args else None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return value is not None and isinstance(dim, int) and dim in (-1, value.dim() - 1)


def _move_down(graph: torch.fx.Graph, softmax: torch.fx.Node) -> bool:
    """``softmax(reshape(y))`` as ``reshape(softmax(y))`` where the reshape keeps the last
    dim (a softmax along it works row by row, whatever the rows' shape): the softmax then
    joins the group computing ``y``. Swin's shifted windows add their mask to the scores
    viewed ``(B, nW, heads, N, N)`` and take the softmax ``(B * nW, heads, N, N)``."""
    reshape = softmax.args[0]
    source = _source(reshape) if isinstance(reshape, torch.fx.Node) else None
    before, after = _tensor(source), _tensor(reshape)
    if source is None or before is None or after is None or len(reshape.users) != 1:
        return False
    if not (_order_kept(before, after) and before.dim() and after.dim()):
        return False
    if not known_equal(before.shape[-1], after.shape[-1]) or _same_shape(before, after):
        return False
    if "dim" in softmax.kwargs:
        args, kwargs = (source, *softmax.args[1:]), {**softmax.kwargs, "dim": -1}
    else:
        args, kwargs = (source, -1, *softmax.args[2:]), dict(softmax.kwargs)
    with graph.inserting_before(softmax):
        moved = graph.create_node(softmax.op, softmax.target, args, kwargs)
        moved.meta["example_value"] = evaluate(moved)
        back = graph.create_node(reshape.op, reshape.target, (moved, *reshape.args[1:]),
                                 dict(reshape.kwargs))  # fmt: skip
        back.meta["example_value"] = evaluate(back)
    softmax.replace_all_uses_with(back)
    graph.erase_node(softmax)
    graph.erase_node(reshape)
    return True


def move_reshapes_up(graph: torch.fx.Graph) -> list[str]:
    """Move each reshape of an elementwise chain's result ahead of the chain (the module
    docstring); returns the ops moved, by name."""
    moved: list[str] = []
    erased: set[torch.fx.Node] = set()
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node in erased:
                continue
            if _last_dim_softmax(node) and _move_down(graph, node):
                erased.add(node)
                moved.append(node.name)
                changed = True
                continue
            source = _source(node)
            if source is not None and _move_up(graph, node, erased):
                moved.append(source.name)
                changed = True
    return moved


# --- casts moved ahead of permutes -------------------------------------------------------

_PERMUTES = {"permute", "transpose", "t", torch.permute, torch.transpose, torch.t}


def _dtype_cast(node: torch.fx.Node) -> bool:
    """A cast that only changes the dtype: ``x.to(dtype)``, ``x.float()``, ``x.half()``, ..."""
    call = lookup_op(node.op, node.target)
    if call is None or call[0].name != "cast" or node.kwargs:
        return False
    if node.target in ("to", torch.Tensor.to):
        return len(node.args) == 2 and isinstance(node.args[1], torch.dtype)
    return len(node.args) == 1


def _permuted(node: object) -> torch.fx.Node | None:
    """What ``node`` permutes (a permute, transpose or ``.t()`` of a node), else None."""
    if not isinstance(node, torch.fx.Node) or node.target not in _PERMUTES:
        return None
    if node.op not in ("call_method", "call_function") or node.kwargs:
        return None
    source = node.args[0] if node.args else None
    return source if isinstance(source, torch.fx.Node) else None


def move_casts_above_permutes(graph: torch.fx.Graph) -> list[str]:
    """Rewrite ``graph`` in place: ``permute(x).to(dtype)`` (a transpose, ``.float()``, ...)
    becomes ``x.to(dtype)`` permuted the same way, so the cast joins the group computing
    ``x`` (a group stops at a view of its own value). GPT-J casts its rotated q and k to fp32
    after moving the heads forward, two launches a layer. Returns the casts moved."""
    moved = []
    for cast in list(graph.nodes):
        if not _dtype_cast(cast) or is_mutation(cast):
            continue
        permute = cast.args[0]
        source = _permuted(permute)
        if source is None or not isinstance(example_value(source), torch.Tensor):
            continue
        with graph.inserting_before(cast):
            early = graph.create_node(cast.op, cast.target, (source, *cast.args[1:]))
            early.meta["example_value"] = evaluate(early)
            view = graph.create_node(permute.op, permute.target, (early, *permute.args[1:]))
            view.meta["example_value"] = evaluate(view)
        cast.replace_all_uses_with(view)
        graph.erase_node(cast)
        if not permute.users:
            graph.erase_node(permute)
        moved.append(cast.name)
    if moved:
        graph.lint()
    return moved
