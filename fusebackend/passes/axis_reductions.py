"""A reduction over a dim other than the last, read along the rows of a permuted view, so
that it joins the group of the elementwise ops after it (fused graph only).

A row group reduces along its last dim only: ``x.mean(1)`` of LeViT's ``[B, tokens, C]``
before its heads' BatchNorms (or a pooling ``sum(dim=1)`` then a division) ran as aten's
reduction, then a group for the ops after it. The same value is

    x.permute(..., d).mean(-1, keepdim=True)        [..., 1]: the kept dims, then 1

and every elementwise op that reads it (and ops reading those, in the reduced shape) computes
on ``[..., 1]`` values: their other tensor operands get a trailing dim of 1 (``unsqueeze``,
a view), and each value read outside that region is given back as ``squeeze(-1)`` (a view).
The row group then holds the reduction and those ops: one kernel where there were two. Sums
accumulate in fp32 and round once, as aten's do (the order of the additions differs).
Elementwise ops that compute the reduced tensor for the reduction alone are computed again
on permuted operands, in the same group (no write between them and the reduction), and a
second reduction read by a first one's region joins it, that region reading its ``[..., 1]``
values directly (``a.sum(1) / b.sum(1)``: one kernel). So sentence-transformers' mean
pooling as written (``sum(h * mask, 1) / clamp(mask.sum(1))``, the mask expanded) is one
kernel.

The kernel reads the permuted view through its strides: a row is one kept position's
reduced elements, which lie ``stride(d)`` apart, so a row's loads do not coalesce. Done
only where the reduced tensor is no larger than measured (``MAX_ELEMENTS``: there the one
kernel was faster than two at every shape) and the ops after the reduction fuse with it
(at least one elementwise op reads it, other than an eval dropout or a cast to its own
dtype), on static shapes of floating dtypes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from fusebackend.passes.fx_util import (
    bound_arguments,
    evaluate,
    example_value,
    method_evaluated,
    nodes_between,
    static_tensor,
)
from fusebackend.passes.graph import is_mutation
from fusebackend.passes.groups import is_alias, match
from fusebackend.passes.ops import OpKind, lookup_op

__all__ = ["MAX_ELEMENTS", "reduce_along_rows"]

_KINDS = ("sum", "mean", "amax", "amin")
# Elements of the reduced tensor at most: the largest shape measured faster as one group.
# A mean over dim 1 and a scale and shift took 1.2-4.3 us as one group against 3.2-6.9 for
# aten's mean then the group, from LeViT's 1 x 16 x 384 to 32 x 128 x 384 (fp16);
# sentence-transformers' mean pooling 3.7 and 6.7 us against 6.6 and 15.1 at 1 x 12 x 384
# and 32 x 57 x 384, but 23.1 against 15.5 at 32 x 128 x 768 (3.1M elements: the strided
# loads cost more than the launches saved). H200, 2026-11-30,
# benchmarks/diag/diag_axis_reductions.py.
MAX_ELEMENTS = 32 * 128 * 384


def reduce_along_rows(graph: torch.fx.Graph) -> list[str]:
    """Rewrite each reduction the module docstring describes; returns their names."""
    made = []
    for node in list(graph.nodes):
        found = _taken(node)
        if found is None:
            continue
        region = _region(node)
        joined = any(_widens(user, node) for user in node.users)  # an earlier region reads it
        if not joined and all(is_alias(match(n), n) for n in region):  # type: ignore[arg-type]
            continue  # nothing computed after it (none, or eval dropouts): no launch saved
        _rewrite(graph, node, *found, region)
        made.append(node.name)
    if made:
        graph.lint()
    return made


def _taken(node: torch.fx.Node) -> tuple[str, torch.fx.Node, int] | None:
    """(kind, input, the one dim reduced) where ``node`` is a reduction this pass takes,
    else None."""
    found = _reduction(node)
    if found is None:
        return None
    kind, x, params = found
    if params.get("dtype") is not None or params.get("keepdim") or params.get("out") is not None:
        return None
    if not isinstance(x, torch.fx.Node):
        return None
    value, out = example_value(x), example_value(node)
    if not (static_tensor(value) and static_tensor(out)) or not value.is_floating_point():
        return None
    if value.dim() < 2 or value.numel() > MAX_ELEMENTS or out.dtype != value.dtype:
        return None
    dim = params.get("dim")
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    dim %= value.dim()
    return (kind, x, dim) if dim != value.dim() - 1 else None


def _reduction(node: torch.fx.Node) -> tuple[str, Any, dict[str, Any]] | None:
    """(kind, input, the other arguments by name) of a sum, mean, amax or amin call, else
    None. (The op table's own match refuses these: a row group takes keepdim ones only.)"""
    row = lookup_op(node.op, node.target)
    if row is None or row[0].name not in _KINDS:
        return None
    op, signature = row
    params = bound_arguments(node, signature)
    if params is None:
        return None
    return op.name, params.pop("input"), params


def _region(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The elementwise ops that read ``node``'s value or each other's, in its shape (their
    other tensor operands broadcast to it), in graph order."""
    shape = example_value(node).shape
    inside = {node}
    found = []
    user = node.next
    while user.op != "output":  # (readers come after it)
        if any(a in inside for a in user.all_input_nodes) and _joins(user, shape):
            inside.add(user)
            found.append(user)
        user = user.next
    return found


def _joins(node: torch.fx.Node, shape: torch.Size) -> bool:
    call = match(node)
    if call is None or isinstance(call, str) or call.op.kind != OpKind.ELEMENTWISE:
        return False
    if is_mutation(node):
        return False
    value = example_value(node)
    if not static_tensor(value) or value.shape != shape:
        return False
    for operand in node.all_input_nodes:
        v = example_value(operand)
        if not isinstance(v, torch.Tensor) or not static_tensor(v):
            return False
        if v.dim() > len(shape) or torch.broadcast_shapes(v.shape, shape) != shape:
            return False
    return True


def _rewrite(
    graph: torch.fx.Graph, node: torch.fx.Node, kind: str, x: torch.fx.Node, dim: int,
    region: list[torch.fx.Node],
) -> None:  # fmt: skip
    rank = example_value(x).dim()
    order = [d for d in range(rank) if d != dim] + [dim]
    with graph.inserting_before(node):
        permuted, sunk = _permuted(graph, x, order, node)
        reduced = method_evaluated(graph, kind, (permuted, -1), {"keepdim": True})
    node.replace_all_uses_with(reduced)
    graph.erase_node(node)
    for old in reversed(sunk):  # computed again on permuted operands: nothing reads them now
        graph.erase_node(old)
    inside = {reduced, *region}
    widened: dict[torch.fx.Node, torch.fx.Node] = {}
    for member in region:  # graph order: each one's operands are final when it is evaluated
        for operand in member.all_input_nodes:
            if operand not in inside:
                if operand not in widened:
                    with graph.inserting_before(member):
                        widened[operand] = method_evaluated(graph, "unsqueeze", (operand, -1))
                member.replace_input_with(operand, widened[operand])
        member.meta["example_value"] = evaluate(member)
    for value in [reduced, *region]:
        outside = [u for u in value.users if u not in inside and u not in widened.values()]
        for user in [u for u in outside if _widens(u, value)]:
            # an earlier rewrite's view of this value for its own region (pooling: the
            # counts dividing the sum): read the [..., 1] value itself, in one group
            user.replace_all_uses_with(value)
            graph.erase_node(user)
            outside.remove(user)
        if not outside:
            continue
        with graph.inserting_after(value):
            squeezed = method_evaluated(graph, "squeeze", (value, -1))
        for user in outside:
            user.replace_input_with(value, squeezed)


def _permuted(
    graph: torch.fx.Graph, x: torch.fx.Node, order: list[int], at: torch.fx.Node
) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """(``x`` laid out in ``order``, made where the graph inserts now, the nodes it replaces).

    Elementwise ops that compute ``x`` for the reduction ``at`` alone (read by nothing else,
    nothing written between them and ``at``) are computed again on permuted operands, so
    they join the reduction's group: a pooling's ``h * mask`` before its sum. Anything else
    is a permuted view (operands of fewer dims reshaped to ``x``'s rank first). The replaced
    nodes, in graph order, are left for the caller to erase."""
    made: dict[torch.fx.Node, torch.fx.Node] = {}
    sunk: list[torch.fx.Node] = []

    def visit(value: Any, reader: torch.fx.Node) -> Any:
        if not isinstance(value, torch.fx.Node):
            return value
        if value not in made:
            made[value] = lay_out(value, reader)
        return made[value]

    def lay_out(value: torch.fx.Node, reader: torch.fx.Node) -> torch.fx.Node:
        v = example_value(value)
        if v.dim() < len(order):
            shape = (1,) * (len(order) - v.dim()) + tuple(v.shape)
            return method_evaluated(
                graph, "permute", (method_evaluated(graph, "reshape", (value, shape)), order)
            )
        if (
            set(value.users) == {reader}
            and _joins(value, v.shape)
            and not _writes_between(value, at)
        ):
            args = torch.fx.node.map_arg(value.args, lambda a: visit(a, value))
            kwargs = torch.fx.node.map_arg(value.kwargs, lambda a: visit(a, value))
            again = graph.create_node(value.op, value.target, args, kwargs)
            again.meta["example_value"] = evaluate(again)
            sunk.append(value)
            return again
        return method_evaluated(graph, "permute", (value, order))

    permuted = visit(x, at)
    order_of = {n: k for k, n in enumerate(graph.nodes)}
    return permuted, sorted(sunk, key=order_of.__getitem__)


def _writes_between(start: torch.fx.Node, end: torch.fx.Node) -> bool:
    """Does a node after ``start`` and before ``end`` write anything (the value computed
    again just before ``end`` could then read other data)?"""
    return any(is_mutation(n) for n in nodes_between(start, end))


def _widens(node: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Is ``node`` ``value.unsqueeze(-1)``?"""
    return node.op == "call_method" and node.target == "unsqueeze" and node.args == (value, -1)
