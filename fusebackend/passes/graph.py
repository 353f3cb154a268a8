"""FX <-> networkx: the data-flow DiGraph, mutation facts and a stable re-sort.

Mutations are invisible in FX's data flow (after ``x.add_(1)`` Dynamo's later uses of x
still point at the placeholder), so they are found by name (``is_mutation``) and kept as
positions: the fusion pass never lets a group span one. Which inputs they write is
``passes/mutations.py``.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable

import networkx as nx
import torch
import torch.fx

__all__ = [
    "build_digraph",
    "example_value",
    "is_mutation",
    "resort_stably",
]

_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
}  # fmt: skip


def example_value(node: torch.fx.Node) -> object:
    """The fake tensor (or value) Dynamo recorded for ``node``, or None."""
    return node.meta.get("example_value", node.meta.get("val"))


def build_digraph(graph: torch.fx.Graph) -> nx.DiGraph:
    """One networkx node per FX node (keyed by the Node), one edge per data use."""
    digraph = nx.DiGraph()
    for position, node in enumerate(graph.nodes):
        digraph.add_node(node, position=position)
        for producer in node.all_input_nodes:
            digraph.add_edge(producer, node)
    return digraph


def is_mutation(node: torch.fx.Node) -> bool:
    """Does this node write into one of its arguments?"""
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.endswith("__") or name == "copy_"
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        if node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
            return True
        if getattr(node.target, "__module__", None) in ("_operator", "operator"):
            return False  # operator.and_/or_/not_ are pure; the in-place ones are above
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__")
    return node.op == "call_module"  # an opaque module may mutate anything


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
