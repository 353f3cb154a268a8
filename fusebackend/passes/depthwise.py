"""Depthwise convolutions with their BatchNorm and activation as one Triton kernel (fused
graph only).

``act(((conv2d(x, W, groups=C) - center) * scale + shift).to(dtype))``, a depthwise
convolution (``groups`` = input channels = output channels, one weight per channel) and the
elementwise ops that ``batch_norm_folding`` leaves after it (a BatchNorm's fp32 per-channel
center, scale and shift, then the cast back; or ``move_conv_biases``' ``+ bias``), then an
activation, becomes one ``kernels.depthwise_conv.depthwise_conv2d`` launch. Each of those
ops is taken only where the one before has no other reader; the value the kernel gives is
the last op taken, which must have the input's dtype.

Why (H200, fp16, channels-last, 2026-11-30, ``benchmarks/diag/diag_depthwise_conv.py``):

- First calls: cuDNN builds a plan for each depthwise shape at its first call, 2.8 s of
  EfficientNet-B0's first call at batch 1 (16 depthwise convolutions, against 0.29 s for its
  64 1 x 1 ones), 2.1 s of MobileNetV3-large's; the Triton kernels compile with the graph's
  others, in parallel, before the first call.
- Per call: over the 42 depthwise shapes of EfficientNet-B0, GhostNet-100 and
  MobileNetV3-large, the kernel with a scale, shift and SiLU in it took 116 us at batch 1
  (its fastest configuration per shape) against cuDNN's 153 for the convolutions alone, and
  286 against 290 us at batch 8, where it is slower on some large shapes with 24 to 120
  channels; each launch also replaces the elementwise kernel after the convolution.

Taken where the input is channels-last (``passes/channels_last.py`` made it so: the kernel
reads the channels contiguous), of static shape, floating, on a device Triton runs on, with
numeric stride, padding and dilation and a window of at most 5 x 5 (the sizes measured;
ConvNeXt's 7 x 7 stays cuDNN's). A bias left on the convolution is the kernel's shift, with
no other per-channel op taken. A cast or activation that would move the value to another
device is not taken. A value that is a part of a concatenation is written into it in place
(``concat_writes.py``: GhostNet's first ghost module of each bottleneck). Where an add reads
the concatenation, ``push_into_concatenations`` runs it on each part, and
``take_residual_adds`` (after it) makes the add on the convolution's part the kernel's
residual: GhostNet's second ghost module adds its block's shortcut that way, so that its
depthwise half, BatchNorm, add and concatenation are one launch. (Until 2026-11-30 these
convolutions stayed cuDNN's, for the row groups to take the add: cuDNN built runtime-compiled
channels-last kernels for them, 1.8 s of GhostNet-100's first call on an H200,
``benchmarks/diag/diag_first_call_phases.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import Tensor

from fusebackend.passes.activations import kernel_activation_name
from fusebackend.passes.conv_activation import conv2d_arguments
from fusebackend.passes.conv_bias import CONVOLUTIONS, is_batched
from fusebackend.passes.fx_util import (
    evaluate,
    example_value,
    known_contiguous,
    single_user,
    static_layout,
    tensor_layout,
)
from fusebackend.passes.graph import is_mutation
from fusebackend.passes.groups import op_call

__all__ = ["ACTIVATIONS", "DEVICE_TYPES", "take_residual_adds", "use_depthwise_convs"]

# Where the kernel runs (tests add the CPU: Triton's interpreter).
DEVICE_TYPES = {"cuda"}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Activations the kernel applies (kernels.ir.ACTIVATIONS' names, as op-table ops); gelu by its
# approximation, hardtanh(0, 6) as relu6 (passes/activations.kernel_activation_name).
ACTIVATIONS = ("relu", "relu6", "silu", "hardswish", "hardsigmoid", "gelu")
# The largest kernel measured (3 x 3 and 5 x 5): wider windows (ConvNeXt's 7 x 7) read the
# input once per tap, untimed against cuDNN.
_MAX_KERNEL = 5
# The per-channel ops after the convolution, in the order they may come.
_AFFINE = (("center", "sub"), ("scale", "mul"), ("shift", "add"))


def _depthwise(conv: torch.fx.Node) -> tuple[Any, ...] | None:
    """``(x, weight, bias, stride, padding, dilation)`` of a depthwise 2-d convolution the
    kernel takes, else None."""
    if conv.op != "call_function" or conv.target not in CONVOLUTIONS or not is_batched(conv):
        return None
    args = conv2d_arguments(conv)
    if args is None:
        return None
    x, weight, bias, stride, padding, dilation, groups = args
    value, w = example_value(x), example_value(weight)
    if not (isinstance(value, Tensor) and isinstance(w, Tensor)) or value.dim() != 4:
        return None
    if not (static_layout(value) and static_layout(w)) or w.dim() != 4:
        return None
    if value.device.type not in DEVICE_TYPES:
        return None
    channels = value.shape[1]
    if groups != channels or tuple(w.shape[:2]) != (channels, 1) or value.dtype not in _DTYPES:
        return None
    if w.dtype != value.dtype or value.stride(1) != 1 or known_contiguous(value):
        return None  # (not channels-last: NCHW, or one channel)
    if max(w.shape[2:]) > _MAX_KERNEL:
        return None
    if bias is not None and not _per_channel(bias, channels, ((channels,),)):
        return None
    return x, weight, bias, stride, padding, dilation


def _per_channel(node: Any, channels: int, shapes: tuple[tuple[int, ...], ...] = ()) -> bool:
    """Is ``node`` a floating tensor of ``channels`` contiguous elements that broadcasts
    along dim 1 of a batched 4-d value (``[C, 1, 1]`` or ``[1, C, 1, 1]``), or has one of
    ``shapes``?"""
    value = example_value(node)
    if not isinstance(node, torch.fx.Node) or not static_layout(value):
        return False
    shape = tuple(value.shape)
    if not value.is_floating_point() or not value.is_contiguous() or value.numel() != channels:
        return False
    return shape in ((channels, 1, 1), (1, channels, 1, 1), *shapes)


def _epilogue(
    conv: torch.fx.Node, channels: int, bias: Any
) -> tuple[dict[str, Any], list[torch.fx.Node]]:
    """The per-channel ops (``_AFFINE``), the cast back and the activation after ``conv``
    that the kernel takes: ``({"center": node, ..., "activation": name}, the nodes taken)``.
    None of the per-channel ops is taken where they do not end in the convolution's dtype;
    with the convolution's ``bias`` (the shift, added first) none is looked for."""
    dtype = example_value(conv).dtype
    found: dict[str, Any] = (
        {"activation": ""} if bias is None else {"activation": "", "shift": bias}
    )
    taken: list[torch.fx.Node] = []
    value = conv
    for part, name in _AFFINE if bias is None else ():
        reader = single_user(value)
        call = op_call(reader, name)
        if call is None or len(call.operands) != 2 or call.params.get("alpha", 1) != 1:
            continue
        first, second = call.operands
        vector = second if first is value else first if name != "sub" else None
        if vector is None or vector is value or not _per_channel(vector, channels):
            continue
        found[part] = vector
        taken.append(reader)
        value = reader
    reader = single_user(value)
    cast = op_call(reader, "cast")
    if (
        taken
        and cast is not None
        and _same_place(reader, conv)
        and example_value(reader).dtype == dtype
    ):
        taken.append(reader)
        value = reader
    if example_value(value).dtype != dtype:
        return {"activation": ""}, []  # (no bias: the convolution's is never in another dtype)
    reader = single_user(value)
    name = kernel_activation_name(op_call(reader, *ACTIVATIONS, "hardtanh"))
    if name and example_value(reader).dtype == dtype and _same_place(reader, conv):
        found["activation"] = name
        taken.append(reader)
    return found, taken


