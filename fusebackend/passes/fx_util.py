"""Small FX helpers shared by the passes (a leaf module: imports nothing from the package)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

__all__ = [
    "bound_arguments",
    "evaluate",
    "example_value",
    "known_channels_last",
    "known_contiguous",
    "known_equal",
    "nodes_between",
    "placeholders",
    "single_user",
    "tensor_layout",
    "static_fake",
    "static_tensor",
]


def example_value(node: torch.fx.Node) -> object:
    """The fake tensor (or value) Dynamo recorded for ``node``, or None."""
    return node.meta.get("example_value", node.meta.get("val"))


def vmapped_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes computed on functorch's batched tensors: ``torch.vmap`` (or a higher-order
    op built on it, as ``associative_scan`` on the CPU) inlined by Dynamo, from each
    ``_add_batch_dim`` to its ``_remove_batch_dim``. A batched tensor has no storage, so no
    kernel can read one (transformers' Mamba scan failed every fused run on the CPU)."""
    batched: set[torch.fx.Node] = set()
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "")
        if name == "_add_batch_dim" or (
            name != "_remove_batch_dim" and any(a in batched for a in node.all_input_nodes)
        ):
            batched.add(node)
    return batched


def placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's inputs, in order."""
    return [n for n in graph.nodes if n.op == "placeholder"]


def static_tensor(value: object) -> bool:
    """Is ``value`` a tensor whose sizes are all plain ints (no symbolic dims)?"""
    return isinstance(value, torch.Tensor) and all(isinstance(n, int) for n in value.shape)


def nodes_between(start: torch.fx.Node, end: torch.fx.Node) -> Iterator[torch.fx.Node]:
    """The nodes after ``start`` and before ``end`` (``end`` must come after ``start``)."""
    node = start.next
    while node is not end:
        yield node
        node = node.next


