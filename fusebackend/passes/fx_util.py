"""Small FX helpers shared by the passes (a leaf module: imports nothing from the package)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.fx

__all__ = ["example_value", "nodes_between", "placeholders", "single_user", "static_tensor"]


def example_value(node: torch.fx.Node) -> object:
    """The fake tensor (or value) Dynamo recorded for ``node``, or None."""
    return node.meta.get("example_value", node.meta.get("val"))


def placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's inputs, in order."""
    return [n for n in graph.nodes if n.op == "placeholder"]


def static_tensor(value: object) -> bool:
    """Is ``value`` a tensor whose sizes are all plain ints (no symbolic dims)?"""
    return isinstance(value, torch.Tensor) and all(isinstance(n, int) for n in value.shape)


def nodes_between(start: torch.fx.Node, end: torch.fx.Node) -> Iterator[torch.fx.Node]:
    """The nodes after ``start`` and before ``end`` (``end`` must come after ``start``)."""
    node = start.next
    while node is not end:
        yield node
        node = node.next


def single_user(node: object) -> torch.fx.Node | None:
    """The one node that reads ``node``, or None (several readers, none, not a node)."""
    if not isinstance(node, torch.fx.Node):
        return None
    users = list(node.users)
    return users[0] if len(users) == 1 else None