def _same_place(node: torch.fx.Node, conv: torch.fx.Node) -> bool:
    """Does ``node``'s value keep the convolution's device (a cast may move it)?"""
    return example_value(node).device == example_value(conv).device


def use_depthwise_convs(graph: torch.fx.Graph, kernel: Callable[..., Tensor]) -> list[str]:
    """Rewrite each depthwise convolution the kernel takes, with the ops after it that it
    takes, as one call of ``kernel`` (``kernels.depthwise_conv.depthwise_conv2d``: passes
    import no kernels); returns each rewrite as ``"conv (+ op, ...)"``."""
    made = []
    for conv in list(graph.nodes):
        args = _depthwise(conv)
        if args is None:
            continue
        x, weight, bias, stride, padding, dilation = args
        found, taken = _epilogue(conv, example_value(x).shape[1], bias)
        last = taken[-1] if taken else conv
        operands = (x, weight, stride, padding, dilation, found.get("center"),
                    found.get("scale"), found.get("shift"), found["activation"], None)  # fmt: skip
        with graph.inserting_after(last):
            node = graph.call_function(kernel, operands)
        node.meta["example_value"] = evaluate(node)
        if tensor_layout(example_value(node)) != tensor_layout(example_value(last)):
            graph.erase_node(node)  # (the kernel gives the value another shape or place)
            continue
        last.replace_all_uses_with(node)
        for dead in reversed([conv, *taken]):
            graph.erase_node(dead)
        made.append(conv.name + (f" (+ {', '.join(n.name for n in taken)})" if taken else ""))
    return made


def take_residual_adds(graph: torch.fx.Graph, kernel: Callable[..., Tensor]) -> list[str]:
    """Make each add that is the only reader of a ``kernel`` call (``use_depthwise_convs``'),
    adding a tensor of the value's shape, dtype and device, that call's residual (its
    ``residual_position``), where the sum keeps the value's layout; the call moves to the
    add's place, where nothing between writes in place. Returns each as ``"call (+ add)"``."""
    position = kernel.residual_position  # type: ignore[attr-defined]
    made = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not kernel:
            continue
        if len(node.args) != position + 1 or node.args[position] is not None:
            continue  # (given an ``out`` already, or a residual)
        add = single_user(node)
        call = op_call(add, "add")
        if call is None or len(call.operands) != 2 or call.params.get("alpha", 1) != 1:
            continue
        first, second = call.operands
        other = second if first is node else first if second is node else None
        if not isinstance(other, torch.fx.Node) or other is node:
            continue
        value, residual = example_value(node), example_value(other)
        if not (isinstance(residual, Tensor) and static_layout(residual)):
            continue
        if tensor_layout(example_value(add)) != tensor_layout(value):
            continue
        if _another_tensor(residual, value):
            continue
        if _writes_between(node, add):
            continue
        add.prepend(node)  # (the residual is defined before the add, perhaps after the call)
        node.args = (*node.args[:position], other)
        add.replace_all_uses_with(node)
        graph.erase_node(add)
        made.append(f"{node.name} (+ {add.name})")
    return made


def _another_tensor(residual: Tensor, value: Tensor) -> bool:
    """Is ``residual`` of another shape, dtype or device than ``value``? (Its strides may
    differ: the kernel reads through them.)"""
    return (tuple(residual.shape), residual.dtype, residual.device) != (
        tuple(value.shape), value.dtype, value.device)  # fmt: skip


def _writes_between(start: torch.fx.Node, end: torch.fx.Node) -> bool:
    """Does a node after ``start`` and before ``end`` write a tensor in place?"""
    node = start.next
    while node is not end:
        if is_mutation(node):
            return True
        node = node.next
    return False
