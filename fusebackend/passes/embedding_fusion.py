"""Embedding lookups: how a lookup is spelled, and whether one can be gathered in a kernel.

A lookup (``F.embedding`` / ``torch.embedding``) seeds a group or joins one as an operand
(passes/partition.py); the kernel gathers its table rows on the device
(kernels/codegen.py), so it needs a 2-D floating table and int32/int64 indices on the
table's device, and no ``max_norm`` (which renormalises the weight in place).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusebackend.passes.fx_util import example_value
from fusebackend.passes.ops import FLOATING

__all__ = ["check_lookup", "embedding_args", "is_embedding"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def is_embedding(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (F.embedding, torch.embedding)


def embedding_args(node: torch.fx.Node) -> dict[str, Any]:
    """Normalise F.embedding(input, weight, ...) and torch.embedding(weight, input, ...)."""
    args, kwargs = node.args, node.kwargs
    if node.target is torch.embedding:
        names = ("weight", "input", "padding_idx", "scale_grad_by_freq", "sparse")
        defaults: dict[str, Any] = {"padding_idx": -1, "scale_grad_by_freq": False}
    else:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type",
                 "scale_grad_by_freq", "sparse")  # fmt: skip
        defaults = {"padding_idx": None, "max_norm": None}
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def check_lookup(node: torch.fx.Node) -> str | None:
    """None when the lookup can be gathered in a kernel, else why not."""
    args = embedding_args(node)
    if args.get("max_norm") is not None:
        return "max_norm mutates the weight (renormalises rows in place)"
    weight, index = args.get("weight"), args.get("input")
    if not isinstance(weight, torch.fx.Node) or not isinstance(index, torch.fx.Node):
        return "weight or indices are not graph values"
    w, i, out = example_value(weight), example_value(index), example_value(node)
    if not all(isinstance(t, torch.Tensor) for t in (w, i, out)):
        return "no example value recorded for the weight, indices or result"
    if w.dim() != 2:
        return f"weight must be 2-D, got shape {tuple(w.shape)}"
    if w.dtype not in FLOATING:
        return f"weight dtype {w.dtype} is not floating point"
    if i.dtype not in _INDEX_DTYPES:
        return f"indices dtype {i.dtype} is not int32/int64"
    if w.device != i.device:
        return f"indices on {i.device} but weight on {w.device}"
    if w.device.type not in ("cuda", "cpu"):
        return f"device {w.device} is not supported"
    return None
