"""Graph inputs that arrive on the CPU and are moved to the GPU inside ``forward``.

Token ids usually come from the CPU and models move them to the embedding weight's device
(``ids.to(self.emb.weight.device)``). Left in the graph, that copy is a host-to-device
transfer inside the captured region. This pass takes it out: the placeholder now stands
for the moved tensor and the runtime copies the CPU tensor into the graph's static input
on the right device. Only inputs whose every use is such a move qualify.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fusebackend.passes.graph import example_value

__all__ = ["hoist_host_to_device"]


def _is_device_move(node: torch.fx.Node, source: torch.Tensor) -> bool:
    moved = node.op == "call_method" and node.target in ("to", "cuda")
    moved = moved or (node.op == "call_function" and node.target is torch.Tensor.to)
    result = example_value(node)
    return (
        moved
        and node.args[0] is not None
        and isinstance(result, torch.Tensor)
        and result.device.type == "cuda"
        and result.dtype == source.dtype
        and result.shape == source.shape
    )


def hoist_host_to_device(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
) -> dict[int, torch.device]:
    """Rewrite ``gm`` in place; return {input index: device the runtime must move it to}."""
    moved: dict[int, torch.device] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        value = example_inputs[index] if index < len(example_inputs) else None
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or not node.users:
            continue
        users = list(node.users)
        if not all(u.args and u.args[0] is node and _is_device_move(u, value) for u in users):
            continue
        devices = {example_value(u).device for u in users}
        if len(devices) != 1:
            continue
        for user in users:
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)
        node.meta["example_value"] = example_value(users[0])
        moved[index] = devices.pop()
    if moved:
        gm.recompile()
    return moved
