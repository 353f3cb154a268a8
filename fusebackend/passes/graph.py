"""FX graph facts for the fusion pass: mutation positions and a stable re-sort.

Mutations are invisible in FX's data flow (after ``x.add_(1)`` Dynamo's later uses of x
still point at the placeholder), so they are kept as positions (``is_mutation``): the fusion
pass never lets a group span one. What a node writes, and which inputs, is
``passes/mutations.py``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch
import torch.fx

# example_value is re-exported for backend.py only; the passes import it from fx_util
from fusebackend.passes.fx_util import example_value
from fusebackend.passes.mutations import written_args

__all__ = [
    "example_value",
    "is_mutation",
    "resort_stably",
]


def is_mutation(node: torch.fx.Node) -> bool:
    """Does this node write into one of its arguments (``mutations.written_args``)?"""
    return node.op == "call_module" or bool(written_args(node))  # opaque modules: maybe


def resort_stably(graph: torch.fx.Graph, priority: dict[torch.fx.Node, float]) -> None:
    """Topologically re-sort ``graph``, keeping each node as early as ``priority`` says.

    Nodes come out in priority order whenever data flow allows (Kahn's algorithm with a
    heap). With priorities equal to the original positions, and a fused node given its
    first member's position, every node before a group stays before it and every node after
    the group's last member stays after it, so mutations keep their order.
    """
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    waiting = {node: len(set(node.all_input_nodes)) for node in nodes}
    ready = [(priority.get(n, order[n]), order[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    result: list[torch.fx.Node] = []
    while ready:
        _, _, node = heapq.heappop(ready)
        result.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (priority.get(user, order[user]), order[user], user))
    if len(result) != len(nodes):
        raise RuntimeError("fusebackend: the rewritten graph has a cycle (internal error)")
    _reorder(graph, result)


def _reorder(graph: torch.fx.Graph, ordered: Iterable[torch.fx.Node]) -> None:
    anchor = graph._root  # FX's sentinel: appending after it builds the order front to back
    for node in ordered:
        anchor.append(node)
        anchor = node
