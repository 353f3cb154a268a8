"""GroupNorms with the activation after them as one kernel (fused graph only).

``F.group_norm(x, groups, weight, bias, eps)`` (``nn.GroupNorm``, timm's ``GroupNormAct``,
diffusers' ResNet blocks), and the activation that is its value's only reader (ReLU, ReLU6,
SiLU, GELU, hardswish, hardsigmoid, in the norm's dtype and on its device), become one
``kernels.group_norm.group_norm`` launch: aten runs a GroupNorm as three kernels and the
activation as a fourth (the kernel module's docstring). No row group took them: a GroupNorm
reduces over a channel group and every position, not along one dim, and its per-channel
scale is not a broadcast of the ``[N x groups, elements]`` rows.

Taken where the input's example has static sizes and strides, a floating dtype the kernel
computes (fp16, bf16, fp32), a layout it reads in place (``group_norm.takes``: the positions
one strided dim, NCHW or channels-last), on a device Triton runs on, with a plain number of
groups and eps; the weight and bias are None or hold one contiguous element per channel.

The value is written in the traced layout, except where the input is channels-last, the
traced value is not (aten's CUDA GroupNorm makes its input contiguous and gives an NCHW
value) and only convolutions read it (directly, or through the channels-last copy that
``passes/channels_last.py`` put before them, which is then dropped): then it stays
channels-last, as the convolutions after it want it (``_input_layout_for_convolutions``;
ResNet-V2's norm + ReLU before each convolution, in a graph made channels-last). Written in
the traced layout, a ResNet-V2-50x1-BiT call at batch 8 copied all 49 norms' values back to
channels-last, 655 us of node time (H200, 2026-12-01, ``diag_node_times.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor

from fusebackend.passes.activations import kernel_activation_name
from fusebackend.passes.channels_last import is_channels_last_copy, is_conv2d
from fusebackend.passes.conv_bias import is_batched
from fusebackend.passes.depthwise import ACTIVATIONS
from fusebackend.passes.fx_util import (
    bound_arguments,
    evaluate,
    example_value,
    single_user,
    static_layout,
    tensor_layout,
)
from fusebackend.passes.groups import op_call

__all__ = ["DEVICE_TYPES", "use_group_norms"]

# Where the kernel runs (tests add the CPU: Triton's interpreter).
DEVICE_TYPES = {"cuda"}
_TARGETS = (F.group_norm, torch.group_norm)
_SIGNATURE = inspect.signature(lambda input, num_groups, weight=None, bias=None, eps=1e-5,
                               cudnn_enabled=True: None)  # fmt: skip


def _arguments(node: torch.fx.Node, takes: Callable[[Tensor], bool]) -> tuple | None:
    """``(x, groups, weight, bias, eps)`` of a GroupNorm the kernel takes, else None."""
    if node.op != "call_function" or node.target not in _TARGETS:
        return None
    bound = bound_arguments(node, _SIGNATURE)
    if bound is None:
        return None
    x, groups, weight, bias, eps = (bound[k] for k in ("input", "num_groups", "weight", "bias",
                                                       "eps"))  # fmt: skip
    value = example_value(x)
    if not isinstance(x, torch.fx.Node) or not static_layout(value) or value.dim() < 2:
        return None
    if value.device.type not in DEVICE_TYPES or not takes(value):
        return None
    if type(groups) is not int or groups < 1 or value.shape[1] % groups:
        return None
    if type(eps) not in (int, float):
        return None
    if not all(v is None or _per_channel(v, value.shape[1]) for v in (weight, bias)):
        return None
    return x, groups, weight, bias, float(eps)


def _per_channel(node: Any, channels: int) -> bool:
    value = example_value(node)
    return (
        isinstance(node, torch.fx.Node)
        and static_layout(value)
        and value.is_floating_point()
        and value.is_contiguous()
        and value.numel() == channels
    )


def _activation(norm: torch.fx.Node) -> tuple[str, torch.fx.Node | None]:
    """The activation that is the norm's only reader, in its dtype and on its device:
    ``(kernels' name, node)``, or ``("", None)``."""
    reader = single_user(norm)
    call = op_call(reader, *ACTIVATIONS, "hardtanh")
    name = kernel_activation_name(call)
    if not name or call.params.get("inplace") or list(call.operands[:1]) != [norm]:
        return "", None
    value, result = example_value(norm), example_value(reader)
    if tensor_layout(result) != tensor_layout(value):
        return "", None
    return name, reader


def _input_layout_for_convolutions(
    last: torch.fx.Node, x: Tensor, traced: Tensor
) -> tuple[int, ...] | None:
    """``x``'s strides, for the kernel to write its value in the input's layout rather than
    the traced one, where ``x`` is channels-last and the traced value is not (aten's CUDA
    GroupNorm makes its input contiguous first), and every reader of the value is a batched
    convolution taking it as its input whose value keeps its layout when it gets the
    channels-last one (with a channels-last weight, ``passes/channels_last.py``'s, cuDNN
    gives a channels-last output either way). The kernel then writes channels-last, and the
    convolution reads it as it is, without a transpose; else None (the traced layout)."""
    if x.dim() != 4 or x.stride() == traced.stride() or x.stride(1) != 1 or x.is_contiguous():
        return None
    if not last.users:
        return None
    written = traced.as_strided(traced.shape, x.stride())
    for reader in last.users:
        if is_channels_last_copy(reader):
            continue  # (the convolutions after it: their input is channels-last either way)
        conv = reader.op == "call_function" and is_conv2d(reader.target)
        if not conv or not is_batched(reader) or reader.args[0] is not last:
            return None
        if last in reader.args[1:] or last in reader.kwargs.values():
            return None
        value = evaluate(reader, lambda n: written if n is last else example_value(n))
        if tensor_layout(value) != tensor_layout(example_value(reader)):
            return None
    return x.stride()


def use_group_norms(graph: torch.fx.Graph, kernel: Callable[..., Tensor]) -> list[str]:
    """Rewrite each GroupNorm the kernel takes, with its activation where it has one, as one
    call of ``kernel`` (``kernels.group_norm.group_norm``: passes import no kernels, and ask
    it which layouts it reads and writes, ``kernel.takes``), writing the traced value's
    layout; returns each as ``"norm (+ activation)"``."""
    made = []
    for norm in list(graph.nodes):
        args = _arguments(norm, kernel.takes)  # type: ignore[attr-defined]
        if args is None:
            continue
        name, activation = _activation(norm)
        last = activation or norm
        traced = example_value(last)
        strides = _input_layout_for_convolutions(last, example_value(args[0]), traced)
        with graph.inserting_after(last):
            node = graph.call_function(kernel, (*args, name, strides or traced.stride()))
        node.meta["example_value"] = evaluate(node)
        wanted = traced if strides is None else traced.as_strided(traced.shape, strides)
        if tensor_layout(example_value(node)) != tensor_layout(wanted) or not kernel.takes(wanted):
            graph.erase_node(node)  # (a value of another shape or place; an output layout
            continue  # the kernel does not write)
        last.replace_all_uses_with(node)
        if strides is not None:  # written channels-last: a channels-last copy would copy
            for copy in [u for u in node.users if is_channels_last_copy(u)]:  # nothing
                copy.replace_all_uses_with(node)
                graph.erase_node(copy)
        for dead in (last, norm) if activation is not None else (norm,):
            graph.erase_node(dead)
        made.append(norm.name + (f" (+ {activation.name})" if activation is not None else ""))
    return made
