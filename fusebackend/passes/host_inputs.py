"""Graph inputs that arrive on the CPU and are moved to the GPU inside ``forward``.

Token ids usually come from the CPU and models move them to the embedding weight's device
(``ids.to(self.emb.weight.device)``). Left in the graph, that copy is a host-to-device
transfer inside the captured region. This pass takes it out: the placeholder now stands
for the moved tensor and the runtime copies the CPU tensor into the graph's static input
on the right device. Only inputs whose every use is such a move qualify.

Host work: a CUDA graph that also computes CPU values (position counters, scalar
bookkeeping) cannot be captured whole ("output 0 is a cpu tensor: it would keep its
capture-time value"). ``split_host`` cuts it into a host part, run eagerly at each call
(with its own CPU in-place effects), and a device part that can be captured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from fusebackend.passes.graph import example_value, is_mutation
from fusebackend.passes.mutations import storage_id

__all__ = ["HostSplit", "hoist_host_to_device", "host_nodes", "split_host", "stage_scalars"]


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


# ------------------------------------------------------------------- host work (issue 9.5)


def host_nodes(
    graph: torch.fx.Graph, is_host: Callable[[torch.Tensor], bool]
) -> list[torch.fx.Node]:
    """Nodes that can run on the host before the device part: in graph order.

    A node is host work when it yields a tensor that ``is_host`` (on the CPU, for a CUDA
    graph) and every input is a host value: a host placeholder or constant, or another host
    node. A node that reads a device value never is (a device->host copy is a sync and stays
    where it is), nor one that reads a storage a device-side node wrote before it. A pure
    function of the graph and its example values' devices, so it is tested with fake CUDA
    values on a machine without a GPU.
    """
    host_values: set[torch.fx.Node] = set()
    device_written: set[int] = set()
    found: list[torch.fx.Node] = []
    for node in graph.nodes:
        value = example_value(node)
        if node.op in ("placeholder", "get_attr"):
            if isinstance(value, torch.Tensor) and is_host(value):
                host_values.add(node)
            continue
        inputs = node.all_input_nodes
        host = (
            node.op in ("call_function", "call_method")
            and isinstance(value, torch.Tensor)
            and is_host(value)
            and all(n in host_values for n in inputs)
            and not any(storage_id(example_value(n)) in device_written for n in inputs)
        )
        if host:
            host_values.add(node)
            found.append(node)
        elif is_mutation(node):
            written = node.kwargs.get("out", node.args[0] if node.args else None)
            for arg in written if isinstance(written, (tuple, list)) else (written,):
                if isinstance(arg, torch.fx.Node):
                    device_written.add(storage_id(example_value(arg)))
    return found


@dataclasses.dataclass
class HostSplit:
    """A graph split into a host part (run eagerly each call) and a device part.

    ``host(*args)`` returns the values the device part needs, then the host values the graph
    returns. ``device`` takes ``[args[i] for i in device_args]`` followed by those values.
    ``outputs`` says where each original output comes from: ("host", k), ("device", k),
    ("arg", i) or ("value", constant).
    """

    host: torch.fx.GraphModule
    device: torch.fx.GraphModule
    device_args: tuple[int, ...]
    num_boundary: int
    outputs: tuple[tuple[str, Any], ...]
    out_tuple: bool
    nodes: list[str]

    def bind(self, device_fn: Callable[..., Sequence[Any]]) -> Callable[..., Any]:
        """The callable that replaces the graph: host part -> ``device_fn`` -> outputs."""
        host, device_args, cut = self.host, self.device_args, self.num_boundary
        sources, out_tuple = self.outputs, self.out_tuple

        def run(*args: Any) -> Any:
            host_out = host(*args)
            device_out = device_fn(*[args[i] for i in device_args], *host_out[:cut])
            result = []
            for kind, where in sources:
                if kind == "host":
                    result.append(host_out[cut + where])
                elif kind == "device":
                    result.append(device_out[where])
                elif kind == "arg":
                    result.append(args[where])
                else:
                    result.append(where)
            return tuple(result) if out_tuple else result

        return run


def split_host(
    gm: torch.fx.GraphModule, is_host: Callable[[torch.Tensor], bool]
) -> HostSplit | None:
    """Split ``gm`` into host and device parts, or None when there is no host work."""
    graph = gm.graph
    hosts = host_nodes(graph, is_host)
    host_set = set(hosts)
    calls = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    if not hosts or all(n in host_set for n in calls):
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    host_written = {
        _storage(n.args[0])
        for n in hosts
        if is_mutation(n) and n.args and isinstance(n.args[0], torch.fx.Node)
    }
    host_written.discard(None)

    host_graph = torch.fx.Graph()
    henv: dict[torch.fx.Node, torch.fx.Node] = {}
    for p in placeholders:
        henv[p] = host_graph.node_copy(p)
    device_graph = torch.fx.Graph()
    denv: dict[torch.fx.Node, torch.fx.Node] = {}
    device_args: list[int] = []
    boundary: list[torch.fx.Node] = []  # host graph values the device part reads
    boundary_meta: list[dict[str, Any]] = []
    passed: dict[torch.fx.Node, int] = {}  # host value -> its (unsnapshotted) boundary slot

    def device_use(value: torch.fx.Node) -> int:
        """Boundary slot for ``value`` read by a device node at this point of the graph."""
        if _storage(value) in host_written:
            # A later host write must not show: snapshot the value as it is now.
            boundary.append(host_graph.call_method("clone", (henv[value],)))
        elif value in passed:
            return passed[value]
        else:
            passed[value] = len(boundary)
            boundary.append(henv[value])
        boundary_meta.append(value.meta)
        return len(boundary) - 1

    slots: dict[tuple[torch.fx.Node, torch.fx.Node], int] = {}
    device_nodes: list[torch.fx.Node] = []
    for node in graph.nodes:
        if node.op == "placeholder" or node.op == "output":
            continue
        if node in host_set or node.op == "get_attr":  # constants: copied into both parts
            henv[node] = host_graph.node_copy(node, henv.__getitem__)
            if node in host_set:
                continue
        device_nodes.append(node)
        for value in node.all_input_nodes:
            snapshot = value.op == "placeholder" and _storage(value) in host_written
            if value in host_set or snapshot:
                slots[(node, value)] = device_use(value)

    (out_arg,) = graph.find_nodes(op="output")
    results = out_arg.args[0]
    out_tuple = not isinstance(results, list)
    results = results if isinstance(results, (tuple, list)) else (results,)
    host_returned = [r for r in results if isinstance(r, torch.fx.Node) and r in host_set]
    host_graph.output(tuple(boundary) + tuple(henv[r] for r in host_returned))

    used_args = {p for n in device_nodes for p in n.all_input_nodes if p.op == "placeholder"}
    used_args |= {r for r in results if isinstance(r, torch.fx.Node) and r.op == "placeholder"}
    for i, p in enumerate(placeholders):
        if p in used_args and not any((n, p) in slots for n in device_nodes):
            denv[p] = device_graph.node_copy(p)
            device_args.append(i)
    boundary_inputs = []
    for k, meta in enumerate(boundary_meta):
        ph = device_graph.placeholder(f"host_value_{k}")
        ph.meta.update(meta)
        boundary_inputs.append(ph)
    for node in device_nodes:
        local = dict(denv)
        for (user, value), slot in slots.items():
            if user is node:
                local[value] = boundary_inputs[slot]
        denv[node] = device_graph.node_copy(node, local.__getitem__)

    outputs: list[tuple[str, Any]] = []
    device_results: list[torch.fx.Node] = []
    for r in results:
        if not isinstance(r, torch.fx.Node):
            outputs.append(("value", r))
        elif r in host_set:
            outputs.append(("host", host_returned.index(r)))
        elif r.op == "placeholder":
            outputs.append(("arg", placeholders.index(r)))
        else:
            outputs.append(("device", len(device_results)))
            device_results.append(denv[r])
    device_graph.output(tuple(device_results))
    return HostSplit(
        host=torch.fx.GraphModule(gm, host_graph),
        device=torch.fx.GraphModule(gm, device_graph),
        device_args=tuple(device_args),
        num_boundary=len(boundary),
        outputs=tuple(outputs),
        out_tuple=out_tuple,
        nodes=[n.name for n in hosts],
    )


def _storage(node: torch.fx.Node) -> int | None:
    return storage_id(example_value(node))


def stage_scalars(gm: torch.fx.GraphModule, first: int, device: torch.device) -> None:
    """Make 0-d CPU inputs (from placeholder ``first`` on) read by device ops go through a
    move to ``device``, so ``hoist_host_to_device`` stages them in the input copy.

    The runtime would otherwise read such a scalar on the host at capture and key captures
    by its value: a position counter that the host part computes would re-capture at every
    step. A 0-d tensor promotes the same on either device, so moving it changes no result.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    changed = False
    for node in placeholders[first:]:
        value = example_value(node)
        if not (isinstance(value, FakeTensor) and value.dim() == 0 and value.device.type == "cpu"):
            continue
        users = list(node.users)
        on_device = all(getattr(example_value(u), "device", None) == device for u in users)
        if not users or not on_device or all(_is_device_move(u, value) for u in users):
            continue
        with gm.graph.inserting_before(placeholders[-1].next):
            move = gm.graph.call_method("to", (node, device))
        meta = torch.empty((), dtype=value.dtype, device="meta")
        move.meta["example_value"] = FakeTensor(value.fake_mode, meta, device)
        node.replace_all_uses_with(move, delete_user_cb=lambda u, m=move: u is not m)
        changed = True
    if changed:
        gm.recompile()
