"""Two fused groups of one kernel, next to each other in the graph, launched as one.

A Llama layer applies the same rotary embedding to q and to k: two groups with one
program (32 and 4 heads of one width), so two launches of one kernel, 44 of a 22-layer
decode step's launches. Inductor fuses such independent neighbours into one kernel; a
decode step is launch-bound, so each launch saved is time saved (about 2 us each in a
captured graph). Here the second group's launch also runs the first's rows
(``kernels.launch.row_kernel_pair``).

Groups ``a`` (earlier) and ``b`` pair when their fused ops run the same program with the same
options, their outputs have the same rank, last width and device, and ``a`` can wait until
``b``: every use of ``a``'s outputs comes after ``b`` (not ``b`` itself), and no node between
them writes anything.
Each group pairs at most once, with the nearest earlier group that qualifies.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from fusebackend.passes.fx_util import example_value, nodes_between
from fusebackend.passes.mutations import written_args

__all__ = ["pair_twin_groups"]


def pair_twin_groups(
    graph: torch.fx.Graph,
    fused_nodes: Sequence[torch.fx.Node],
    make_pair: Callable[[Any, Any, int], Any],
) -> list[tuple[Any, Any]]:
    """Replace pairs of fused nodes by one node calling ``make_pair(op_a, op_b, inputs of
    a)`` on a's inputs then b's; return the pairs of fused ops."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    ordered = sorted(fused_nodes, key=position.__getitem__)
    open_nodes: list[torch.fx.Node] = []
    pairs = []
    for b in ordered:
        a = next((a for a in reversed(open_nodes) if _can_pair(a, b, position)), None)
        if a is None:
            open_nodes.append(b)
            continue
        open_nodes.remove(a)
        pairs.append((a, b))
    for a, b in pairs:
        _replace(graph, a, b, make_pair(a.target, b.target, len(a.args)))
    if pairs:
        graph.lint()
    return [(a.target, b.target) for a, b in pairs]


def _same_kernel(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    op_a, op_b = a.target, b.target
    if not (hasattr(op_a, "program") and hasattr(op_b, "program")):
        return False
    if (op_a.program, op_a.options) != (op_b.program, op_b.options):
        return False
    outs_a, outs_b = example_value(a), example_value(b)
    if not (isinstance(outs_a, tuple) and isinstance(outs_b, tuple) and outs_a and outs_b):
        return False
    shape_a, shape_b = outs_a[0].shape, outs_b[0].shape
    same_device = outs_a[0].device == outs_b[0].device  # one launch runs on one device
    return same_device and len(shape_a) == len(shape_b) and shape_a[-1] == shape_b[-1]


def _can_pair(a: torch.fx.Node, b: torch.fx.Node, position: dict[torch.fx.Node, int]) -> bool:
    end = position[b]
    if not (_same_kernel(a, b) and position[a] < end):
        return False
    for item in a.users:  # the getitems of a's outputs
        if item.target is not operator.getitem:
            return False
        # b itself (at end) reading a's output is a use before b ran: no pair.
        if any(position[user] <= end for user in item.users):
            return False
    return not any(node not in a.users and written_args(node) for node in nodes_between(a, b))


def _replace(graph: torch.fx.Graph, a: torch.fx.Node, b: torch.fx.Node, pair_op: Any) -> None:
    """One node for both, where ``b`` was; ``a``'s getitems move after it."""
    outputs_a = len(example_value(a))
    with graph.inserting_before(b):
        pair = graph.call_function(pair_op, (*a.args, *b.args))
        pair.meta["example_value"] = (*example_value(a), *example_value(b))
    after = pair
    for offset, fused in ((0, a), (outputs_a, b)):
        for item in list(fused.users):
            with graph.inserting_after(after):
                moved = graph.call_function(operator.getitem, (pair, offset + item.args[1]))
            moved.meta.update(item.meta)
            item.replace_all_uses_with(moved)
            graph.erase_node(item)
            after = moved
    graph.erase_node(a)
    graph.erase_node(b)