def bound_arguments(node: torch.fx.Node, signature: inspect.Signature) -> dict[str, Any] | None:
    """``node``'s arguments bound to ``signature`` by name, defaults filled in; None where
    they do not bind."""
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def single_user(node: object) -> torch.fx.Node | None:
    """The one node that reads ``node``, or None (several readers, none, not a node)."""
    if not isinstance(node, torch.fx.Node):
        return None
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def known_equal(a: object, b: object) -> bool:
    """Are two sizes (ints or SymInts) equal for every value the shape environment allows?
    Asked without adding a guard: unknown counts as not equal."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def known_contiguous(value: torch.Tensor) -> bool:
    """Is ``value`` contiguous (symbolic sizes: its strides are a contiguous tensor's)?"""
    if static_tensor(value) and all(isinstance(s, int) for s in value.stride()):
        return value.is_contiguous()
    from torch._prims_common import make_contiguous_strides_for

    expected = make_contiguous_strides_for(value.shape)
    return all(map(known_equal, value.stride(), expected))


def known_channels_last(value: torch.Tensor) -> bool:
    """Is the 4-d ``value`` channels-last (symbolic sizes: its strides are those
    ``contiguous(memory_format=torch.channels_last)`` gives)?"""
    if value.dim() != 4:
        return False
    if static_tensor(value) and all(isinstance(s, int) for s in value.stride()):
        return value.is_contiguous(memory_format=torch.channels_last)
    _, c, h, w = value.shape
    return all(map(known_equal, value.stride(), (c * h * w, 1, w * c, c)))


def evaluate(node: torch.fx.Node, value_of: Callable[[Any], Any] = example_value) -> Any:
    """``node``'s value computed on its arguments' example values (or those ``value_of``
    gives), under their fake mode: the example value of a node a pass made or changed."""
    args = torch.fx.node.map_arg(node.args, value_of)
    kwargs = torch.fx.node.map_arg(node.kwargs, value_of)
    fake = next((v for v in (*args, *kwargs.values()) if hasattr(v, "fake_mode")), None)
    with fake.fake_mode if fake is not None else contextlib.nullcontext():
        quick = elementwise_on_one_layout(node.op, node.target, args, kwargs,
                                          node.meta.get("example_value"))  # fmt: skip
        if quick is not None:
            return quick
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return node.target(*args, **kwargs)


def elementwise_on_one_layout(
    op: str, target: Any, args: Any, kwargs: Any, traced: Any, *, operands_dtype: bool = False
) -> Any:
    """The value of an elementwise op of the op table (FX ``op`` and ``target``) on fake
    ``args`` with symbolic sizes, none of them 1, without running it: where its operands of
    the ``traced`` value's shape share one dense layout and every other operand has at most
    one dim above 1 (a per-channel scale, a scalar), an empty tensor of that layout in the
    traced dtype; else None. Eager's TensorIterator orders the output's dims by its
    operands' strides, and a broadcast operand's stride 0 leaves each order to the next
    operand. ``operands_dtype``: ``traced`` gives the shape only, and the dtype is its
    tensor operands' one floating dtype (an arithmetic op: no promotion), else None.

    Fake tensors with symbolic sizes run an op's meta function through sympy:
    MobileNetV3-large's passes spent 1.5 s in 21 hardswishes after a batch-size change
    (CPU, 2026-11-30)."""
    from fusebackend.passes.ops import OpKind, bind_op, lookup_op

    if not isinstance(traced, torch.Tensor) or static_tensor(traced):
        return None  # (static sizes: the op itself is as fast)
    if not all(map(_above_one, traced.shape)):
        return None  # (a dim of 1 takes any stride: eager's choice is not followed here)
    row = lookup_op(op, target)
    if row is None or row[0].kind != OpKind.ELEMENTWISE or row[0].name in ("cast", "dropout"):
        return None  # (a cast may name a layout; dropout outside training returns its input)
    call = bind_op(*row, args, kwargs)
    if isinstance(call, str):
        return None
    tensors = [v for v in call.operands if isinstance(v, torch.Tensor)]
    if operands_dtype and not (
        row[0].result == "float"
        and traced.dtype.is_floating_point
        and all(t.dtype == traced.dtype for t in tensors)
    ):
        return None
    full = [t for t in tensors if _same_sizes(t.shape, traced.shape)]
    if not full or full[0].device != traced.device:
        return None
    first = full[0]
    if not (known_contiguous(first) or known_channels_last(first)):
        return None
    if not all(_same_sizes(t.stride(), first.stride()) for t in full):
        return None
    for small in (t for t in tensors if not any(t is f for f in full)):
        if small.dim() > traced.dim() or sum(_above_one(n) for n in small.shape) > 1:
            return None
    return torch.empty_like(first, dtype=traced.dtype)


def _above_one(size: Any) -> bool:
    """A size other than a plain 1 (symbolic sizes are never 1: Dynamo specialises them)."""
    return not (isinstance(size, int) and size == 1)


def _same_sizes(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """The same sizes (or strides), symbolic ones as the same expression (no guard).
    Structural, where ``known_equal`` asks sympy: a node's operands in Dynamo's graph carry
    the same symbols, and the shortcut exists to keep sympy out of the pass."""
    return len(a) == len(b) and all(
        x == y if isinstance(x, int) and isinstance(y, int) else _expression(x) == _expression(y)
        for x, y in zip(a, b, strict=True)
    )


def _expression(size: Any) -> Any:
    node = getattr(size, "node", None)
    return node.expr if node is not None else size


def readers_through(
    node: torch.fx.Node, through: Callable[[torch.fx.Node], bool]
) -> list[torch.fx.Node]:
    """What reads ``node``'s value: its users, and for each user that ``through`` accepts
    (a view of it, as the caller counts views), that user's readers in turn."""
    found, stack = [], [node]
    while stack:
        for user in stack.pop().users:
            (stack if through(user) else found).append(user)
    return found


def reaches_output(node: torch.fx.Node, through: Callable[[torch.fx.Node], bool]) -> bool:
    """Is ``node``'s value, or a view of it (``readers_through``), a graph output?"""
    return any(user.op == "output" for user in readers_through(node, through))


def call_evaluated(
    graph: torch.fx.Graph, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> torch.fx.Node:
    """A new node calling ``target`` on ``args`` (where the graph inserts now), its example
    value computed from its arguments' (``evaluate``)."""
    node = graph.call_function(target, args, kwargs)
    node.meta["example_value"] = evaluate(node)
    return node


def method_evaluated(
    graph: torch.fx.Graph, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> torch.fx.Node:
    """A new node calling the tensor method ``method`` on ``args`` (where the graph inserts
    now), its example value computed from its arguments' (``evaluate``)."""
    node = graph.call_method(method, args, kwargs or {})
    node.meta["example_value"] = evaluate(node)
    return node


def same_layout(a: object, b: object) -> bool:
    """Are ``a`` and ``b`` tensors of one static shape, strides and dtype?"""
    if not (static_layout(a) and static_layout(b)):
        return False
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def tensor_layout(value: torch.Tensor) -> tuple[Any, ...]:
    """What a rewrite must keep of a value: its shape, strides, dtype and device."""
    return tuple(value.shape), value.stride(), value.dtype, value.device


def static_layout(value: object) -> bool:
    """Is ``value`` a tensor whose sizes, strides and storage offset are all plain ints?"""
    return isinstance(value, torch.Tensor) and all(
        isinstance(n, int) for n in (*value.shape, *value.stride(), value.storage_offset())
    )


def layout_view(value: torch.Tensor, shape: Any) -> torch.Tensor | None:
    """``value``'s layout viewed as ``shape`` (a meta tensor: its strides), or None where
    that reshape would copy."""
    try:
        return torch.empty_strided(value.shape, value.stride(), device="meta").view(shape)
    except RuntimeError:
        return None


def empty_node(graph: torch.fx.Graph, shape: Any, stride: Any, like: Any) -> torch.fx.Node:
    """A node allocating a tensor of ``shape`` and ``stride`` of ``like``'s dtype and device
    (where the graph inserts now), its example value in ``like``'s fake mode."""
    shape, stride = tuple(shape), tuple(stride)
    node = graph.call_function(torch.empty_strided, (shape, stride),
                               {"dtype": like.dtype, "device": like.device})  # fmt: skip
    with getattr(like, "fake_mode", None) or contextlib.nullcontext():
        node.meta["example_value"] = torch.empty_strided(shape, stride, dtype=like.dtype,
                                                         device=like.device)  # fmt: skip
    return node


def static_fake(example: Any, tensor: torch.Tensor) -> Any:
    """A fake tensor of ``tensor``'s sizes, strides, dtype and device in ``example``'s fake
    mode, its sizes static (``mode.from_tensor`` would make them symbols that no guard can
    name: Dynamo then failed to build the guards a pass's shape arithmetic added)."""
    with example.fake_mode:
        return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()),
                                   dtype=tensor.dtype, device=tensor.device)  # fmt: skip
