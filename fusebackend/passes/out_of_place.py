"""In-place elementwise ops on the graph's own temporaries made out-of-place (fused graph only).

Vision models write activations in place: timm and torchvision build ``nn.ReLU(inplace=True)``
and ``x += shortcut``, which Dynamo keeps as ``F.relu(x, inplace=True)``, ``operator.iadd``,
``Tensor.mul_``, ``torch.relu_``. Fusion never crosses a mutation (FX data flow does not show
what it changes), so before this pass a ResNet-50 fused nothing after its convolutions (49
in-place ReLUs, 16 in-place residual adds).

Where the written tensor is a temporary the graph made itself (no graph input, constant or
other value shares its storage), nothing but the graph can see the write. The op then
computes a new tensor, and every reader of the old tensor after the op reads the new one;
readers before it keep the old one, as in eager. The rewritten op must be an elementwise op
of the table (``passes/ops.py``) with the same result shape and dtype as the tensor it wrote
(an in-place ``fp16.add_(fp32)`` casts back to fp16; the out-of-place op would not). Left
alone otherwise, with the reason: a written graph input or constant (the write is part of
the graph's effect, also through a view of it), a tensor that shares its storage with another
value read after the write (a view, a slice, its base: the write shows through it). A write
into a view whose base nobody reads afterwards is made out-of-place: GhostNet's
``x = torch.cat([a, b], 1)[:, :c]`` then ``x += shortcut`` left 16 in-place adds, which kept
the graph NCHW (a write into a value whose layout would change) and out of fusion.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any

import torch
import torch.fx

from fusebackend.passes.fx_util import elementwise_on_one_layout, example_value
from fusebackend.passes.groups import match
from fusebackend.passes.mutations import storage_id, written_args
from fusebackend.passes.ops import OpCall, OpKind

__all__ = ["OutOfPlace", "make_out_of_place"]

_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub,
              operator.imul: operator.mul, operator.itruediv: operator.truediv}  # fmt: skip


@dataclasses.dataclass
class OutOfPlace:
    """What ``make_out_of_place`` did: the ops rewritten, and the in-place table ops left."""

    made: list[str] = dataclasses.field(default_factory=list)
    left_alone: list[str] = dataclasses.field(default_factory=list)


def _out_of_place_form(node: torch.fx.Node) -> tuple[str, Any, tuple, dict] | None:
    """(op, target, args, kwargs) of the out-of-place call ``node`` stands for, or None."""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    if node.op == "call_method":
        name = node.target
        if isinstance(name, str) and name.endswith("_") and not name.endswith("__"):
            return "call_method", name[:-1], args, kwargs
        return None
    target = node.target
    if target in _OPERATORS:
        return "call_function", _OPERATORS[target], args, kwargs
    if inspect.isfunction(target) and "inplace" in inspect.signature(target).parameters:
        bound = inspect.signature(target).bind(*args, **kwargs)  # F.relu(x, True) or inplace=
        bound.arguments["inplace"] = False
        return "call_function", target, bound.args, bound.kwargs
    name = getattr(target, "__name__", "")
    if name.endswith("_") and not name.endswith("__") and hasattr(torch, name[:-1]):
        if getattr(torch, name, None) is target:  # torch.relu_ -> torch.relu
            return "call_function", getattr(torch, name[:-1]), args, kwargs
    return None


def _is_elementwise(node: torch.fx.Node, form: tuple[str, Any, tuple, dict]) -> bool:
    """Is ``form`` (``node`` written out-of-place) an elementwise op of the table? Asked of
    the node itself, as the partition will ask it, then put back."""
    saved = (node.op, node.target, node.args, node.kwargs)
    node.op, node.target, node.args, node.kwargs = form
    call = match(node)
    node.op, node.target, node.args, node.kwargs = saved
    return isinstance(call, OpCall) and call.op.kind == OpKind.ELEMENTWISE


def _fresh_value(form: tuple[str, Any, tuple, dict], old: Any) -> Any:
    """The out-of-place call's fake result, computed in the fake mode of ``old`` (the written
    tensor's example value), or None where it cannot be computed."""
    mode = getattr(old, "fake_mode", None)
    if mode is None:
        return None
    op, target, args, kwargs = form
    fake_args = torch.fx.node.map_arg(args, example_value)
    fake_kwargs = torch.fx.node.map_arg(kwargs, example_value)
    try:
        with mode:
            # (symbolic sizes: its value without running it, in the in-place op's dtype)
            quick = elementwise_on_one_layout(op, target, fake_args, fake_kwargs, old,
                                              operands_dtype=True)  # fmt: skip
            if quick is not None:
                return quick
            if op == "call_method":
                return getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs)
            return target(*fake_args, **fake_kwargs)
    except Exception:  # a call the fake mode cannot run: the op stays in place
        return None


