"""A fusion group as the passes hand it on: ``Candidate`` (found by the partition) and
``LoweredGroup`` (its kernel program, from the lowering), and ``match``: a node against the
op table (a ``rotate_half`` matched as one ``rotate`` op, any other ``torch.cat`` as one
``concat`` op).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

from fusebackend.kernels.ir import RowProgram
from fusebackend.passes.concatenation import match_concat
from fusebackend.passes.fx_util import example_value
from fusebackend.passes.ops import OP_TABLE, OpCall, OpKind, bind_op, lookup_op
from fusebackend.passes.rotation import Rotation, match_rotation
from fusebackend.report import RejectionReport

__all__ = [
    "Candidate",
    "LoweredGroup",
    "is_alias",
    "is_graph_scalar",
    "is_negation",
    "match",
    "op_call",
    "operand_orders",
    "rotation_of",
]


@dataclasses.dataclass(frozen=True, eq=False)  # holds dicts: compared and hashed by identity
class LoweredGroup:
    """A group lowered to the kernel IR (``lowering.lower``): what its kernel computes and
    which graph values it reads and replaces."""

    program: RowProgram
    rank: int  # leading (row) dims of the group's shape
    inputs: tuple[torch.fx.Node, ...]  # graph values read, in the program's slot order
    outputs: tuple[torch.fx.Node, ...]  # members read outside the group, in graph order
    # member -> index of the kernel output holding its value; aliases (same-dtype casts)
    # share their source's output, as they share its tensor in eager
    output_slot: Mapping[torch.fx.Node, int]
    # non-lookup members -> their op matched at lowering, from the node's arguments then (an
    # earlier group's rewrite may have replaced an operand by that group's output)
    calls: Mapping[torch.fx.Node, OpCall]
    # An elementwise group over tensors stored in another dim order (channels-last images):
    # the order in which the kernel walks the dims (``x.permute(order)`` is contiguous), so
    # its rows run along the dim stored contiguously. None: the dims as they are.
    order: tuple[int, ...] | None = None


@dataclasses.dataclass
class Candidate:
    """A group found by the pass (``lowering.lower`` makes its ``LoweredGroup``)."""

    lookups: list[torch.fx.Node]
    members: list[torch.fx.Node]  # lookups and table ops, in graph order
    calls: dict[torch.fx.Node, OpCall]  # non-lookup members -> their matched op
    stops: list[RejectionReport]  # consumers where growth stopped
    # members lowered with another member, no instruction of their own: the slices, splits
    # and negations of a rotate_half (lowered with its concatenation)
    parts: set[torch.fx.Node] = dataclasses.field(default_factory=set)

    @property
    def ops(self) -> list[torch.fx.Node]:
        """Members that are table ops (not lookups)."""
        return [m for m in self.members if m in self.calls]

    @property
    def cost(self) -> int:
        """Eager kernels the group replaces: lookups and ops, less aliases (same-dtype casts,
        eval-mode dropout) and the views among a rotation's parts (its negations and an
        interleaving's stack are kernels)."""
        aliases = sum(1 for m, call in self.calls.items() if is_alias(call, m))
        views = sum(1 for m in self.parts if not is_negation(m) and m.target is not torch.stack)
        return len(self.members) - aliases - views


def match(node: torch.fx.Node) -> OpCall | str | None:
    """The node's op-table match, a reason it does not bind, or None (not a table op).

    A concatenation that spells ``rotate_half`` matches the ``rotate`` op of its source
    (``rotation_of`` names its parts); any other the ``concat`` op of its parts."""
    row = lookup_op(node.op, node.target)
    if row is None:
        rotation = match_rotation(node)
        if isinstance(rotation, Rotation):
            return OpCall(OP_TABLE["rotate"], (rotation.source,), rotation.params)
        return rotation if rotation is None else match_concat(node)
    call = bind_op(row[0], row[1], node.args, dict(node.kwargs))
    if isinstance(call, str) and row[0].kind == OpKind.NORM:
        return _bind_graph_eps(row[0], row[1], node, call)
    return call


def op_call(node: Any, *names: str) -> OpCall | None:
    """The node's op-table match when its op is one of ``names``, else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    call = match(node)
    return call if isinstance(call, OpCall) and call.op.name in names else None


def operand_orders(call: OpCall | None) -> list[tuple[Any, Any]]:
    """A two-operand call's operands in both orders (a product or sum read either way);
    none for another call or None."""
    if call is None or len(call.operands) != 2:
        return []
    a, b = call.operands
    return [(a, b), (b, a)]


def _bind_graph_eps(op: Any, signature: Any, node: torch.fx.Node, reason: str) -> OpCall | str:
    """A norm whose ``eps`` is a number computed in the graph, bound with ``eps`` kept as
    that node (the kernel reads it as a scalar argument at each call), or ``reason``.

    Under dynamic shapes (``dynamic=True``, or after Dynamo's recompiles) Dynamo passes a
    module's float attributes into the graph as inputs: ``nn.LayerNorm.eps`` arrives as a
    0-d tensor and ``.item()`` of it, so BERT's norms read ``eps`` from a graph node. The op
    table checks ``eps`` as a Python number; it is bound with a stand-in number instead and
    the node put back, so every other check still applies."""
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return reason
    eps = bound.arguments.get("eps")
    if not is_graph_scalar(eps):
        return reason
    bound.arguments["eps"] = 0.0
    call = bind_op(op, signature, bound.args, bound.kwargs)
    if isinstance(call, str):
        return call
    return OpCall(call.op, call.operands, {**call.params, "eps": eps})


def is_graph_scalar(value: Any) -> bool:
    """Is ``value`` an FX node that holds a Python number (a SymFloat or SymInt, or a plain
    number) when the graph runs?"""
    if not isinstance(value, torch.fx.Node):
        return False
    example = example_value(value)
    return isinstance(example, (float, int, torch.SymFloat, torch.SymInt)) and not isinstance(
        example, bool
    )


def rotation_of(node: torch.fx.Node) -> Rotation:
    rotation = match_rotation(node)
    assert isinstance(rotation, Rotation), rotation
    return rotation


def is_negation(node: torch.fx.Node) -> bool:
    call = match(node)
    return isinstance(call, OpCall) and call.op.name == "neg"


def is_alias(call: OpCall, node: torch.fx.Node) -> bool:
    """An op whose result eager returns as its input itself: a cast to the dtype (and
    device) it already has, or dropout outside training."""
    source = call.operands[0]
    if call.op.name not in ("cast", "dropout") or not isinstance(source, torch.fx.Node):
        return False
    before, after = example_value(source), example_value(node)
    return isinstance(before, torch.Tensor) and before.dtype == after.dtype
