"""Independent small ops on many state tensors, batched into one foreach op each.

transformers' StaticCache keeps a position counter per layer, and each layer's attention
advances its own (``cumulative_length.add_(1)``): 22 one-element kernels in a 22-layer
Llama's decode step, each a launch of its own inside the captured graph (the step launched
517 kernels on an H100 against Inductor's 423, 2026-11-23). ``torch._foreach_add_`` over all
of them is one multi-tensor kernel.

An update ``x.add_(n)`` (``n`` a Python number, its result unused) may move down to the last
update of its batch when nothing after it reads or writes ``x``'s storage, through ``x`` or
any alias of it, except the graph's output (which comes after the batched update anyway).
Updates are batched by number, dtype and device; a batch needs at least two.

Only state marked with ``torch._dynamo.mark_static_address`` is batched (StaticCache marks
its counters so): the aliasing this pass sees is Dynamo's, from the traced call, and a later
call could pass two views of one buffer as separate inputs without a recompile, where a
moved update would be read late. A cache's own state is not handed in as a view of another
input.

The same layers also read their counter first: ``cache_position = arange + counter`` (a
folded constant plus the counter), another one-element kernel per layer. Such sums of
constants and marked state, of one dtype, device and shape, become one ``torch._foreach_add``
at the first of them (``batch_state_sums``), when nothing between it and each sum writes
their operands. Each operand is viewed at the sum's shape (a 0-d counter as ``[1]``), since
the multi-tensor kernel takes lists of equal shapes.
"""

from __future__ import annotations

import logging
import math
import operator
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.fx

from fusebackend.passes.fx_util import example_value, static_tensor
from fusebackend.passes.mutations import storage_id, written_args

__all__ = ["batch_scalar_updates", "batch_state_sums"]

log = logging.getLogger(__name__)


def batch_scalar_updates(
    gm: torch.fx.GraphModule, static_address: Sequence[torch.fx.Node]
) -> list[str]:
    """Rewrite ``gm`` in place; return the names of the updates folded into foreach ops.

    ``static_address``: the placeholders whose tensors were marked static-address; only
    their storage is updated in a batch.
    """
    nodes = list(gm.graph.nodes)
    storages = {n: storage_id(example_value(n)) for n in nodes}
    allowed = {storages[p] for p in static_address} - {None}
    batches: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for position, node in enumerate(nodes):
        key = _batch_key(node)
        if key is None or storages[node.args[0]] not in allowed:
            continue
        if not _touched_later(node, nodes[position + 1 :], storages):
            batches[key].append(node)
    batched: list[str] = []
    for (number, *_), updates in batches.items():
        if len(updates) < 2:
            continue
        with gm.graph.inserting_after(updates[-1]):
            foreach = gm.graph.call_function(
                torch._foreach_add_, ([u.args[0] for u in updates], number)
            )
        foreach.meta["example_value"] = None
        for update in updates:
            batched.append(update.name)
            gm.graph.erase_node(update)
    if batched:
        gm.recompile()
        log.info("batched %d in-place scalar update(s) into foreach ops", len(batched))
    return batched


