"""Values computed twice from the same operands, computed once (fused graph).

Model code often computes one value in several places: GPT-J's attention repeats the sine
and cosine tables for the query and again for the key (``repeat_interleave`` four times a
layer, where two results would do), a block slices the same operand twice. Each copy is a
kernel of its own. ``share_equal_values`` keeps the first and has the readers of every later
copy read it (common subexpression elimination): two nodes are the same value when they
call the same function (or method) on the same operands (after earlier copies were merged)
with equal arguments otherwise.

Never merged, so a merge cannot change what a reader sees:
- ops that write (``passes/mutations.py``) or draw random numbers (``constants.is_random``),
  higher-order ops (their body may do either), and collectives and their waits (each rank
  must issue every collective it traced: tensor parallelism);
- values whose storage the graph writes anywhere, or returns (two outputs of eager are two
  tensors; a caller writing one must not see the other change);
- a later copy whose operands were written in place between the two (its operands hold
  other values by then);
- anything that is not a tensor or a tuple of tensors, and arguments that cannot be compared
  exactly (symbolic sizes, objects without a value's equality).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx

from fusebackend.passes.collectives import op_namespace
from fusebackend.passes.constants import is_random
from fusebackend.passes.fx_util import example_value
from fusebackend.passes.graph import is_mutation
from fusebackend.passes.mutations import known_written_storages, storage_id, written_args

__all__ = ["share_equal_values"]

log = logging.getLogger(__name__)

# Arguments compared by value: the literal types a traced call passes besides nodes.
_LITERALS = (bool, int, float, str, type(None), type(Ellipsis), torch.dtype, torch.device,
             torch.layout, torch.memory_format)  # fmt: skip


def share_equal_values(graph: torch.fx.Graph) -> list[str]:
    """Merge each later copy of a value into its first (module docstring); returns the names
    of the nodes removed."""
    written = known_written_storages(graph.nodes)
    if written is None:  # a write whose storage is unknown could reach any value
        return []
    output = next(n for n in graph.nodes if n.op == "output")
    excluded = written | {storage_id(example_value(a)) for a in output.all_input_nodes}
    position = {node: k for k, node in enumerate(graph.nodes)}
    writes = [(position[n], _storages(written_args(n))) for n in graph.nodes if is_mutation(n)]
    first_of: dict[Any, torch.fx.Node] = {}
    merged = []
    for node in list(graph.nodes):
        key = _key(node, excluded)
        if key is None:
            continue
        first = first_of.get(key)
        if first is None or _written_between(writes, position[first], position[node], node):
            first_of[key] = node
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        merged.append(node.name)
    if merged:
        log.debug("values computed once: %s", merged)
        graph.lint()
    return merged


def _key(node: torch.fx.Node, excluded: set[Any]) -> Any:
    """What makes ``node``'s value: its op, target and frozen arguments; None where the node
    must not be merged (module docstring)."""
    if node.op not in ("call_function", "call_method"):
        return None
    if isinstance(node.target, torch._ops.HigherOrderOperator) or _communicates(node):
        return None
    if is_mutation(node) or is_random(node):
        return None
    values = example_value(node)
    tensors = values if isinstance(values, (tuple, list)) else (values,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    if any(storage_id(t) is None or storage_id(t) in excluded for t in tensors):
        return None
    try:
        return (node.op, node.target, _freeze(node.args), _freeze(node.kwargs))
    except _Unhashable:
        return None


# Namespaces of the ops that communicate between ranks (functional collectives, their waits).
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"}


def _communicates(node: torch.fx.Node) -> bool:
    """A collective, its wait or a DTensor ``redistribute`` (which runs one)."""
    if node.op == "call_method":
        return node.target == "redistribute"
    return op_namespace(node.target) in _COLLECTIVE_NAMESPACES


class _Unhashable(Exception):
    """An argument that cannot be compared exactly."""


def _freeze(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _freeze(value.start), _freeze(value.stop), _freeze(value.step))
    if type(value) in _LITERALS:
        # the type too: 1, 1.0 and True are equal in Python and not to torch
        return (type(value).__name__, value)
    raise _Unhashable


def _storages(nodes: list[torch.fx.Node]) -> set[Any]:
    return {storage_id(example_value(n)) for n in nodes}


def _written_between(
    writes: list[tuple[int, set[Any]]], start: int, end: int, node: torch.fx.Node
) -> bool:
    """Does a write between positions ``start`` and ``end`` reach an operand of ``node``?"""
    operands = _storages(node.all_input_nodes) - {None}
    return any(start < at < end and operands & storages for at, storages in writes)
