"""The norms a matmul group takes as its prologue, recognised in the FX graph: LayerNorm,
transformers' RMSNorm and Gemma's offset RMSNorm (``1 + weight``), each spelled as the
models spell it (passes/matmul_groups.py; passes/rotary_epilogue.py for heads' norms)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from fusebackend.passes.fx_util import example_value, static_tensor
from fusebackend.passes.groups import op_call

__all__ = ["Norm", "layer_norm_of", "offset_rms_norm_of", "rms_norm_of"]


@dataclasses.dataclass
class Norm:
    """A norm a matmul group (or a rotary group's heads) computes before its products."""

    rows: torch.fx.Node  # the un-normalised rows the kernel reads
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    eps: float
    kind: str  # "rms" or "layer"
    nodes: list[torch.fx.Node]  # the norm's own nodes (erased when unused)


def layer_norm_of(x: torch.fx.Node) -> Norm | None:
    """``F.layer_norm(h, (K,), weight, bias, eps)`` producing ``x``, with a weight of x's
    dtype and a Python-number eps."""
    call = op_call(x, "layer_norm")
    if call is None:
        return None
    rows, weight, bias = (list(call.operands) + [None, None])[:3]
    eps = call.params.get("eps")
    eps = 1e-5 if eps is None else eps
    if not isinstance(eps, (int, float)) or not isinstance(weight, torch.fx.Node):
        return None
    if not _vector_of(weight, x) or (bias is not None and not _vector_of(bias, x)):
        return None
    if not isinstance(rows, torch.fx.Node) or example_value(rows).dtype != example_value(x).dtype:
        return None
    return Norm(rows, weight, bias, float(eps), "layer", [x])


def rms_norm_of(x: torch.fx.Node) -> Norm | None:
    """transformers' RMSNorm producing ``x``:
    ``weight * (h32 * rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)`` with
    ``h32 = h.to(float32)`` (either factor order; the casts may be no-ops)."""
    product = op_call(x, "mul")
    if product is None or len(product.operands) != 2:
        return None
    for weight, normed in (product.operands, product.operands[::-1]):
        if not isinstance(weight, torch.fx.Node) or not _vector_of(weight, x):
            continue
        nodes = [x]
        cast = op_call(normed, "cast")
        scaled = cast.operands[0] if cast is not None else normed
        if cast is not None:
            nodes.append(normed)
        found = _scaled_rows(scaled)
        if found is None:
            continue
        rows, eps, more = found
        if example_value(rows).dtype != example_value(x).dtype:
            continue
        return Norm(rows, weight, None, eps, "rms", nodes + more)
    return None


def offset_rms_norm_of(x: torch.fx.Node) -> Norm | None:
    """Gemma's RMSNorm producing ``x``:
    ``(h32 * rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(h)``
    (either factor order; the casts may be no-ops)."""
    cast = op_call(x, "cast")
    product = op_call(cast.operands[0] if cast is not None else x, "mul")
    if product is None or len(product.operands) != 2:
        return None
    for scaled, offset in (product.operands, product.operands[::-1]):
        add = op_call(offset, "add")
        if add is None or add.params.get("alpha", 1) != 1 or 1.0 not in add.operands[:2]:
            continue
        weight = next((o for o in add.operands if isinstance(o, torch.fx.Node)), None)
        up = op_call(weight, "cast")
        weight = up.operands[0] if up is not None else weight
        if not isinstance(weight, torch.fx.Node) or not _vector_of(weight, x):
            continue
        found = _scaled_rows(scaled)
        if found is None or example_value(found[0]).dtype != example_value(x).dtype:
            continue
        rows, eps, more = found
        nodes = [x] + ([cast.operands[0]] if cast is not None else []) + [offset] + more
        if up is not None:
            nodes.append(add.operands[1] if add.operands[0] == 1.0 else add.operands[0])
        return Norm(rows, weight, None, eps, "rms_offset", nodes)
    return None


def _scaled_rows(node: Any) -> tuple[torch.fx.Node, float, list[torch.fx.Node]] | None:
    """(h, eps, nodes) for ``h32 * rsqrt(mean(h32 ** 2, -1, keepdim) + eps)``."""
    scale = op_call(node, "mul")
    if scale is None or len(scale.operands) != 2:
        return None
    for h32, inverse in (scale.operands, scale.operands[::-1]):
        rsqrt = op_call(inverse, "rsqrt")
        if rsqrt is None:
            continue
        add = op_call(rsqrt.operands[0], "add")
        if add is None or add.params.get("alpha", 1) != 1:
            continue
        mean, eps = add.operands
        if isinstance(mean, (int, float)):
            mean, eps = eps, mean
        mean_call = op_call(mean, "mean")
        if mean_call is None or not isinstance(eps, (int, float)):
            continue
        if mean_call.params.get("dim") not in (-1, (-1,), [-1]):
            continue
        square = op_call(mean_call.operands[0], "pow")
        if square is None or square.params.get("exponent") != 2 or square.operands[0] is not h32:
            continue
        h32_value = example_value(h32)
        if not isinstance(h32_value, torch.Tensor) or h32_value.dtype != torch.float32:
            continue
        nodes = [node, inverse, rsqrt.operands[0], mean, mean_call.operands[0]]
        up = op_call(h32, "cast")
        rows = up.operands[0] if up is not None else h32
        if up is not None:
            nodes.append(h32)
        return rows, float(eps), nodes
    return None


def _vector_of(node: Any, x: torch.fx.Node) -> bool:
    """Is ``node`` a ``[K]`` tensor of x's dtype and device (a norm's weight or bias)?"""
    if not isinstance(node, torch.fx.Node):
        return False
    v, xv = example_value(node), example_value(x)
    return (
        static_tensor(v)
        and tuple(v.shape) == (xv.shape[-1],)
        and v.dtype == xv.dtype
        and v.device == xv.device
    )


# ---- Safety and the rewrite