def batch_state_sums(
    gm: torch.fx.GraphModule,
    static_address: Sequence[torch.fx.Node],
    device: torch.device | None,
) -> list[str]:
    """Rewrite ``gm`` in place; return the names of the sums folded into foreach ops.

    Only sums on the graph's ``device``: CPU sums beside CUDA work are host work, which the
    host/device split keeps out of the captured part (a list-valued foreach would not be).
    """
    nodes = list(gm.graph.nodes)
    storages = {n: storage_id(example_value(n)) for n in nodes}
    state = set(static_address)
    batches: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in nodes:
        key = _sum_key(node, state)
        if key is not None and key[1] == device:
            batches[key].append(node)
    batched: list[str] = []
    for sums in batches.values():
        sums = _unwritten_since_first(sums, nodes, storages)
        if len(sums) < 2:
            continue
        shape = list(example_value(sums[0]).shape)
        graph = gm.graph
        position = {n: i for i, n in enumerate(graph.nodes)}
        for s in sums[1:]:  # a constant defined later moves up (a get_attr has no inputs)
            for arg in s.args:
                if arg.op == "get_attr" and position[arg] > position[sums[0]]:
                    sums[0].prepend(arg)
        with graph.inserting_before(sums[0]):
            lists = [[graph.call_method("reshape", (s.args[k], shape)) for s in sums]
                     for k in (0, 1)]  # fmt: skip
            for operand_list, k in zip(lists, (0, 1), strict=True):
                for view, s in zip(operand_list, sums, strict=True):
                    view.meta["example_value"] = example_value(s.args[k]).reshape(shape)
            foreach = graph.call_function(torch._foreach_add, tuple(lists))
            foreach.meta["example_value"] = [example_value(s) for s in sums]
            items = []
            for i, s in enumerate(sums):
                item = graph.call_function(operator.getitem, (foreach, i))
                item.meta.update(s.meta)
                items.append(item)
        for s, item in zip(sums, items, strict=True):
            s.replace_all_uses_with(item)
            batched.append(s.name)
            graph.erase_node(s)
    if batched:
        gm.recompile()
        log.info("batched %d sum(s) of state into foreach ops", len(batched))
    return batched


def _sum_key(node: torch.fx.Node, state: set[torch.fx.Node]) -> tuple | None:
    """(dtype, device, shape) of ``a + b`` where a and b are constants or marked state of
    that dtype, each with the sum's number of elements; else None."""
    if node.op != "call_function" or node.target not in (operator.add, torch.add):
        return None
    if node.kwargs or len(node.args) != 2:
        return None
    out = example_value(node)
    if not static_tensor(out):
        return None
    for arg in node.args:
        value = example_value(arg) if isinstance(arg, torch.fx.Node) else None
        if not (isinstance(arg, torch.fx.Node) and (arg.op == "get_attr" or arg in state)):
            return None
        if not static_tensor(value):
            return None
        if (value.dtype, value.device, value.numel()) != (out.dtype, out.device, out.numel()):
            return None
    return (out.dtype, out.device, tuple(out.shape))


def _unwritten_since_first(
    sums: list[torch.fx.Node], nodes: list[torch.fx.Node], storages: dict
) -> list[torch.fx.Node]:
    """The sums that can run at the first one's place: nothing from there to them writes
    their operands' storage (a sum behind such a write keeps its place)."""
    if len(sums) < 2:
        return sums
    start = nodes.index(sums[0])
    written: set = set()
    kept, members = [], set(sums)
    for node in nodes[start:]:
        if node in members:
            reads = {storages.get(a) for a in node.args}
            if None not in reads and not reads & written:
                kept.append(node)
        written.update(storages.get(target) for target in written_args(node))
    return kept


def _batch_key(node: torch.fx.Node) -> tuple | None:
    """(number, its type and sign, dtype, device) of ``x.add_(number)`` whose result is
    unused, else None. Type and sign keep 1 and 1.0, 0.0 and -0.0 apart (equal as keys, but
    ``x.add_(-0.0)`` leaves a -0.0 that ``x.add_(0)`` turns into 0.0)."""
    method = node.op == "call_method" and node.target == "add_"
    function = node.op == "call_function" and node.target is torch.Tensor.add_
    if not (method or function) or node.kwargs or len(node.args) != 2 or node.users:
        return None
    target, number = node.args
    value = example_value(target) if isinstance(target, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or type(number) not in (int, float):
        return None
    return (number, type(number), math.copysign(1.0, number), value.dtype, value.device)


def _touched_later(
    update: torch.fx.Node, later: list[torch.fx.Node], storages: dict[torch.fx.Node, int | None]
) -> bool:
    """Does a node after ``update`` (the output aside) take an alias of what it writes?"""
    written = storages[update.args[0]]
    if written is None:
        return True  # unknown storage: leave it where it is
    for node in later:
        if node.op == "output":
            continue
        if any(storages.get(arg) == written for arg in node.all_input_nodes):
            return True
    return False
