"""Graph inputs that arrive on the CPU and are moved to the GPU inside ``forward``.

Token ids usually come from the CPU and models move them to the embedding weight's device
(``ids.to(self.emb.weight.device)``). Left in the graph, that copy is a host-to-device
transfer inside the captured region. This pass takes it out: the placeholder now stands
for the moved tensor and the runtime copies the CPU tensor into the graph's static input
on the right device. Only inputs whose every use is such a move qualify. A move whose
result the graph writes into (``d = ids.to("cuda"); d.add_(1)``) becomes a clone of the
staged input: eager writes a fresh copy there, never the caller's CPU tensor, so the input
is not a mutated one.

Host work: a CUDA graph that also computes CPU values (position counters, scalar
bookkeeping) cannot be captured whole ("output 0 is a cpu tensor: it would keep its
capture-time value"). ``split_host`` cuts it into a host part, run eagerly at each call
(with its own CPU in-place effects), and a device part that can be captured.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from fusebackend.passes.fx_util import example_value, placeholders
from fusebackend.passes.mutations import storage_id, written_args, written_storages

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
    inputs = placeholders(gm.graph)
    written = written_storages(gm.graph.nodes)  # clones below keep their storage ids
    for index, node in enumerate(inputs):
        value = example_inputs[index] if index < len(example_inputs) else None
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or not node.users:
            continue
        users = list(node.users)
        if not all(u.args and u.args[0] is node and _is_device_move(u, value) for u in users):
            continue
        devices = {example_value(u).device for u in users}
        if len(devices) != 1:
            continue
        copies_written = [_storage(u) in written for u in users]
        for user, copy_written in zip(users, copies_written, strict=True):
            if copy_written:
                # Eager writes a fresh copy of the CPU tensor: so does the graph.
                with gm.graph.inserting_before(user):
                    copy = gm.graph.call_method("clone", (node,))
                copy.meta.update(user.meta)
                user.replace_all_uses_with(copy)
            else:
                user.replace_all_uses_with(node)
            gm.graph.erase_node(user)
        on_device = example_value(users[0])
        # The input's value must not share a storage with a written copy (it would count
        # as a mutated input): a fresh fake tensor of the same shape when any is written.
        node.meta["example_value"] = _fresh(on_device) if any(copies_written) else on_device
        moved[index] = devices.pop()
    if moved:
        gm.recompile()
    return moved


# ------------------------------- host work: CPU values computed before the captured part


_NUMBERS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def host_nodes(
    graph: torch.fx.Graph,
    is_host: Callable[[torch.Tensor], bool],
    per_signature: frozenset[str] = frozenset(),
) -> list[torch.fx.Node]:
    """Nodes that can run on the host before the device part: in graph order.

    ``per_signature``: names of nodes left to the device part, where the runtime computes
    them once per signature (``signature_constants``: host chains of sizes and constants)
    instead of at every call; nodes reading them stay there too.

    A node is host work when every input is a host value (a host placeholder or constant,
    or another host node) and it yields a tensor that ``is_host`` (on the CPU, for a CUDA
    graph) or writes into its inputs (``counter[0] = ...`` returns None), or when it is
    arithmetic on number inputs whose result is only returned. A node
    that reads a device value never is (a device->host copy is a sync and stays where it
    is), nor one that reads a storage a device-side node wrote before it. A pure function of
    the graph and its example values' devices, so it is tested with fake CUDA values on a
    machine without a GPU.
    """
    host_values: set[torch.fx.Node] = set()
    numbers: set[torch.fx.Node] = set()  # number (SymInt, int, float) inputs
    device_written: set[int] = set()
    found: list[torch.fx.Node] = []
    for node in graph.nodes:
        value = example_value(node)
        if node.op in ("placeholder", "get_attr"):
            if isinstance(value, torch.Tensor) and is_host(value):
                host_values.add(node)
            elif node.op == "placeholder" and isinstance(value, _NUMBERS):
                numbers.add(node)
            continue
        inputs = node.all_input_nodes
        written = written_args(node)
        # A mutation counts by what it reads and writes, whatever it returns (setitem: None),
        # and may read number inputs (a dynamic length: ``counter.add_(s27)`` in a Llama
        # prefill). Other nodes on numbers stay where they are: with batch_buckets the
        # device part sees padded sizes, so a host tensor sized by one would not fit.
        host = (
            node.name not in per_signature
            and node.op in ("call_function", "call_method")
            and (bool(written) or (isinstance(value, torch.Tensor) and is_host(value)))
            and all(n in host_values or (written and n in numbers) for n in inputs)
            and not any(_storage(n) in device_written for n in inputs)
        )
        # Python-number arithmetic whose result is only returned (transformers' sliding-window
        # cache layers return ``cumulative_length_int + 1`` for the next step): on the host,
        # its number inputs leave the device part, which then keeps one signature for every
        # step instead of keying a new capture on each value.
        returned_number = (
            node.op == "call_function"
            and isinstance(value, _NUMBERS)
            and bool(inputs)
            and all(n in numbers for n in inputs)
            and bool(node.users)
            and all(user.op == "output" for user in node.users)
        )
        if returned_number:
            found.append(node)
        elif host:
            host_values.add(node)
            found.append(node)
        else:
            device_written.update(sid for sid in map(_storage, written) if sid is not None)
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
    gm: torch.fx.GraphModule,
    is_host: Callable[[torch.Tensor], bool],
    per_signature: frozenset[str] = frozenset(),
) -> HostSplit | None:
    """Split ``gm`` into host and device parts, or None when there is no host work
    (``per_signature``: as ``host_nodes`` takes it).

    No split either when a device node writes a host value (a CPU tensor written from device
    data is a sync; the graph then runs whole, uncaptured): the host part runs first, so
    that write would land after host work that eager runs later, or in a snapshot.

    One pass over the graph, each node copied once. The decode graph of a 22-layer Llama
    (1747 nodes) splits in 80 ms on a 2-core CPU, most of it FX's node copies and the code
    generation of the two GraphModules; 110 ms when each device node copied the whole
    environment and scanned every boundary slot (quadratic). 2 layers (187 nodes): 8.5 ms
    either way (benchmarks/diag/diag_split_time.py).
    """
    graph = gm.graph
    hosts = host_nodes(graph, is_host, per_signature)
    host_set = set(hosts)
    inner = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    device_nodes = [n for n in inner if n not in host_set]  # constants (get_attr) included
    if not hosts or all(n.op == "get_attr" for n in device_nodes):
        return None
    for node in device_nodes:
        for arg in written_args(node):
            value = example_value(arg)
            if isinstance(value, torch.Tensor) and is_host(value):
                return None
    inputs = placeholders(graph)
    host_written = written_storages(hosts)

    host_graph = torch.fx.Graph()
    henv: dict[torch.fx.Node, torch.fx.Node] = {p: host_graph.node_copy(p) for p in inputs}
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

    # Host part, in graph order; what each device node reads from it, as boundary slots.
    reads: dict[torch.fx.Node, dict[torch.fx.Node, int]] = {}
    direct: set[torch.fx.Node] = set()  # inputs the device part reads as they come
    for node in inner:
        if node in host_set or node.op == "get_attr":  # constants: copied into both parts
            henv[node] = host_graph.node_copy(node, henv.__getitem__)
            if node in host_set:
                continue
        for value in node.all_input_nodes:
            host_written_input = value.op == "placeholder" and _storage(value) in host_written
            if value in host_set or host_written_input:
                reads.setdefault(node, {})[value] = device_use(value)
            elif value.op == "placeholder":
                direct.add(value)

    (out_arg,) = graph.find_nodes(op="output")
    results = out_arg.args[0]
    out_tuple = not isinstance(results, list)
    results = results if isinstance(results, (tuple, list)) else (results,)
    host_returned = [r for r in results if isinstance(r, torch.fx.Node) and r in host_set]
    host_graph.output(tuple(boundary) + tuple(henv[r] for r in host_returned))

    # Device part: the original inputs it reads, then one placeholder per boundary slot.
    device_graph = torch.fx.Graph()
    denv: dict[torch.fx.Node, torch.fx.Node] = {}
    device_args = [i for i, p in enumerate(inputs) if p in direct]
    for i in device_args:
        denv[inputs[i]] = device_graph.node_copy(inputs[i])
    boundary_inputs = []
    for k, meta in enumerate(boundary_meta):
        ph = device_graph.placeholder(f"host_value_{k}")
        ph.meta.update(meta)
        boundary_inputs.append(ph)
    for node in device_nodes:
        slots = reads.get(node)
        if slots is None:
            denv[node] = device_graph.node_copy(node, denv.__getitem__)
        else:
            denv[node] = device_graph.node_copy(
                node, lambda v, s=slots: boundary_inputs[s[v]] if v in s else denv[v]
            )

    outputs: list[tuple[str, Any]] = []
    device_results: list[torch.fx.Node] = []
    for r in results:
        if not isinstance(r, torch.fx.Node):
            outputs.append(("value", r))
        elif r in host_set:
            outputs.append(("host", host_returned.index(r)))
        elif r.op == "placeholder":
            outputs.append(("arg", inputs.index(r)))
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


def _fresh(value: object) -> object:
    """A tensor like ``value`` (a fake one under its fake mode) with its own storage."""
    if not isinstance(value, torch.Tensor):
        return value
    fake_mode = value.fake_mode if isinstance(value, FakeTensor) else contextlib.nullcontext()
    with fake_mode:
        return torch.empty_like(value)


def stage_scalars(gm: torch.fx.GraphModule, first: int, device: torch.device) -> None:
    """Make 0-d CPU inputs (from placeholder ``first`` on) read by device ops go through a
    move to ``device``, so ``hoist_host_to_device`` stages them in the input copy.

    The runtime would otherwise read such a scalar on the host at capture and key captures
    by its value: a position counter that the host part computes would re-capture at every
    step. A 0-d tensor promotes the same on either device, so moving it changes no result.
    """
    inputs = placeholders(gm.graph)
    changed = False
    for node in inputs[first:]:
        value = example_value(node)
        if not (isinstance(value, FakeTensor) and value.dim() == 0 and value.device.type == "cpu"):
            continue
        users = list(node.users)
        on_device = all(getattr(example_value(u), "device", None) == device for u in users)
        if not users or not on_device or all(_is_device_move(u, value) for u in users):
            continue
        with gm.graph.inserting_before(inputs[-1].next):
            move = gm.graph.call_method("to", (node, device))
        meta = torch.empty((), dtype=value.dtype, device="meta")
        move.meta["example_value"] = FakeTensor(value.fake_mode, meta, device)
        node.replace_all_uses_with(move, delete_user_cb=lambda u, m=move: u is not m)
        changed = True
    if changed:
        gm.recompile()