def make_out_of_place(graph: torch.fx.Graph) -> OutOfPlace:
    """Rewrite each in-place elementwise op on a graph temporary as its out-of-place form
    (see the module docstring); the readers after it read its result."""
    result = OutOfPlace()
    position = {node: i for i, node in enumerate(graph.nodes)}
    by_storage: dict[int, set[torch.fx.Node]] = {}
    for node in graph.nodes:
        sid = storage_id(example_value(node))
        if sid is not None:
            by_storage.setdefault(sid, set()).add(node)
    for node in list(graph.nodes):
        written = written_args(node)
        if node.op == "call_module" or len(written) != 1 or written[0] is not node.args[0]:
            continue
        target = written[0]
        if not isinstance(example_value(target), torch.Tensor):
            continue  # not a tensor write: nothing to make out-of-place
        form = _out_of_place_form(node)
        if form is None or not _is_elementwise(node, form):
            continue  # not a table op: out of this pass's scope, nothing to report
        old = example_value(target)
        why = _refusal(target, node, by_storage, position)
        value = None if why else _fresh_value(form, old)
        if why is None and not (
            isinstance(value, torch.Tensor)
            and value.shape == old.shape
            and value.dtype == old.dtype
        ):
            why = "its out-of-place result differs in shape or dtype (in place casts it)"
        if why is not None:
            result.left_alone.append(f"{node.name}: {why}")
            continue
        node.op, node.target, node.args, node.kwargs = form
        if storage_id(value) == storage_id(old):
            # The op returns its input itself (eval dropout): in place it wrote nothing
            by_storage[storage_id(old)].discard(node)
            node.replace_all_uses_with(target)
            graph.erase_node(node)
            result.made.append(node.name)
            continue
        # The written tensor goes by several nodes: itself and the results of earlier in-place
        # ops on it (u = t.add_(y) returns t). Every reader of any of them after this op
        # reads this op's result.
        group = by_storage[storage_id(old)]
        names = [target] + [
            other for other in group
            if other is not node and position[other] < position[node]
            and target in _written_chain(other)
        ]  # fmt: skip
        group.discard(node)
        node.meta["example_value"] = value
        by_storage.setdefault(storage_id(value), set()).add(node)
        for name in names:
            for reader in list(name.users):
                if reader is not node and position[reader] > position[node]:
                    reader.replace_input_with(name, node)
        result.made.append(node.name)
    return result


def _refusal(
    target: torch.fx.Node, writer: torch.fx.Node, by_storage: dict[int, set[torch.fx.Node]],
    position: dict[torch.fx.Node, int],
) -> str | None:  # fmt: skip
    """Why ``writer``'s write into ``target`` is seen outside the graph's data flow (None: it
    is not). A value sharing ``target``'s storage made before the write (its base, another
    view) sees the write when it is a graph input or constant or is read after the write."""
    if target.op in ("placeholder", "get_attr"):
        return f"it writes the graph input or constant {target.name}"
    sid = storage_id(example_value(target))
    if sid is None:
        return f"{target.name} has no example tensor"
    for other in by_storage.get(sid, ()):
        if other is target or target in _written_chain(other):
            continue
        if position[other] > position[writer]:
            continue  # made after the write (a view of its result): its source's readers count
        if other.op in ("placeholder", "get_attr"):
            return f"{target.name} is a view of the graph input or constant {other.name}"
        if any(position[r] > position[writer] for r in other.users):
            return (f"{target.name} shares its storage with {other.name}, read after the "
                    "write (a view or alias)")  # fmt: skip
    return None


def _written_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """What ``node`` writes, and what those write in turn (``x.add_(y).relu_()``)."""
    chain, current = [], node
    while True:
        written = written_args(current)
        if len(written) != 1:
            return chain
        chain.append(written[0])
        current = written[0]
