"""What a node writes (``written_args``), and which graph inputs a graph writes into.

``written_args`` is the one answer to "what does this node write" for every pass (mutated
inputs, constants, host work, the fusion pass through ``graph.is_mutation``):

- an ``out=`` argument (one node or a tuple of them);
- ``aten``/custom operators (``OpOverload``, ``OpOverloadPacket``): every argument whose
  schema type is written (``Tensor(a!)``, ``Tensor(a!)[]``);
- torch-level in-place methods and functions (a name ending in ``_``: ``add_``,
  ``torch._foreach_add_``, ``torch.relu_``; ``operator.iadd``/``setitem``; ``inplace=True``,
  by keyword or by position): their first argument, every tensor of it when it is a list
  (``torch._foreach_add_([c], 1)``);
- a function that declares the positions it writes in ``writes_arguments`` (the package's
  own kernels called from a graph, ``kernels.cache_write.write_cache_pair``: a torch custom
  operator would say so in its schema, but costs ~26 us of dispatch per call, measured on
  a CPU, which an uncaptured decode step pays in every layer);
- an opaque module (``call_module``): everything it is given.

Mutated inputs come from storage identity: a written node may be the placeholder itself or
any alias of it (a view, a slice, ``.detach()``, ``.data``, ``.to()`` to the same device and
dtype, ``.contiguous()`` of a contiguous tensor). Dynamo's fake tensors keep storage identity
across all of these (an alias's ``example_value`` shares its untyped storage with its base;
the example values live as long as the graph, so storage ids are never reused). Following op
names instead missed ``c = counter.to(counter.device); c.add_(16)`` (transformers'
StaticCache), and the runtime then advanced the counter twice on a new signature.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Iterable

import torch
import torch.fx

from fusebackend.passes.fx_util import example_value, placeholders

__all__ = [
    "known_written_storages",
    "mutated_placeholders",
    "storage_id",
    "written_args",
    "written_storages",
]

_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul, operator.setitem,
}  # fmt: skip
_INPLACE_DUNDERS = {
    f"__{op.__name__}__" for op in _INPLACE_OPERATORS if op is not operator.setitem
} | {"__setitem__"}
# In-place by name, but they change flags, not data.
_METADATA_ONLY = {"requires_grad_", "share_memory_"}


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph values ``node`` writes into, without repeats; empty for a pure node."""
    if node.op == "call_module":
        return list(node.all_input_nodes)  # opaque: it may write anything it is given
    if node.op == "call_method":
        return _first_arg(node) if _in_place_name(node.target) else []
    if node.op != "call_function":
        return []
    target = node.target
    written = _nodes(node.kwargs.get("out"))
    declared = getattr(target, "writes_arguments", None)
    if declared is not None:
        for position in declared:
            if position < len(node.args):
                written += _nodes(node.args[position])
    elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        for position, name in _schema_writes(target):
            if position is not None and position < len(node.args):
                written += _nodes(node.args[position])
            written += _nodes(node.kwargs.get(name))
    elif (
        target in _INPLACE_OPERATORS
        or _inplace_flag(node)
        or (_in_place_name(getattr(target, "__name__", "")) and not _is_operator_module(target))
    ):
        written += _first_arg(node)
    return list(dict.fromkeys(written))


def storage_id(value: object) -> int | None:
    """Identity of a (fake or real) tensor's untyped storage, or None for anything else.

    Sparse and other storage-less tensors have none (``untyped_storage`` raises).
    """
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def written_storages(nodes: Iterable[torch.fx.Node]) -> set[int]:
    """Storage ids of everything ``nodes`` write (values without a storage are left out)."""
    storages = {storage_id(example_value(arg)) for node in nodes for arg in written_args(node)}
    storages.discard(None)
    return storages  # type: ignore[return-value]


def known_written_storages(nodes: Iterable[torch.fx.Node]) -> set[int] | None:
    """Storage ids of everything ``nodes`` write; None where a written value has no example
    value (a storage to compare): then no rewrite can tell what a write reaches."""
    storages = set()
    for node in nodes:
        for arg in written_args(node):
            storage = storage_id(example_value(arg))
            if storage is None:
                return None
            storages.add(storage)
    return storages


def mutated_placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Graph inputs written by any node, directly or through any alias, in order.

    A written value without an example value (a hand-built graph; Dynamo records one for
    every tensor) counts as writing every input it is computed from: more inputs than
    needed are then treated as mutated, never fewer.
    """
    inputs = placeholders(graph)
    by_storage: dict[int, list[torch.fx.Node]] = {}
    for node in inputs:
        sid = storage_id(example_value(node))
        if sid is not None:
            by_storage.setdefault(sid, []).append(node)
    mutated: set[torch.fx.Node] = set()
    for node in graph.nodes:
        for target in written_args(node):
            sid = storage_id(example_value(target))
            if sid is not None:
                mutated.update(by_storage.get(sid, ()))
            else:
                mutated.update(_ancestor_placeholders(target))
    return [p for p in inputs if p in mutated]


def _nodes(value: object) -> list[torch.fx.Node]:
    """The nodes in ``value``: a node, or a list/tuple of them (one level, as ops take)."""
    if isinstance(value, torch.fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.fx.Node)]
    return []


def _first_arg(node: torch.fx.Node) -> list[torch.fx.Node]:
    return _nodes(node.args[0]) if node.args else []


def _in_place_name(name: object) -> bool:
    if not isinstance(name, str) or name in _METADATA_ONLY:
        return False
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def _is_operator_module(target: object) -> bool:
    # operator.and_/or_/not_/concat end in "_" and are pure; the in-place ones are listed.
    return getattr(target, "__module__", None) in ("_operator", "operator")


@functools.cache
def _schema_writes(
    target: torch._ops.OpOverload | torch._ops.OpOverloadPacket,
) -> tuple[tuple[int | None, str], ...]:
    """(position or None when keyword-only, name) of each argument the schema writes; for a
    packet, of every overload (conservative: one may write where another reads)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        schemas = [getattr(target, name)._schema for name in target.overloads()]
    else:
        schemas = [target._schema]
    writes = set()
    for schema in schemas:
        for position, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                writes.add((None if arg.kwarg_only else position, arg.name))
    return tuple(sorted(writes, key=lambda w: (w[0] is None, w[0] or 0, w[1])))


def _inplace_flag(node: torch.fx.Node) -> bool:
    """``inplace=True`` by keyword, or by position (Dynamo keeps ``F.relu(x, True)`` as is)."""
    if node.kwargs.get("inplace") is True:
        return True
    position = _inplace_position(node.target) if inspect.isfunction(node.target) else None
    return position is not None and position < len(node.args) and node.args[position] is True


@functools.cache
def _inplace_position(target: object) -> int | None:
    # Python functions only (F.relu, F.dropout, ...): module-level, so caching keeps nothing
    # alive that would otherwise go (a FusedGroupOp target would keep its reference graph).
    if not inspect.isfunction(target):
        return None
    names = list(inspect.signature(target).parameters)
    return names.index("inplace") if "inplace" in names else None


def _ancestor_placeholders(node: torch.fx.Node) -> set[torch.fx.Node]:
    found, seen, stack = set(), {node}, [node]
    while stack:
        current = stack.pop()
        if current.op == "placeholder":
            found.add(current)
        for parent in current.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return found
