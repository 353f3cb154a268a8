"""2-d max and average pooling of channels-last tensors as one kernel (fused graph only).

``F.max_pool2d`` (without indices) and ``F.avg_pool2d`` of a 4-d floating tensor whose
example is channels-last (``passes/channels_last.py`` made it so, or the model did), of
static shape, with plain-number arguments, become ``kernels.pool2d.pool2d`` launches: aten's
NHWC pooling kernels run many times slower than reading their input (the kernel module's
docstring has the measurements). Contiguous (NCHW) tensors keep aten's kernels, which read
along their contiguous rows. The rewrite is kept only where the kernel gives the value the
same shape, dtype and layout as aten's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusebackend.passes.fx_util import (
    bound_arguments,
    evaluate,
    example_value,
    known_channels_last,
    known_contiguous,
    static_layout,
    tensor_layout,
)

__all__ = ["use_pool_kernels"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The most taps a window rewritten may have: ``kernels.pool2d.MAX_TAPS`` (passes import no
# kernels), past which the kernel's unrolled compile takes seconds to minutes.
MAX_TAPS = 25


def _max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                return_indices=False): ...  # fmt: skip


def _avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False,
                count_include_pad=True, divisor_override=None): ...  # fmt: skip


# The pooling calls Dynamo's graphs hold (nn.MaxPool2d and nn.AvgPool2d inlined to them), and
# their signatures (F.avg_pool2d is aten's builtin ``torch._C._nn.avg_pool2d``, F.max_pool2d a
# Python dispatcher over ``torch.max_pool2d``).
_POOLS = {
    F.max_pool2d: ("max", inspect.signature(_max_pool2d)),
    torch.max_pool2d: ("max", inspect.signature(_max_pool2d)),
    F.avg_pool2d: ("avg", inspect.signature(_avg_pool2d)),
}


def _pair(value: Any) -> tuple[int, int] | None:
    """``value`` as two plain ints (an int stands for both), else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (tuple, list)) and len(value) in (1, 2):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return (value[0], value[-1])
    return None


def _pool_arguments(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """``(x, kind, kernel_size, stride, padding, dilation, ceil_mode, count_include_pad,
    divisor_override)`` of a pooling call the kernel takes, else None."""
    if node.op != "call_function" or node.target not in _POOLS:
        return None
    kind, signature = _POOLS[node.target]
    params = bound_arguments(node, signature)
    if params is None or params.get("return_indices"):
        return None
    kernel_size = _pair(params["kernel_size"])
    stride = kernel_size if params["stride"] in (None, [], ()) else _pair(params["stride"])
    padding, dilation = _pair(params["padding"]), _pair(params.get("dilation", 1))
    ceil_mode = params["ceil_mode"]
    count_include_pad = params.get("count_include_pad", True)
    divisor = params.get("divisor_override")
    if None in (kernel_size, stride, padding, dilation):
        return None
    if not all(isinstance(b, bool) for b in (ceil_mode, count_include_pad)):
        return None
    if divisor is not None and (not isinstance(divisor, int) or divisor == 0):
        return None  # (aten raises for 0: left to it)
    if min(*kernel_size, *stride, *dilation) < 1 or min(padding) < 0:
        return None  # (aten's errors)
    if any(2 * p > k for p, k in zip(padding, kernel_size, strict=True)):
        return None  # (aten's error: padding at most half the window)
    if kernel_size[0] * kernel_size[1] > MAX_TAPS:
        return None  # (the kernel's compile grows with its unrolled taps: kernels/pool2d.py)
    return (params["input"], kind, kernel_size, stride, padding, dilation, ceil_mode,
            count_include_pad, divisor)  # fmt: skip


def use_pool_kernels(graph: torch.fx.Graph, pool2d: Callable[..., Any]) -> list[str]:
    """Rewrite each 2-d max or average pooling of a channels-last tensor as a ``pool2d``
    call (the module docstring); returns the nodes rewritten."""
    made = []
    for node in list(graph.nodes):
        found = _pool_arguments(node)
        if found is None or not isinstance(found[0], torch.fx.Node):
            continue
        value, before = example_value(found[0]), example_value(node)
        if not isinstance(value, torch.Tensor) or not isinstance(before, torch.Tensor):
            continue
        if value.dim() != 4 or value.dtype not in _DTYPES or not static_layout(value):
            continue
        if not known_channels_last(value) or known_contiguous(value):
            continue  # NCHW, or a layout both ways (one pixel, one channel): aten's
        with graph.inserting_after(node):
            call = graph.call_function(pool2d, found)
        call.meta["example_value"] = evaluate(call)
        if tensor_layout(example_value(call)) != tensor_layout(before):
            graph.erase_node(call)  # (the kernel gives the value another shape or layout)
            continue
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        made.append(node.name)
    return made
