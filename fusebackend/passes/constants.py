"""Tensors the graph builds from Python values alone: built once, read as constants.

Mistral, Gemma2, BLOOM, Falcon, GPT-J and MPNet build mask constants inside ``forward``
(``torch.tensor(0.0, device="cuda", dtype=torch.float16)``). Left in the graph, each call
does a host-to-device copy, which a CUDA graph cannot capture, so those graphs ran eagerly
(12 of 42 model-zoo runs on an H200 before this pass). This pass evaluates such nodes once at
compile time and replaces them with ``get_attr`` buffers of the GraphModule, so a captured
graph reads them at a fixed address.

A node is folded when it yields a tensor and either is a factory (``torch.tensor``,
``full``, ``zeros``, ...) whose arguments hold no graph value and nothing symbolic, or an
op whose every input is folded. Never folded: random ops (by name, by the
``nondeterministic_seeded`` tag of the aten op, and any node whose evaluation moved the CPU
or CUDA generator: ``torch.binomial``, ``_standard_gamma``, ``native_dropout`` are none of
the names; the generator is then put back, so compiling draws nothing), in-place ops, anything whose
storage the graph mutates or returns (a returned constant would be one tensor shared by
every call; transformers' StaticCache builds its KV tensors with ``torch.zeros`` in a
compiled prefill, then fills and returns them), and anything whose real value differs from
Dynamo's example value in dtype, shape or device (an autocast region around it).
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusebackend.passes.fx_util import example_value
from fusebackend.passes.mutations import storage_id, written_args, written_storages

__all__ = ["CONSTANT_PREFIX", "RngStates", "fold_constants", "fold_list_indices", "is_random"]

# The buffer names of folded constants start with this (the graph's get_attrs).
CONSTANT_PREFIX = "_infinifuse_constant"

log = logging.getLogger(__name__)

_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.full, torch.zeros, torch.ones,
    torch.empty, torch.arange, torch.linspace, torch.logspace, torch.eye,
}  # fmt: skip

# Ops whose every call gives new values (or draws from a generator): never folded.
_RANDOM = {
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "bernoulli", "multinomial", "normal", "poisson", "dropout", "alpha_dropout",
    "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "rrelu", "exponential",
    "geometric", "log_normal", "cauchy", "uniform",
}  # fmt: skip


def fold_constants(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` in place; return the names of the nodes computed at compile time."""
    excluded = _mutated_or_returned_storages(gm.graph)
    values: dict[torch.fx.Node, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if not _foldable(node, values, excluded):
            continue
        value = _evaluate(node, values)
        if value is not None:
            values[node] = value
    if not values:
        return []
    count = 0
    for node, value in values.items():
        if all(user in values for user in node.users):
            continue  # only read by other constants: dropped with them
        name = f"{CONSTANT_PREFIX}{count}"
        count += 1
        gm.register_buffer(name, value, persistent=False)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
    for node in reversed(list(values)):
        gm.graph.erase_node(node)
    gm.recompile()
    folded = [node.name for node in values]
    log.info("folded %d constant node(s): %s", len(folded), ", ".join(folded))
    return folded


def fold_list_indices(gm: torch.fx.GraphModule) -> list[str]:
    """Replace lists of ints that index a device tensor with index tensors on its device.

    Falcon splits its fused QKV with ``fused_qkv[..., [-2], :]``: PyTorch turns the list into
    a CPU index tensor and copies it to the device on every call, which a CUDA graph cannot
    capture (the zoo's Falcon runs never captured on an H100, 2026-11-23). An index tensor
    holding the same ints selects the same elements (negative ints included); on the CPU it
    saves building that tensor each call. Returns the names of the indexing nodes changed.
    """
    changed: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (operator.getitem, operator.setitem):
            continue
        base, index = node.args[0], node.args[1]
        value = example_value(base) if isinstance(base, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        parts = index if isinstance(index, tuple) else (index,)
        if not any(_int_list(p) for p in parts):
            continue
        replaced = []
        for part in parts:
            if _int_list(part):
                name = f"_infinifuse_index{len(gm._buffers)}"
                tensor = torch.tensor(part, dtype=torch.long, device=value.device)
                gm.register_buffer(name, tensor, persistent=False)
                with gm.graph.inserting_before(node):
                    attr = gm.graph.get_attr(name)
                attr.meta["example_value"] = tensor
                part = attr
            replaced.append(part)
        node.args = (base, tuple(replaced) if isinstance(index, tuple) else replaced[0],
                     *node.args[2:])  # fmt: skip
        changed.append(node.name)
    if changed:
        gm.recompile()
        log.info("list indices as index tensors in %s", ", ".join(changed))
    return changed


def _int_list(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(type(v) is int for v in x)


def _foldable(
    node: torch.fx.Node, values: dict[torch.fx.Node, torch.Tensor], excluded: set[int]
) -> bool:
    if node.op not in ("call_function", "call_method") or written_args(node):
        return False
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or value.requires_grad:
        return False
    if storage_id(value) in excluded or is_random(node) or _symbolic(value):
        return False
    if _cast_like(node):
        # ``c.type_as(t)`` / ``c.to(t)`` read only t's dtype and device (DeBERTa's
        # ``torch.tensor(mid - 1).type_as(relative_pos)``): a constant where ``c`` is one.
        return node.args[0] in values
    inputs = node.all_input_nodes
    if any(n not in values for n in inputs) or _has_symbols((node.args, node.kwargs)):
        return False
    return bool(inputs) or (node.op == "call_function" and node.target in _FACTORIES)


def _cast_like(node: torch.fx.Node) -> bool:
    """``x.type_as(t)`` or ``x.to(t)`` with a tensor ``t`` and nothing else."""
    method = node.op == "call_method" and node.target in ("type_as", "to")
    function = node.op == "call_function" and node.target in (
        torch.Tensor.type_as,
        torch.Tensor.to,
    )
    if not (method or function) or len(node.args) != 2 or node.kwargs:
        return False
    source, like = node.args
    return (
        isinstance(source, torch.fx.Node)
        and isinstance(like, torch.fx.Node)
        and isinstance(example_value(like), torch.Tensor)
    )


def _evaluate(node: torch.fx.Node, values: dict[torch.fx.Node, torch.Tensor]) -> Any:
    """The node's real value, or None when it cannot be computed, differs from Dynamo's, or
    drew random numbers (the generators are then put back as they were)."""
    expected = example_value(node)
    cast = _cast_like(node)
    if cast:  # the other tensor is not a constant: only its dtype and device count
        args, kwargs = (values[node.args[0]],), {}
    else:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
    rng = RngStates()
    try:
        with unset_fake_temporarily(), torch.no_grad():
            if cast:
                value = args[0].to(device=expected.device, dtype=expected.dtype)
            elif node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
    except Exception as exc:  # a node we cannot run at compile time simply stays in the graph
        log.debug("constant %s not folded: %s: %s", node.name, type(exc).__name__, exc)
        rng.restore_if_moved()
        return None
    if rng.restore_if_moved():
        log.debug("constant %s not folded: it draws random numbers", node.name)
        return None
    if not isinstance(value, torch.Tensor) or (value.dtype, value.shape, value.device) != (
        expected.dtype,
        expected.shape,
        expected.device,
    ):
        log.debug("constant %s not folded: its value differs from Dynamo's", node.name)
        return None
    return value


class RngStates:
    """The CPU generator's state, and each initialised CUDA device's, before a node runs."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        # Only devices already in use: asking an uninitialised one would initialise CUDA.
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore_if_moved(self) -> bool:
        """Put back any generator the node moved; return whether one moved."""
        moved = False
        if not torch.equal(torch.get_rng_state(), self.cpu):
            torch.set_rng_state(self.cpu)
            moved = True
        # A node that initialised CUDA itself (the first CUDA tensor of the process) left
        # nothing to compare with; the name and tag checks of ``is_random`` cover it.
        if self.cuda is not None:
            now = torch.cuda.get_rng_state_all()
            if any(not torch.equal(a, b) for a, b in zip(now, self.cuda, strict=True)):
                torch.cuda.set_rng_state_all(self.cuda)
                moved = True
        return moved


def _mutated_or_returned_storages(graph: torch.fx.Graph) -> set[int]:
    returned = [n for n in graph.nodes if n.op == "output"]
    storages = {storage_id(example_value(arg)) for n in returned for arg in n.all_input_nodes}
    storages.discard(None)
    return storages | written_storages(graph.nodes)  # type: ignore[operator]


def is_random(node: torch.fx.Node) -> bool:
    """Random by name, or by the ``nondeterministic_seeded`` tag of its aten op."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _seeded_packet(target)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name.rstrip("_") in _RANDOM:
        return True
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    return isinstance(packet, torch._ops.OpOverloadPacket) and _seeded_packet(packet)


@functools.cache
def _seeded_packet(packet: torch._ops.OpOverloadPacket) -> bool:
    return any(
        torch.Tag.nondeterministic_seeded in getattr(packet, name).tags
        for name in packet.overloads()
    )


def _symbolic(value: torch.Tensor) -> bool:
    return any(not isinstance(s, int) for s in value.shape)


def _has_symbols(tree: Any) -> bool:
    found = False

    def visit(x: Any) -> Any:
        nonlocal found
        found = found or isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
        return x

    torch.fx.node.map_aggregate(tree, visit)
    return found
