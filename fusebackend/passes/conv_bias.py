"""A convolution's bias moved into the elementwise ops after it (fused graph only).

PyTorch adds a convolution's bias in a kernel of its own after cuDNN's (measured on an H200,
timm ResNet-50 fp16 with its BatchNorms folded: 53 broadcast-add kernels per call, one per
convolution). Where every reader of the convolution is an elementwise op of the table, the
convolution runs without its bias and ``+ bias`` (viewed per channel) comes after it as an
ordinary elementwise op, which then fuses with the activation, residual add or gate that
follows: conv + bias + ReLU becomes conv + one kernel. A reader that permutes the channels
elsewhere and feeds table ops only (ConvNeXt's ``x.permute(0, 2, 3, 1)`` before its LayerNorm)
gets the bias added after the permute, viewed along the channels' new dim, where the norm's
row group takes the add in. ConvNeXt-tiny kept 22 such bias adds, one generic broadcast-add
kernel each, 89.6 us of a batch-8 call (H200, fp16, 2026-11-28,
``benchmarks/diag/diag_conv_layout.py --top 24``). The value is the same: PyTorch rounds the
convolution's output to its dtype before adding the bias too.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fusebackend.passes.fx_util import evaluate, example_value
from fusebackend.passes.groups import match
from fusebackend.passes.ops import OpCall, OpKind

__all__ = ["CONVOLUTIONS", "is_batched", "move_conv_biases", "per_channel"]

CONVOLUTIONS = {torch.conv1d, torch.conv2d, torch.conv3d, torch.nn.functional.conv1d,
                torch.nn.functional.conv2d, torch.nn.functional.conv3d}  # fmt: skip


def _bias(conv: torch.fx.Node) -> object:
    return conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")


def is_batched(conv: torch.fx.Node) -> bool:
    """Is the convolution's input batched (as many dims as its weight, both positional)? An
    unbatched input's output has its channels first, where a batched one has them second."""
    if len(conv.args) < 2 or not isinstance(conv.args[1], torch.fx.Node):
        return False
    x, weight = example_value(conv.args[0]), example_value(conv.args[1])
    return (
        isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and (x.dim() == weight.dim())
    )


def per_channel(out: torch.Tensor, channel: int = 1) -> tuple[int, ...]:
    """The view that broadcasts a per-channel vector over ``out``, its channels at dim
    ``channel`` (a batched conv's output: 1)."""
    return (-1,) + (1,) * (out.dim() - 1 - channel)


def _is_table_op(node: torch.fx.Node, kinds: tuple[OpKind, ...] | None = None) -> bool:
    call = match(node)
    return isinstance(call, OpCall) and (kinds is None or call.op.kind in kinds)


def _permuted_channel(reader: torch.fx.Node, conv: torch.fx.Node) -> int | None:
    """Where ``reader``, a permute of ``conv``'s output read only by table ops (a norm over
    channels after ``x.permute(0, 2, 3, 1)``: ConvNeXt), puts the channel dim; None where
    ``reader`` is not such a permute."""
    is_permute = (reader.op == "call_method" and reader.target == "permute") or (
        reader.op == "call_function" and reader.target is torch.permute
    )
    if not is_permute or reader.args[0] is not conv or reader.kwargs:
        return None
    dims = reader.args[1:]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    rank = example_value(conv).dim()
    if not all(isinstance(d, int) for d in dims) or sorted(d % rank for d in dims) != list(
        range(rank)
    ):
        return None
    if not reader.users or not all(_is_table_op(user) for user in reader.users):
        return None
    return [d % rank for d in dims].index(1)


def _add_bias_after(
    graph: torch.fx.Graph, value: torch.fx.Node, bias: torch.fx.Node, channel: int
) -> torch.fx.Node:
    """``value + bias`` with the bias viewed to broadcast along dim ``channel``, right after
    ``value``; every reader of ``value`` then reads the sum."""
    readers = list(value.users)
    with graph.inserting_after(value):
        channel_view = graph.call_method("view", (bias, per_channel(example_value(value), channel)))
    with graph.inserting_after(channel_view):
        added = graph.call_function(operator.add, (value, channel_view))
    channel_view.meta["example_value"] = evaluate(channel_view)
    added.meta["example_value"] = evaluate(added)
    for reader in readers:
        reader.replace_input_with(value, added)
    return added


def move_conv_biases(graph: torch.fx.Graph) -> list[str]:
    """Move each convolution's bias into the elementwise ops after it, or after the permutes
    that read it (the module docstring); returns the convolutions changed."""
    moved = []
    for conv in [n for n in graph.nodes if n.op == "call_function" and n.target in CONVOLUTIONS]:
        bias, out = _bias(conv), example_value(conv)
        if not isinstance(bias, torch.fx.Node) or not isinstance(out, torch.Tensor):
            continue
        if not is_batched(conv) or not conv.users:
            continue  # an unbatched output has its channels first: the views below are wrong
        channels = {r: _permuted_channel(r, conv) for r in conv.users}  # (before the rewrite)
        permutes = [r for r, channel in channels.items() if channel is not None]
        elementwise = [r for r in conv.users if _is_table_op(r, (OpKind.ELEMENTWISE,))]
        if len(permutes) + len(elementwise) != len(conv.users):
            continue
        if len(conv.args) > 2:
            conv.args = (*conv.args[:2], None, *conv.args[3:])
        else:
            conv.kwargs = {**conv.kwargs, "bias": None}
        for reader in permutes:
            _add_bias_after(graph, reader, bias, channels[reader])
        if elementwise:
            added = _add_bias_after(graph, conv, bias, 1)
            for reader in permutes:  # the permutes keep reading the convolution itself
                reader.replace_input_with(added, conv)
        moved.append(conv.name)
    return moved
