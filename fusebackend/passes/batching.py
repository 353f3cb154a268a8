"""Independent in-place updates of many small tensors, batched into one foreach op.

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
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.fx

from fusebackend.passes.fx_util import example_value
from fusebackend.passes.mutations import storage_id

__all__ = ["batch_scalar_updates"]

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
