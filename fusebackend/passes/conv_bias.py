"""A convolution's bias moved into the elementwise ops after it (fused graph only).

PyTorch adds a convolution's bias in a kernel of its own after cuDNN's (measured on an H200,
timm ResNet-50 fp16 with its BatchNorms folded: 53 broadcast-add kernels per call, one per
convolution). Where every reader of the convolution is an elementwise op of the table, the
convolution runs without its bias and ``+ bias`` (viewed per channel) comes after it as an
ordinary elementwise op, which then fuses with the activation, residual add or gate that
follows: conv + bias + ReLU becomes conv + one kernel. The value is the same: PyTorch rounds
the convolution's output to its dtype before adding the bias too.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fusebackend.passes.fx_util import example_value
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


def per_channel(out: torch.Tensor) -> tuple[int, ...]:
    """The view that broadcasts a per-channel vector over a batched conv's output."""
    return (-1,) + (1,) * (out.dim() - 2)


def _feeds_elementwise_only(conv: torch.fx.Node) -> bool:
    for reader in conv.users:
        call = match(reader)
        if not isinstance(call, OpCall) or call.op.kind != OpKind.ELEMENTWISE:
            return False
    return bool(conv.users)


def move_conv_biases(graph: torch.fx.Graph) -> list[str]:
    """Move each convolution's bias into the elementwise op after it (the module docstring);
    returns the convolutions changed."""
    moved = []
    for conv in [n for n in graph.nodes if n.op == "call_function" and n.target in CONVOLUTIONS]:
        bias, out = _bias(conv), example_value(conv)
        if not isinstance(bias, torch.fx.Node) or not isinstance(out, torch.Tensor):
            continue
        if not is_batched(conv):
            continue  # an unbatched output has its channels first: the view below is wrong
        if not _feeds_elementwise_only(conv):
            continue
        readers = list(conv.users)
        with graph.inserting_after(conv):
            channel_view = graph.call_method("view", (bias, per_channel(out)))
        with graph.inserting_after(channel_view):
            added = graph.call_function(operator.add, (conv, channel_view))
        with out.fake_mode:
            view = example_value(bias).view(per_channel(out))
            channel_view.meta["example_value"] = view
            added.meta["example_value"] = out + view
        if len(conv.args) > 2:
            conv.args = (*conv.args[:2], None, *conv.args[3:])
        else:
            conv.kwargs = {**conv.kwargs, "bias": None}
        for reader in readers:
            reader.replace_input_with(conv, added)
        moved.append(conv.name)
    return moved
