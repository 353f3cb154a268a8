"""Replace each group by one call of its fused op; the group's torch ops as a module.

The fused node returns a tuple (one tensor per kernel output) and a ``getitem`` per output
takes the place of the member whose value it holds. The graph is re-sorted stably, so every
node keeps its order relative to the mutations around it (see ``resort_stably``).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusebackend.passes.embedding_fusion import embedding_args
from fusebackend.passes.fx_util import call_evaluated, example_value
from fusebackend.passes.graph import resort_stably
from fusebackend.passes.groups import Candidate, LoweredGroup
from fusebackend.passes.lowering import in_order, lower
from fusebackend.passes.rotation import is_split, rotate

__all__ = ["reference_graph", "rewrite"]


def rewrite(
    graph: torch.fx.Graph, candidates: Sequence[Candidate], make_op: Any
) -> list[torch.fx.Node]:
    """Lower each group and replace it by ``make_op(candidate, lowered)`` (its
    ``LoweredGroup``) called on its inputs.

    Returns the new fused nodes. The graph is re-sorted so that every node keeps its place
    relative to the mutations around it (see ``resort_stably``).
    """
    priority: dict[torch.fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
    fused_nodes = []
    for candidate in candidates:
        lowered = lower(candidate)
        first = candidate.members[0]
        start = priority[first]
        holders = _output_holders(lowered)
        with graph.inserting_before(first):
            args = list(lowered.inputs)
            if lowered.order is not None:  # the kernel walks the tensors in storage order
                for slot, node in enumerate(args):
                    if slot not in lowered.program.scalar_inputs:
                        args[slot] = call_evaluated(graph, in_storage_order, (node, lowered.order))
                        priority[args[slot]] = start - 0.5
            fused = graph.call_function(make_op(candidate, lowered), tuple(args))
            fused.meta["example_value"] = tuple(_kernel_output(h, lowered.order) for h in holders)
            priority[fused] = start
            items = []
            if lowered.order is not None:  # the inverse of order: back to the shape's dims
                back = tuple(sorted(range(len(lowered.order)), key=lowered.order.__getitem__))
            for k in range(len(holders)):
                item = graph.call_function(operator.getitem, (fused, k))
                item.meta["example_value"] = fused.meta["example_value"][k]
                priority[item] = start + (k + 1) / (len(holders) + 2)
                if lowered.order is not None:  # back to the shape's dim order (a view)
                    item = call_evaluated(graph, torch.permute, (item, back))
                    priority[item] = start + (k + 1.5) / (len(holders) + 2)
                items.append(item)
            members = set(candidate.members)
            for out in lowered.outputs:
                item = items[lowered.output_slot[out]]
                out.replace_all_uses_with(item, delete_user_cb=lambda u, m=members: u not in m)
        for member in reversed(candidate.members):
            graph.erase_node(member)
        for split in {p.args[0] for p in candidate.parts if is_split(p.args[0])}:
            if not split.users:  # a rotation read both its parts
                graph.erase_node(split)
        fused_nodes.append(fused)
    resort_stably(graph, priority)
    graph.lint()
    return fused_nodes


def in_storage_order(x: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``x`` broadcast to ``len(order)`` dims (leading 1s) with its dims in ``order``: a
    view (an elementwise group's operand as its kernel walks it, ``LoweredGroup.order``)."""
    missing = len(order) - x.dim()
    if missing:  # (``x[()]`` is a view too: one more op for fake tensors to run, 2026-11-30)
        x = x[(None,) * missing]
    return x.permute(order)


def _kernel_output(holder: torch.fx.Node, order: tuple[int, ...] | None) -> Any:
    """The example value of the kernel's output holding ``holder``'s value: ``holder``'s
    own, or (a group walked in ``order``) a contiguous tensor of its dims in that order."""
    value = example_value(holder)
    if order is None:
        return value
    with getattr(value, "fake_mode", None) or contextlib.nullcontext():
        return value.new_empty(in_order(value.shape, order))


def _output_holders(lowered: LoweredGroup) -> list[torch.fx.Node]:
    """For each kernel output, the first member whose value it holds."""
    holders: dict[int, torch.fx.Node] = {}
    for member in lowered.outputs:
        holders.setdefault(lowered.output_slot[member], member)
    return [holders[k] for k in range(len(holders))]


def reference_graph(candidate: Candidate, lowered: LoweredGroup) -> torch.fx.Graph:
    """The group's original torch ops as a small graph (inputs -> outputs): what runs the
    group when Triton cannot run on its device. A graph, not a GraphModule: generating and
    compiling the module's code took 0.43 s for a 22-layer Llama's 113 groups (CPU,
    2026-11-25), where a GPU never runs it; ``FusedGroupOp.reference`` makes it on first use.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, node in enumerate(lowered.inputs):
        env[node] = graph.placeholder(f"in{i}_{node.name}")
    for member in candidate.members:
        call = lowered.calls.get(member)
        if call is None and member not in candidate.parts:  # a lookup; its other arguments
            # only matter for gradients, or are max_norm (rejected), and may be graph values
            # (norm_type under dynamic shapes)
            args = embedding_args(member)
            env[member] = graph.call_function(F.embedding, (env[args["input"]],
                                                            env[args["weight"]]))  # fmt: skip
        elif call is not None and call.op.name == "cast":  # the dtype may come from a tensor
            env[member] = graph.call_method("to", (env[call.operands[0]],
                                                   example_value(member).dtype))  # fmt: skip
        elif call is not None and call.op.name == "dropout":  # outside training: its input
            # (p may be a graph value under dynamic shapes, which the group does not read)
            env[member] = env[call.operands[0]]
        elif call is not None and call.op.name == "rotate":  # its parts are not copied
            source, params = env[call.operands[0]], call.params
            env[member] = graph.call_function(rotate, (source,), dict(params))
        elif call is not None:
            env[member] = graph.node_copy(member, lambda n: env[n])
    graph.output(tuple(env[h] for h in _output_holders(lowered)))
    return graph
