"""Tensors the graph builds from Python values alone: built once, read as constants.

Mistral, Gemma2, BLOOM, Falcon, GPT-J and MPNet build mask constants inside ``forward``
(``torch.tensor(0.0, device="cuda", dtype=torch.float16)``). Left in the graph, each call
does a host-to-device copy, which a CUDA graph cannot capture, so those graphs ran eagerly
(issue 9: 12 of 42 model-zoo runs on an H200). This pass evaluates such nodes once at
compile time and replaces them with ``get_attr`` buffers of the GraphModule, so a captured
graph reads them at a fixed address.

A node is folded when it yields a tensor and either is a factory (``torch.tensor``,
``full``, ``zeros``, ...) whose arguments hold no graph value and nothing symbolic, or an
op whose every input is folded. Never folded: random ops, in-place ops, anything whose
storage the graph mutates or returns (a returned constant would be one tensor shared by
every call; transformers' StaticCache builds its KV tensors with ``torch.zeros`` in a
compiled prefill, then fills and returns them), and anything whose real value differs from
Dynamo's example value in dtype, shape or device (an autocast region around it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusebackend.passes.graph import example_value, is_mutation
from fusebackend.passes.mutations import storage_id

__all__ = ["fold_constants"]

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
        name = f"_infinifuse_constant{count}"
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


def _foldable(
    node: torch.fx.Node, values: dict[torch.fx.Node, torch.Tensor], excluded: set[int]
) -> bool:
    if node.op not in ("call_function", "call_method") or is_mutation(node):
        return False
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or value.requires_grad:
        return False
    if storage_id(value) in excluded or _is_random(node) or _symbolic(value):
        return False
    inputs = node.all_input_nodes
    if any(n not in values for n in inputs) or _has_symbols((node.args, node.kwargs)):
        return False
    return bool(inputs) or (node.op == "call_function" and node.target in _FACTORIES)


def _evaluate(node: torch.fx.Node, values: dict[torch.fx.Node, torch.Tensor]) -> Any:
    """The node's real value, or None when it cannot be computed or differs from Dynamo's."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
    expected = example_value(node)
    try:
        with unset_fake_temporarily(), torch.no_grad():
            if node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
    except Exception as exc:  # a node we cannot run at compile time simply stays in the graph
        log.debug("constant %s not folded: %s: %s", node.name, type(exc).__name__, exc)
        return None
    if not isinstance(value, torch.Tensor) or (value.dtype, value.shape, value.device) != (
        expected.dtype,
        expected.shape,
        expected.device,
    ):
        log.debug("constant %s not folded: its value differs from Dynamo's", node.name)
        return None
    return value


def _mutated_or_returned_storages(graph: torch.fx.Graph) -> set[int]:
    storages: set[int] = set()
    for node in graph.nodes:
        if node.op == "output" or node.op == "call_module":
            written = node.all_input_nodes  # returned, or handed to an opaque module
        elif is_mutation(node):
            out = node.kwargs.get("out")
            written = node.all_input_nodes if out is not None else node.args[:1]
        else:
            continue
        for arg in written:
            if isinstance(arg, torch.fx.Node):
                sid = storage_id(example_value(arg))
                if sid is not None:
                    storages.add(sid)
    return storages


def _is_random(node: torch.fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.rstrip("_") in _RANDOM


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
