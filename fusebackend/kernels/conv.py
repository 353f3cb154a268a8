"""A 2-d convolution with its bias, an optional residual add and ReLU in one cuDNN call.

``relu(conv2d(x, W, b) + z)`` is how a ResNet's convolution ends once its BatchNorm is folded
into ``W`` and ``b`` (``passes/conv_activation.py``). Run as a convolution then one
elementwise kernel (the row group that takes the bias, the residual and the ReLU), timm
ResNet-50's convolutions took 374 us a call at batch 1 and 628 at batch 8 (fp16,
channels-last, device time in CUDA-graph replays, H200, 2026-11-30,
``benchmarks/diag/diag_cudnn_fused_conv.py``); as cuDNN's fused convolution + bias (+ add) +
ReLU, 286-304 and 413-487 us: every one of its shapes ran faster fused, and the fused call
took about as long as the convolution alone. cuDNN builds the fused plan per shape on its
first call (3-14 ms each).

``aten.cudnn_convolution_relu`` and ``aten.cudnn_convolution_add_relu`` run on CUDA tensors;
elsewhere (the CPU, fake tensors while passes work out shapes and layouts) the same value is
computed as ``F.conv2d``, ``+ z`` and ``relu``. cuDNN rounds once, after the add and the ReLU,
where eager rounds the convolution's output and the sum: within one ulp of eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["conv2d_relu"]


def conv2d_relu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``relu(F.conv2d(x, weight, bias, stride, padding, dilation, groups) + residual)``
    (no add where ``residual`` is None); the arguments are ``F.conv2d``'s, in its order, so
    passes that read a convolution's operands read this call's the same way."""
    if x.is_cuda and not isinstance(x, FakeTensor):
        if residual is None:
            return torch.ops.aten.cudnn_convolution_relu(
                x, weight, bias, stride, padding, dilation, groups
            )
        return torch.ops.aten.cudnn_convolution_add_relu(
            x, weight, residual, 1.0, bias, stride, padding, dilation, groups
        )
    out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return torch.relu(out if residual is None else out + residual)


# What passes/channels_last.py reads to treat the call as a 2-d convolution (passes import no
# kernels): its first seven arguments are F.conv2d's.
conv2d_relu.conv2d_arguments = True  # type: ignore[attr-defined]
