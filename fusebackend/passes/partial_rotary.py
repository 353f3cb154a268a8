"""Partial rotary embeddings as one row group over the whole head (fused graph).

GPT-NeoX (Pythia), Phi, StableLM, GPT-J and CodeGen rotate only the first ``r`` columns of
each head and pass the rest through::

    x_rot, x_pass = x[..., :r], x[..., r:]
    x_rot = x_rot * cos + rotate(x_rot) * sin          (rotate_half, or GPT-J's interleaving)
    out = torch.cat([x_rot, x_pass], dim=-1)

The rotation's group runs over rows ``r`` wide and the ``cat`` copies both parts again: a
kernel per projection a layer (4 of a 2-layer GPT-NeoX's 24 a call, H200, 2026-11-29). Here
the pattern becomes ``x * cos' + rotate(x, width=r) * sin'`` over the whole head, where
``cos'`` is ``cos`` padded with ones to the head's width and ``sin'`` with zeros, and the
rotation (``kernels/ir.Rotate`` with ``width``) leaves zeros past the first ``r`` columns:
each pass-through column is ``x * 1 + 0 * 0``, that is ``x``, with the dtype eager's
``cat`` gives it. One row group computes the whole result; the pads run once per ``cos``
and ``sin`` (every layer reads the same ones), and fold into derived constants where those
are built from the parameters and positions alone (``passes/parameter_work.py``, after
this pass).

Rewritten only where every node of the pattern has no reader outside it, ``r`` is a static
size below the head's width, and ``cos`` and ``sin`` broadcast to ``x_rot`` along their
last dim of ``r`` (the signs and the rotation's form are kept as matched).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusebackend.passes.concatenation import CAT_FUNCTIONS, cat_arguments
from fusebackend.passes.fx_util import call_evaluated, example_value
from fusebackend.passes.groups import op_call, operand_orders
from fusebackend.passes.rotation import Rotation, last_dim_slice, match_rotation, rotate

__all__ = ["widen_partial_rotary"]


def widen_partial_rotary(graph: torch.fx.Graph) -> list[str]:
    """Rewrite each partial rotary embedding's ``cat`` as one computation over the whole
    head (module docstring); returns the names of the concatenations replaced."""
    pads: dict[tuple[torch.fx.Node, int, float], torch.fx.Node] = {}
    replaced = []
    for cat in [n for n in graph.nodes if n.op == "call_function" and n.target in CAT_FUNCTIONS]:
        found = _match(cat)
        if found is None:
            continue
        source, rotation, cos, sin, dead = found
        width = example_value(source).shape[-1]
        with graph.inserting_before(cat):
            cos_w = _padded(graph, pads, cos, width, 1.0)
            sin_w = _padded(graph, pads, sin, width, 0.0)
            params = {**rotation.params, "width": example_value(rotation.source).shape[-1]}
            rotated = graph.call_function(rotate, (source,), params)
            rotated.meta["example_value"] = _contiguous_like(example_value(source))
            first = call_evaluated(graph, operator.mul, (source, cos_w))
            second = call_evaluated(graph, operator.mul, (rotated, sin_w))
            out = call_evaluated(graph, operator.add, (first, second))
        cat.replace_all_uses_with(out)
        replaced.append(cat.name)
        for node in [cat, *dead]:  # readers first
            if not node.users:
                graph.erase_node(node)
    if replaced:
        graph.lint()
    return replaced


def _contiguous_like(value: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``value``'s shape and dtype, in its fake mode: what ``rotate``
    returns (a ``cat``), made without running the reference on fake tensors (each of a
    22-layer GPT-J's 44 rotations took 4 ms that way: 0.17 s of the compile, CPU)."""
    mode = getattr(value, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty(value.shape, dtype=value.dtype, device=value.device)


def _padded(
    graph: torch.fx.Graph,
    pads: dict[tuple[torch.fx.Node, int, float], torch.fx.Node],
    table: torch.fx.Node,
    width: int,
    value: float,
) -> torch.fx.Node:
    """``table`` padded with ``value`` along its last dim to ``width``, once per table."""
    key = (table, width, value)
    if key not in pads:
        with graph.inserting_after(table):
            extra = width - example_value(table).shape[-1]
            pads[key] = call_evaluated(graph, F.pad, (table, (0, extra)), {"value": value})
    return pads[key]


def _match(cat: torch.fx.Node) -> tuple[Any, ...] | None:
    """(x, the rotation, cos, sin, the pattern's nodes from the sum down) of ``cat([x_rot *
    cos + rotate(x_rot) * sin, x[..., r:]], -1)`` with ``x_rot = x[..., :r]``, else None."""
    tensors, dim = cat_arguments(cat)
    value = example_value(cat)
    if not isinstance(value, torch.Tensor) or not isinstance(tensors, list | tuple):
        return None
    if len(tensors) != 2 or dim not in (-1, value.dim() - 1):
        return None
    embedded, passed = tensors
    kept = last_dim_slice(passed, value.dim()) if isinstance(passed, torch.fx.Node) else None
    add = op_call(embedded, "add")
    if kept is None or add is None or add.params.get("alpha", 1) != 1:
        return None
    source, r, stop = kept
    if stop != example_value(source).shape[-1] or not 0 < r < stop:
        return None
    for product, other in operand_orders(add):
        terms = _rotary_terms(product, other, source, r)
        if terms is not None:
            rotation, cos, sin, nodes = terms
            pattern = {cat, embedded, passed, *nodes}
            if all(set(n.users) <= pattern for n in pattern - {cat}):
                return source, rotation, cos, sin, [embedded, *nodes, passed]
    return None


def _rotary_terms(
    product: Any, other: Any, source: torch.fx.Node, r: int
) -> tuple[Rotation, torch.fx.Node, torch.fx.Node, list[torch.fx.Node]] | None:
    """(rotation, cos, sin, nodes) where ``product`` is ``x_rot * cos`` and ``other`` is
    ``rotate(x_rot) * sin``, ``x_rot`` the first ``r`` columns of ``source``."""
    for x_rot, cos in operand_orders(op_call(product, "mul")):
        sliced = last_dim_slice(x_rot, example_value(source).dim())
        if sliced is None or sliced[:3] != (source, 0, r):
            continue
        for rotated, sin in operand_orders(op_call(other, "mul")):
            rotation = match_rotation(rotated) if isinstance(rotated, torch.fx.Node) else None
            if not isinstance(rotation, Rotation) or rotation.source is not x_rot:
                continue
            if rotation.width or not (_fits(cos, r) and _fits(sin, r)):
                continue
            return rotation, cos, sin, [product, other, rotated, *rotation.parts, x_rot]
    return None


def _fits(table: Any, r: int) -> bool:
    """A tensor whose last dim is the ``r`` rotated columns (it broadcasts over the rest)."""
    value = example_value(table) if isinstance(table, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[-1] == r
