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
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
import torch.fx

from fusebackend.passes.fx_util import example_value
from fusebackend.passes.mutations import storage_id

__all__ = ["batch_scalar_updates"]

log = logging.getLogger(__name__)


def batch_scalar_updates(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` in place; return the names of the updates folded into foreach ops."""
    nodes = list(gm.graph.nodes)
    storages = {n: storage_id(example_value(n)) for n in nodes}
    batches: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for position, node in enumerate(nodes):
        key = _batch_key(node)
        if key is not None and not _touched_later(node, nodes[position + 1 :], storages):
            batches[key].append(node)
    batched: list[str] = []
    for (number, _, _), updates in batches.items():
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
    """(number, dtype, device) of ``x.add_(number)`` whose result is unused, else None."""
    method = node.op == "call_method" and node.target == "add_"
    function = node.op == "call_function" and node.target is torch.Tensor.add_
    if not (method or function) or node.kwargs or len(node.args) != 2 or node.users:
        return None
    target, number = node.args
    value = example_value(target) if isinstance(target, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or type(number) not in (int, float):
        return None
    return (number, value.dtype, value.device)


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
