"""Host-built tensors that depend only on sizes: per-signature constants.

transformers 5.17's MPNet builds its relative position buckets on the host every call:
``torch.arange(seq_len)`` with no device, neg, lt, abs, log, ``full_like``, min, where, an
in-place ``ret += ...``, then ``.to(device)`` of the (L, L) result. With static shapes
``fold_constants`` folds most of it; once Dynamo makes the length symbolic nothing folds, the
host part refuses a chain that reads a SymInt (with buckets the device part sees padded
sizes), and the copy stays inside the captured region: the capture fails ("Cannot copy
between CPU and CUDA tensors during CUDA graph capture") and the graph runs eagerly (119 of
123 MPNet signatures). DeBERTa's ``torch.tensor(mid - 1).type_as(relative_pos)`` is the same
kind of copy.

A chain whose only non-constant inputs are numbers (sizes: SymInt inputs and arithmetic on
them) and constants (``get_attr``) computes the same tensors for every call of one signature
(the runtime's key holds every size, padded ones included). This pass takes such a chain out
of the graph, up to and including its moves to the device: the graph reads each value the
rest of it uses (the chain's frontier) as a new input, and ``SignatureConstants.graph``
computes those inputs from the graph's own inputs. The runtime evaluates it once per
signature, as eager does (host ops, then the copy), into tensors its entry owns, before
warm-up and capture; a replay copies nothing.

Only chains that do host work qualify (some move of a host tensor to the device): a chain
built on the device is captured as it is, so graphs without host chains do not change. An
in-place op counts as out-of-place when it writes a tensor the chain itself created and no
node outside the chain reads that tensor before the write. Not taken, with the reason
(``SignatureConstants.refused``, logged): a random op, a value the graph returns or writes
(it would be one tensor shared by every call), a host value read outside the chain, and a
move whose host input is not a function of sizes alone (it reads a tensor input's data).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from fusebackend.passes.constants import is_random
from fusebackend.passes.fx_util import example_value, placeholders
from fusebackend.passes.mutations import storage_id, written_args, written_storages

__all__ = ["SignatureConstants", "signature_chain_nodes", "split_signature_constants"]

log = logging.getLogger(__name__)

_NUMBERS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
_FIX = (
    "build it on the device (device=...) or outside the compiled function, so that no "
    "host tensor is copied inside the captured graph"
)


@dataclasses.dataclass
class SignatureConstants:
    """What ``split_signature_constants`` took out of a graph.

    ``module`` is the rewritten graph (None when nothing was taken); ``graph(*args)`` (its
    inputs before the new ones) returns the values of ``module``'s last ``count`` inputs.
    ``nodes``: the names of the nodes taken out; ``refused``:
    why other host-to-device moves of the graph stay in it (each names its node and the fix).
    """

    graph: torch.fx.GraphModule | None
    count: int
    nodes: list[str]
    refused: list[str]
    module: torch.fx.GraphModule | None = None  # the rewritten copy of the graph


@dataclasses.dataclass
class _Chain:
    """The host chains of sizes of a graph (``_find_chain``): every node in graph order,
    those taken (``keep``: the moves and what they need), the constants, the tensors taken
    and the ones the rest of the graph reads (``frontier``), and why other moves stay."""

    nodes: list[torch.fx.Node]
    keep: set[torch.fx.Node]
    constants: set[torch.fx.Node]
    tensors: list[torch.fx.Node]
    frontier: list[torch.fx.Node]
    refused: list[str]


def signature_chain_nodes(
    gm: torch.fx.GraphModule, is_host: Callable[[torch.Tensor], bool]
) -> frozenset[str]:
    """The names of the nodes ``split_signature_constants`` would take out of ``gm``, with
    nothing built or logged (the host split asks first: prepare.py)."""
    chain = _find_chain(gm, is_host)
    return frozenset(n.name for n in chain.tensors) if chain.frontier else frozenset()


def split_signature_constants(
    gm: torch.fx.GraphModule, is_host: Callable[[torch.Tensor], bool]
) -> SignatureConstants:
    """Take the host chains of sizes out of a copy of ``gm`` (``module``; ``gm`` itself never
    changes; see the module docstring). ``is_host``: whether a tensor value lives on the
    host (on the CPU, for a CUDA graph)."""
    chain = _find_chain(gm, is_host)
    for reason in chain.refused:
        log.warning("host chain stays in the captured graph: %s", reason)
    if not chain.frontier:
        return SignatureConstants(None, 0, [], chain.refused)
    graph, nodes, keep = gm.graph, chain.nodes, chain.keep
    constants, tensors, frontier = chain.constants, chain.tensors, chain.frontier

    # The graph computing the frontier from the original inputs.
    derive = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs = placeholders(graph)
    for p in inputs:
        env[p] = derive.node_copy(p)
    for n in nodes:
        if n in keep and n not in env or n in constants and n not in env and _read_by(n, keep):
            env[n] = derive.node_copy(n, env.__getitem__)
    derive.output(tuple(env[n] for n in frontier))
    constants_gm = torch.fx.GraphModule(gm, derive)

    # A copy of the graph reads the frontier as new inputs after its own (Dynamo reads its
    # own graph's placeholders after the backend returns: that graph must not change).
    copied = torch.fx.Graph()
    old_to_new: dict[torch.fx.Node, torch.fx.Node] = {}
    copied.output(copied.graph_copy(graph, old_to_new))
    module = torch.fx.GraphModule(gm, copied)
    graph, nodes = copied, [old_to_new[n] for n in nodes if n in old_to_new]
    keep = {old_to_new[n] for n in keep}
    constants = {old_to_new[n] for n in constants}
    frontier = [old_to_new[n] for n in frontier]
    inputs = [old_to_new[p] for p in inputs]
    last = inputs[-1] if inputs else None
    for k, n in enumerate(frontier):
        ctx = graph.inserting_after(last) if last is not None else graph.inserting_before(None)
        with ctx:
            ph = graph.placeholder(f"signature_constant_{k}")
        ph.meta.update(n.meta)
        n.replace_all_uses_with(ph, delete_user_cb=lambda u: u not in keep)
        last = ph
    for n in reversed(nodes):
        if (n in keep or n in constants) and n.op != "placeholder" and not n.users:
            graph.erase_node(n)
    module.recompile()
    names = [n.name for n in tensors]
    log.info("per-signature constants %s from %s", [n.name for n in frontier], names)
    return SignatureConstants(constants_gm, len(frontier), names, chain.refused, module)


def _find_chain(gm: torch.fx.GraphModule, is_host: Callable[[torch.Tensor], bool]) -> _Chain:
    """The graph's host chains of sizes and the moves that stay (``_Chain``)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    numbers: set[torch.fx.Node] = set()  # number inputs and arithmetic on them
    constants: set[torch.fx.Node] = set()  # get_attr tensors the graph never writes
    written = written_storages(nodes)  # (a buffer the graph updates is state, not a constant)
    sized: set[torch.fx.Node] = set()  # tensors computed from numbers and constants alone
    blocked: dict[torch.fx.Node, str] = {}  # a tensor node not in ``sized``: why
    for node in nodes:
        value = example_value(node)
        if node.op == "placeholder":
            if isinstance(value, _NUMBERS):
                numbers.add(node)
            continue
        if node.op == "get_attr":
            if isinstance(value, torch.Tensor) and storage_id(value) not in written:
                constants.add(node)
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        inputs = node.all_input_nodes
        if isinstance(value, _NUMBERS) and not isinstance(value, torch.Tensor):
            if inputs and all(n in numbers for n in inputs):
                numbers.add(node)
            continue
        why = _why_not_sized(node, value, inputs, numbers, constants, sized)
        if why is None:
            sized.add(node)
        elif isinstance(value, torch.Tensor) or written_args(node):
            blocked[node] = why

    def host_tensor(n: torch.fx.Node) -> bool:
        v = example_value(n)
        return isinstance(v, torch.Tensor) and is_host(v)

    def reads_host(n: torch.fx.Node, scalars: bool) -> bool:
        # A 0-d host tensor is read as a number by device ops (no copy) unless it is moved.
        scalars = scalars or _is_move(n)
        return any(
            host_tensor(i) and (scalars or example_value(i).dim() > 0) for i in n.all_input_nodes
        )

    def device_tensor(n: torch.fx.Node) -> bool:
        v = example_value(n)
        return isinstance(v, torch.Tensor) and not is_host(v)

    refused: list[str] = []
    moves = [n for n in nodes if n in sized and device_tensor(n) and reads_host(n, True)]
    # Moves the graph keeps: a host input that is not a function of sizes alone.
    for node in nodes:
        if node in sized or not (device_tensor(node) and reads_host(node, False)):
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        cause = _first_cause(node, blocked, host_tensor)
        if cause is not None:
            refused.append(
                f"{node.name} copies a host tensor to the device on every call: {cause}; {_FIX}"
            )

    # The chain: every sized node a move needs (the moves included).
    keep: set[torch.fx.Node] = set()
    stack = list(moves)
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        stack.extend(i for i in n.all_input_nodes if i in sized or i in numbers)
        # An in-place op on a tensor the chain made belongs to the chain as well.
        stack.extend(u for u in n.users if u in sized and n in written_args(u))
    tensors = [n for n in nodes if n in keep and n in sized]
    frontier = [n for n in tensors if any(u not in keep for u in n.users)]

    why = _why_not_taken(graph, frontier, keep, order, host_tensor)
    if why is not None:
        refused.append(why)
        keep, tensors, frontier = set(), [], []
    return _Chain(nodes, keep, constants, tensors, frontier, refused)


