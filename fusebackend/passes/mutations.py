"""Which graph inputs a graph writes into, through any alias, from storage identity.

A mutation node (``is_mutation``: a method ending in ``_``, ``copy_``, setitem, ``out=``,
``inplace=True``) writes into its first argument (or its ``out=``). That argument may be
the placeholder itself or any alias of it: a view, a slice, ``.detach()``, ``.to()`` to the
same device and dtype, ``.contiguous()`` of a contiguous tensor. Dynamo's fake tensors keep
storage identity across all of these (an alias's ``example_value`` shares its untyped
storage with its base; the example values live as long as the graph, so storage ids are
never reused), so the mutated inputs are the placeholders whose storage a mutation writes.
Following op names instead missed ``c = counter.to(counter.device); c.add_(16)``
(transformers' StaticCache), and the runtime then advanced the counter twice on a new
signature.

A node without an example value (hand-built graphs) falls back to following a list of view
ops by name.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fusebackend.passes.graph import example_value, is_mutation

__all__ = ["mutated_placeholders", "storage_id"]

# Ops whose result shares storage with args[0]; only used for nodes without example values.
_VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "select",
    "narrow", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten",
    "__getitem__", "as_strided", "diagonal", "unfold", "split", "chunk", "contiguous",
    "detach", "movedim", "swapaxes", "T", "mT",
}  # fmt: skip
_VIEW_FUNCTIONS = {
    operator.getitem, torch.reshape, torch.transpose, torch.permute, torch.select,
    torch.narrow, torch.unsqueeze, torch.squeeze, torch.flatten, torch.split, torch.chunk,
    torch.movedim, torch.swapaxes, torch.t, torch.diagonal, torch.detach,
}  # fmt: skip


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


def mutated_placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Graph inputs written by an in-place op, directly or through any alias, in order."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    by_storage: dict[int, list[torch.fx.Node]] = {}
    for node in placeholders:
        sid = storage_id(example_value(node))
        if sid is not None:
            by_storage.setdefault(sid, []).append(node)
    mutated: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "call_module" or not is_mutation(node):
            continue
        for target in _mutated_args(node):
            sid = storage_id(example_value(target))
            if sid is not None:
                mutated.update(by_storage.get(sid, ()))
                continue
            while target is not None and target.op != "placeholder":  # no example value
                target = _view_base(target)
            if target is not None:
                mutated.add(target)
    return [p for p in placeholders if p in mutated]


def _mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes an in-place op writes: its ``out=`` (one or a tuple), else its first arg."""
    out = node.kwargs.get("out")
    if out is not None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o for o in outs if isinstance(o, torch.fx.Node)]
    first = node.args[0] if node.args else None
    return [first] if isinstance(first, torch.fx.Node) else []


def _view_base(node: torch.fx.Node) -> torch.fx.Node | None:
    is_view = (node.op == "call_method" and node.target in _VIEW_METHODS) or (
        node.op == "call_function" and node.target in _VIEW_FUNCTIONS
    )
    first = node.args[0] if node.args else None
    return first if is_view and isinstance(first, torch.fx.Node) else None
