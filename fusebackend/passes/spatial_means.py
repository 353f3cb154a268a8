"""Means over H x W of channels-last tensors as one kernel (fused graph only).

``x.mean((2, 3), keepdim=...)`` (squeeze-excite), ``torch.mean(x, (-2, -1))`` and
``F.adaptive_avg_pool2d(x, 1)`` (a classifier head's global pool) of a 4-d floating tensor
whose example is channels-last (``passes/channels_last.py`` made it so, or the model did)
become ``kernels.spatial_mean.spatial_mean`` launches: aten reduces such tensors several
times slower than it reads them (the kernel module's docstring has the measurements).
Contiguous (NCHW) tensors keep aten's reduction, which runs along their contiguous rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._prims_common import make_contiguous_strides_for

from fusebackend.passes.fx_util import (
    example_value,
    known_channels_last,
    known_contiguous,
    known_equal,
)

__all__ = ["use_spatial_means"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # (the kernel sums in fp32)


def _spatial_dims(dims: Any) -> bool:
    if isinstance(dims, int) or not isinstance(dims, (tuple, list)) or len(dims) != 2:
        return False
    return all(isinstance(d, int) for d in dims) and sorted(d % 4 for d in dims) == [2, 3]


def _mean_of(node: torch.fx.Node) -> tuple[Any, bool] | None:
    """(input, keepdim) where ``node`` is a mean over dims 2 and 3 or a global average pool."""
    if (node.op == "call_method" and node.target == "mean") or (
        node.op == "call_function" and node.target is torch.mean
    ):
        args, kwargs = node.args, dict(node.kwargs)
        dims = args[1] if len(args) > 1 else kwargs.pop("dim", None)
        keepdim = args[2] if len(args) > 2 else kwargs.pop("keepdim", False)
        x = args[0] if args else kwargs.pop("input", None)
        if len(args) > 3 or kwargs or not _spatial_dims(dims) or not isinstance(keepdim, bool):
            return None  # (a dtype= argument: eager's dtype rules, left to aten)
        return x, keepdim
    if node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
        x = node.args[0] if node.args else node.kwargs.get("input")
        size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
        if size in (1, (1, 1), [1, 1]) and len(node.args) + len(node.kwargs) == 2:
            return x, True
    return None


def use_spatial_means(graph: torch.fx.Graph, spatial_mean: Callable[..., Any]) -> list[str]:
    """Rewrite each mean over H x W of a channels-last tensor as a ``spatial_mean`` call
    (the module docstring); returns the nodes rewritten."""
    made = []
    for node in graph.nodes:
        found = _mean_of(node)
        if found is None:
            continue
        x, keepdim = found
        if not isinstance(x, torch.fx.Node):
            continue
        value, out = example_value(x), example_value(node)
        if not isinstance(value, torch.Tensor) or not isinstance(out, torch.Tensor):
            continue
        if value.dim() != 4 or value.dtype not in _DTYPES or out.dtype != value.dtype:
            continue
        if not known_channels_last(value) or known_contiguous(value):
            continue  # NCHW, or a layout both ways (one pixel, one channel): aten's
        contiguous = all(map(known_equal, out.stride(), make_contiguous_strides_for(out.shape)))
        channels_last = keepdim and not contiguous
        node.op, node.target = "call_function", spatial_mean
        node.args, node.kwargs = (x, keepdim, channels_last), {}
        made.append(node.name)
    return made
