"""A convolution ending in ReLU, with its bias and a residual add, as one cuDNN call (fused
graph only).

``relu(conv2d(x, W, b))`` and ``relu(conv2d(x, W, b) + z)`` become
``kernels.conv.conv2d_relu(x, W, b, stride, padding, dilation, groups, z)``: cuDNN's fused
convolution + bias (+ add) + ReLU, which ran about as fast as the convolution alone at every
convolution shape of timm's ResNet-50, where a convolution and the elementwise kernel after
it took 1.3-1.5x as long (``kernels/conv.py`` has the figures). Its BatchNorms must be folded
into the weights for that: ``batch_norm_folding`` asks ``fuses_after(conv, bn)`` and folds a
half-precision BatchNorm into the weights where it does (elsewhere half precision keeps its
exact fp32 scale and shift after the convolution, see there).

Taken where cuDNN's fused kernels were measured: a batched 2-d convolution on CUDA in fp16
(bf16 too: its results are GPU-tested, its speed was not timed; fp32, whose convolutions run
TF32, was neither), one group (grouped and depthwise convolutions keep their elementwise
group), numeric stride, padding and dilation (not ``padding="same"``), its output read only
by the ReLU or by an add of one other tensor of its shape and dtype (``alpha`` 1) read only
by the ReLU, and the ReLU's output no part of a concatenation (a group writes such a part in
place).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor

from fusebackend.passes.conv_bias import CONVOLUTIONS, is_batched
from fusebackend.passes.fx_util import evaluate, example_value
from fusebackend.passes.groups import op_call

__all__ = ["DEVICE_TYPES", "DTYPES", "concatenated", "conv2d_arguments", "fuse_conv_activations",
           "fuses_after"]  # fmt: skip

# Where cuDNN's fused call was measured faster (tests add the CPU and fp32, where the call
# computes the same value with aten's ops).
DEVICE_TYPES = {"cuda"}
DTYPES = {torch.float16, torch.bfloat16}
_DEFAULTS = (1, 0, 1, 1)  # stride, padding, dilation, groups


def conv2d_arguments(conv: torch.fx.Node) -> tuple | None:
    """``(x, weight, bias, stride, padding, dilation, groups)`` of a positional 2-d
    convolution, pairs for the three sizes; None where any is not a plain number."""
    if conv.kwargs or len(conv.args) < 2:
        return None
    given = conv.args[3:7]
    sizes = [*given, *_DEFAULTS[len(given) :]]
    pairs = []
    for size in sizes[:3]:
        pair = (size, size) if isinstance(size, int) else size
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            return None
        if not all(type(v) is int for v in pair):
            return None
        pairs.append(tuple(pair))
    if type(sizes[3]) is not int:
        return None
    bias = conv.args[2] if len(conv.args) > 2 else None
    return (conv.args[0], conv.args[1], bias, *pairs, sizes[3])


def _cudnn_takes(conv: torch.fx.Node) -> bool:
    """Is ``conv`` a convolution cuDNN's fused call was measured on (the module docstring)?"""
    if conv.op != "call_function" or conv.target not in CONVOLUTIONS or not is_batched(conv):
        return False
    args = conv2d_arguments(conv)
    out, weight = example_value(conv), example_value(conv.args[1])
    if args is None or args[-1] != 1 or not isinstance(out, Tensor) or weight.dim() != 4:
        return False
    if out.device.type == "cuda" and not (
        torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
    ):
        return False
    return out.device.type in DEVICE_TYPES and out.dtype in DTYPES


def _convolution_of(node: object) -> torch.fx.Node | None:
    """The convolution whose output ``node`` is, directly or through a BatchNorm, or None."""
    if isinstance(node, torch.fx.Node) and node.target is F.batch_norm and node.args:
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "call_function":
        return node if node.target in CONVOLUTIONS else None
    return None


def _comes_before(first: torch.fx.Node, second: torch.fx.Node) -> bool:
    node = second._prev
    while node is not second and node.op != "root":
        if node is first:
            return True
        node = node._prev
    return False


def _relu_after(value: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node | None] | None:
    """(the ReLU, the residual or None) where ``value`` is read only by a ReLU, or only by
    an add of one other tensor like it read only by a ReLU; else None. Where the other
    tensor is a convolution's output too (a projected shortcut), the earlier convolution
    takes the add, as ``fuse_conv_activations`` meets them in graph order."""
    if len(value.users) != 1:
        return None
    (reader,) = value.users
    if op_call(reader, "relu") is not None:
        return reader, None
    add = op_call(reader, "add")
    if add is None or add.params.get("alpha", 1) != 1 or len(reader.users) != 1:
        return None
    others = [o for o in add.operands if o is not value]
    (relu,) = reader.users
    if len(add.operands) != 2 or len(others) != 1 or op_call(relu, "relu") is None:
        return None
    residual, out = example_value(others[0]), example_value(value)
    if not (isinstance(others[0], torch.fx.Node) and isinstance(residual, Tensor)):
        return None
    if residual.shape != out.shape or residual.dtype != out.dtype:
        return None
    mine, theirs = _convolution_of(value), _convolution_of(others[0])
    if mine is not None and theirs is not None and _comes_before(theirs, mine):
        return None
    return relu, others[0]


_CONCATENATIONS = {torch.cat, torch.concat, torch.concatenate}


def concatenated(node: torch.fx.Node) -> bool:
    """Is ``node`` a part of a concatenation? Its group then writes it into the result
    (``concat_writes.py``: GhostNet's 32 a call), where cuDNN's call would leave a copy."""
    return any(user.op == "call_function" and user.target in _CONCATENATIONS for user in node.users)


def fuses_after(conv: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Would ``conv`` run as one fused call with what reads ``value`` (``conv`` itself, or
    the BatchNorm after it that folds into its weights)?"""
    if not _cudnn_takes(conv):
        return False
    site = _relu_after(value)
    return site is not None and not concatenated(site[0])


def fuse_conv_activations(graph: torch.fx.Graph, conv2d_relu: Callable[..., Tensor]) -> list[str]:
    """Rewrite each convolution + bias (+ residual add) + ReLU of ``graph`` that cuDNN takes
    as one call of ``conv2d_relu`` (``kernels.conv.conv2d_relu``: passes import no kernels);
    returns the convolutions rewritten."""
    fused = []
    for conv in list(graph.nodes):
        if not fuses_after(conv, conv):
            continue
        relu, residual = _relu_after(conv)  # type: ignore[misc]
        add = None if residual is None else next(iter(conv.users))
        with graph.inserting_before(relu):
            node = graph.call_function(conv2d_relu, (*conv2d_arguments(conv), residual))  # type: ignore[misc]
        node.meta["example_value"] = evaluate(node)
        relu.replace_all_uses_with(node)
        for dead in (relu, add, conv):
            if dead is not None:
                graph.erase_node(dead)
        fused.append(conv.name)
    return fused