def _why_not_sized(
    node: torch.fx.Node,
    value: Any,
    inputs: list[torch.fx.Node],
    numbers: set[torch.fx.Node],
    constants: set[torch.fx.Node],
    sized: set[torch.fx.Node],
) -> str | None:
    """None when ``node`` is a tensor computed from sizes and constants alone, else why not."""
    if not isinstance(value, torch.Tensor):
        return "it does not yield a tensor"
    if value.requires_grad:
        return "it needs gradients"
    if is_random(node):
        return "it draws random numbers"
    for n in inputs:
        if n not in numbers and n not in constants and n not in sized:
            kind = "input" if n.op == "placeholder" else "value"
            return f"it reads the {kind} {n.name}, not a size"
    for arg in written_args(node):
        if arg not in sized:
            return f"it writes {getattr(arg, 'name', arg)}, which the chain did not create"
    return None


def _first_cause(
    node: torch.fx.Node,
    blocked: dict[torch.fx.Node, str],
    host_tensor: Callable[[torch.fx.Node], bool],
) -> str | None:
    """The first host ancestor of ``node`` that is not a function of sizes, with why."""
    seen: set[torch.fx.Node] = set()
    stack = [i for i in node.all_input_nodes if host_tensor(i)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return None  # a host input moved as it comes: hoist_host_to_device's case
        if n in blocked and all(i not in blocked for i in n.all_input_nodes):
            return f"{n.name} is not a function of sizes alone ({blocked[n]})"
        stack.extend(i for i in n.all_input_nodes if host_tensor(i))
    return None


def _why_not_taken(
    graph: torch.fx.Graph,
    frontier: list[torch.fx.Node],
    keep: set[torch.fx.Node],
    order: dict[torch.fx.Node, int],
    host_tensor: Callable[[torch.fx.Node], bool],
) -> str | None:
    """Why the chain must stay in the graph, naming a node and the fix; None if it may go."""
    (out,) = graph.find_nodes(op="output")
    returned = {storage_id(example_value(n)) for n in out.all_input_nodes} - {None}
    outside = [n for n in graph.nodes if n not in keep]
    written_outside = written_storages(outside)
    for n in frontier:
        sid = storage_id(example_value(n))
        if host_tensor(n):
            user = next(u for u in n.users if u not in keep)
            return (
                f"{n.name} is a host tensor built from sizes that {user.name} reads on the "
                f"host; {_FIX}"
            )
        if sid in returned:
            return (
                f"{n.name} (built from sizes) is returned by the graph: one tensor would be "
                f"shared by every call; return a copy (.clone()) of it"
            )
        if sid in written_outside:
            return (
                f"{n.name} (built from sizes) is written in place later: one tensor would "
                f"be shared by every call; write a copy (.clone()) of it"
            )
        # An outside reader must see the chain's last write to the storage (the value the
        # runtime computes once): no reader before an in-place op of the chain.
        writes = [k for k in keep if sid in {storage_id(example_value(a)) for a in written_args(k)}]
        last_write = max((order[k] for k in writes), default=-1)
        for u in n.users:
            if u not in keep and order[u] < last_write:
                return f"{u.name} reads {n.name} before the chain writes it in place; {_FIX}"
    return None


def _is_move(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("to", "type_as", "cuda", "copy_", "new_tensor")
    return node.target in (torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.copy_)


def _read_by(node: torch.fx.Node, keep: set[torch.fx.Node]) -> bool:
    return any(u in keep for u in node.users)
