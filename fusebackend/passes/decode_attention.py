"""Decode steps' attention calls run by one kernel that reads K/V unrepeated
(``kernels/decode_attention.py``).

An SDPA call with one query row per head, no dropout and ``is_causal=False`` becomes
``attend(query, key, value, mask, scale, groups, out_stride)``, where ``key`` and
``value`` are the tensors before transformers' ``repeat_kv`` (``x[:, :, None]`` expanded
``groups`` times along that dim and reshaped to ``groups`` times the heads), or SDPA's own
arguments with ``enable_gqa`` or as many K/V heads as query heads. The repeat's nodes go
when nothing else reads them, and with them their copies. The kernel reads the tensor at
SDPA's place where the repeat copied it at its own, so a call is kept when a node between
the two writes the tensor. Causal calls keep SDPA: with one
query row, SDPA's causal mask (aligned to the top left) allows the first key only, which no
decode step means.

Applied to the fused graph only: the unfused graph stays as traced and remains the
reference that the fused one is validated against.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx

from fusebackend.passes.attention import sdpa_arguments
from fusebackend.passes.fx_util import example_value, nodes_between
from fusebackend.passes.mutations import storage_id, written_storages

__all__ = ["can_attend_decode", "use_decode_attention"]

log = logging.getLogger(__name__)

_MAX_HEAD_DIM = 256  # the kernel's widest tile
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def use_decode_attention(graph: torch.fx.Graph, attend: Any) -> list[str]:
    """Rewrite ``graph`` in place; return the names of the SDPA calls replaced.
    ``attend``: the operator called as ``attend(query, key, value, mask, scale, groups,
    out_stride)`` (``kernels.decode_attention.decode_attention``)."""
    replaced = []
    for node in list(graph.nodes):
        a = sdpa_arguments(node)
        if a is None or a["dropout_p"] != 0.0 or a["is_causal"] is not False:
            continue
        scale = a["scale"]
        if not (scale is None or isinstance(scale, int | float)):
            continue  # a symbolic scale
        key, key_groups = _unrepeated(a["key"], a["query"], a["enable_gqa"])
        value, value_groups = _unrepeated(a["value"], a["query"], a["enable_gqa"])
        if key is None or value is None or key_groups != value_groups:
            continue
        if _written_since_copy(a["key"], key, node) or _written_since_copy(a["value"], value, node):
            continue  # the kernel would read the write, where SDPA reads the copy
        query, mask, out = a["query"], a["attn_mask"], example_value(node)
        if not isinstance(query, torch.fx.Node) or not (
            mask is None or isinstance(mask, torch.fx.Node)
        ):
            continue
        values = [example_value(n) if n is not None else None for n in (query, key, value, mask)]
        if not can_attend_decode(*values, key_groups) or not isinstance(out, torch.Tensor):
            continue
        if tuple(out.shape) != tuple(values[0].shape):
            continue
        with graph.inserting_before(node):
            call = graph.call_function(
                attend, (query, key, value, mask, scale, key_groups, tuple(out.stride()))
            )
        call.meta["example_value"] = out
        node.replace_all_uses_with(call)
        repeats = [a["key"], a["value"]]
        graph.erase_node(node)
        _erase_unused_repeats(graph, repeats)
        replaced.append(node.name)
    if replaced:
        graph.lint()
        log.info("decode attention by the K/V-unrepeated kernel: %s", ", ".join(replaced))
    return replaced


def can_attend_decode(query: Any, key: Any, value: Any, mask: Any, groups: int) -> bool:
    """Do these (example) values fit the kernel? One query row per head; ``key``/``value``
    of ``heads / groups`` heads, of the query's dtype (fp16, bf16 or fp32), device and head
    size (at most 256); a mask, if any, boolean or of the query's dtype and broadcastable to
    ``[batch, heads, 1, keys]``; all sizes static."""
    tensors = [t for t in (query, key, value, mask) if t is not None]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if not all(isinstance(n, int) for t in tensors for n in t.shape):
        return False
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        return False
    batch, heads, rows, width = query.shape
    if rows != 1 or groups < 1 or heads != key.shape[1] * groups:
        return False
    if key.shape[0] != batch or key.shape[3] != width or not 0 < width <= _MAX_HEAD_DIM:
        return False
    if query.dtype not in _DTYPES or {key.dtype, value.dtype} != {query.dtype}:
        return False
    if len({t.device for t in tensors}) != 1:
        return False
    if mask is not None:
        if mask.dtype not in (torch.bool, query.dtype) or mask.dim() > 4:
            return False
        full = (batch, heads, 1, key.shape[2])
        try:  # and the mask must not widen the output
            return torch.broadcast_shapes(tuple(mask.shape), full) == full
        except RuntimeError:
            return False
    return True


def _unrepeated(node: Any, query: Any, enable_gqa: Any) -> tuple[torch.fx.Node | None, int]:
    """(tensor before ``repeat_kv``, query heads per K/V head) of SDPA's key or value
    argument: the repeat's source, or the argument itself where it has as many heads as the
    query or ``enable_gqa`` shares its heads; (None, 0) otherwise."""
    if not isinstance(node, torch.fx.Node):
        return None, 0
    repeated = _repeat_source(node)
    if repeated is not None:
        return repeated
    q, kv = example_value(query), example_value(node)
    if not (isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor)):
        return None, 0
    if q.dim() != 4 or kv.dim() != 4 or kv.shape[1] == 0 or q.shape[1] % kv.shape[1]:
        return None, 0
    groups = q.shape[1] // kv.shape[1]
    return (node, groups) if groups == 1 or enable_gqa is True else (None, 0)


def _written_since_copy(argument: Any, source: torch.fx.Node, call: torch.fx.Node) -> bool:
    """Does a node between the repeat's copy (``argument``, SDPA's key or value) and the
    SDPA ``call`` write the repeat's ``source``? (False when ``argument`` is the source.)"""
    if argument is source:
        return False
    storage = storage_id(example_value(source))
    return storage is None or storage in written_storages(nodes_between(argument, call))


def _repeat_source(node: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """``(x, n)`` when ``node`` is ``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n,
    s, d)`` (transformers' ``repeat_kv``), else None."""
    if not (node.op == "call_method" and node.target in ("reshape", "view")):
        return None
    expanded = node.args[0]
    if not (isinstance(expanded, torch.fx.Node) and expanded.op == "call_method"
            and expanded.target == "expand"):  # fmt: skip
        return None
    unsqueezed = expanded.args[0]
    if not isinstance(unsqueezed, torch.fx.Node) or not _unsqueezes_dim_2(unsqueezed):
        return None
    source = unsqueezed.args[0]
    if not isinstance(source, torch.fx.Node):
        return None
    x, u, e, r = (example_value(n) for n in (source, unsqueezed, expanded, node))
    if not all(isinstance(t, torch.Tensor) for t in (x, u, e, r)) or x.dim() != 4:
        return None
    b, h, s, d = x.shape
    groups = e.shape[2] if e.dim() == 5 else 0
    if (tuple(u.shape) != (b, h, 1, s, d) or tuple(e.shape) != (b, h, groups, s, d)
            or tuple(r.shape) != (b, h * groups, s, d)):  # fmt: skip
        return None
    return source, groups


def _unsqueezes_dim_2(node: torch.fx.Node) -> bool:
    """Is ``node`` ``x[:, :, None]`` (full slices elsewhere) or ``x.unsqueeze(2)`` of 4-D x?"""
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1]
        if not isinstance(index, tuple):
            return False
        full = slice(None, None, None)
        return (
            len(index) >= 3
            and index[:3] == (full, full, None)
            and all(i == full or i is Ellipsis for i in index[3:])
        )
    if node.op == "call_method" and node.target == "unsqueeze":
        return node.args[1:] in ((2,), (-3,)) and not node.kwargs
    if node.op == "call_function" and node.target is torch.unsqueeze:
        return node.args[1:] in ((2,), (-3,)) and not node.kwargs
    return False


def _erase_unused_repeats(graph: torch.fx.Graph, repeats: list[Any]) -> None:
    """Erase the reshape, expand and unsqueeze of each repeat that nothing reads any more."""
    for node in dict.fromkeys(repeats):  # K and V may be one node
        if not isinstance(node, torch.fx.Node) or _repeat_source(node) is None:
            continue
        expanded = node.args[0]
        for link in (node, expanded, expanded.args[0]):
            if not link.users:
                graph.erase_node(link)
