"""Rewrites of the graph's attention calls (``F.scaled_dot_product_attention``): grouped-query
attention without repeating K and V, one boolean-to-additive mask conversion per step, and
no mask where a mask is the same for every key.

**Grouped queries** (``pack_grouped_queries``): query heads that share a K/V head become
query rows of that head.

transformers' SDPA attention repeats each K/V head ``n_rep`` times (``repeat_kv``: an expand
and a reshape, which copies) whenever it passes a mask, because SDPA's ``enable_gqa`` would
send masked attention to its math path. In a StaticCache decode step that copies the whole
cache twice per layer: TinyLlama (32 query heads, 4 K/V heads, 22 layers) launches 44 copy
kernels per token, about 740 MB written at 4096 cache slots (found on its graph, 2026-11-23),
and SDPA then reads the 8 copies of every head.

Attention is computed for each (batch, head, query row) on its own, so in a decode step
(one query row) the ``n_rep`` query heads of one K/V head may as well be ``n_rep`` query
rows of it:

    q    [B, H, 1, D]  -> [B, Hkv, n_rep, D]   (head h = hkv * n_rep + r, repeat_kv's order)
    mask [M, 1, 1, S]  -> [M, 1, n_rep, S]     (expanded: every row is the one mask row)
    out  [B, Hkv, n_rep, D] -> [B, H, 1, D]

Every row is the same sum over the same keys as before; K and V are read once per K/V head
and never copied. Applied to an SDPA call with no dropout, ``is_causal=False`` and no
``enable_gqa``, whose mask (if any) has one head, whose K and V are repeat_kv of two
tensors ``[B, Hkv, S, D]`` with one ``n_rep`` that nothing writes between the repeat and
the call, with one query row and an output of the queries' shape, contiguous, all sizes
static, and at most ``PACK_MAX_SLOTS`` (512) cache slots: beyond that the copies cost less
than the parallelism packing loses (measured, see the constant).

**Shared masks** (``share_mask_conversion``): SDPA turns a boolean mask into an additive
one in the queries' dtype on every call, ``where(mask, 0, -inf)`` with both scalars made
tensors first: three launches per layer (two one-element fills and the ``where``), 66 per
TinyLlama decode step, about 90 us of its 1.8 ms of kernels (H100 profile, 2026-11-23),
while every layer passes the same mask. When two or more calls pass one boolean mask node,
it is converted once, before the first call, and the calls get the additive mask: the same
values SDPA would make for itself (``-inf`` everywhere in the queries' dtype, ``0`` where
the mask allows), so every backend sees the same mask as before. Decode steps only (one mask row):
a row that masks every key would be a prefill's padding row, and this keeps such rows
wherever SDPA puts them.

**Masks uniform along the keys** (``drop_key_uniform_masks``): a boolean mask whose last
dim has stride 0 (or size 1) allows each query row every key or none. Every fused GPU
kernel of SDPA refuses a mask with a stride-0 last dim, so the math path runs: BERT traced
by Dynamo passes an all-True ``[8, 1, 128, 128]`` mask expanded that way (H100,
2026-11-23, ``benchmarks/results/diag_bert_sdpa_h100.txt``: 413 kernels per call against
eager's 166, where eager passes no mask and gets cuDNN's kernel). Such a call runs without
the mask, and ``where(mask[..., :1], out, 0)`` sets the rows that allowed no key to 0,
which is what SDPA returns for them (the math path's safe softmax; the CPU kernel too).
Applied when the call has no dropout and is not causal, and the ``where`` keeps SDPA's
output layout. Not yet timed on a GPU.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusebackend.passes.fx_util import example_value, nodes_between, static_tensor
from fusebackend.passes.mutations import storage_id, written_storages

__all__ = ["drop_key_uniform_masks", "pack_grouped_queries", "share_mask_conversion"]

log = logging.getLogger(__name__)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False): ...  # fmt: skip


_SDPA = inspect.signature(_sdpa)
_NEW_AXIS = (slice(None), slice(None), None, slice(None), slice(None))

# Pack only caches of at most this many slots. Packed rows give SDPA one block of work per
# K/V head instead of one per query head, and each block walks the whole cache: on an H100
# (2026-11-23, benchmarks/results/diag_decode_sdpa_h100.txt; TinyLlama's 32 query and 4 K/V
# heads, fp16, cuDNN) a packed layer took 8.8 us at 176 slots against 11.2 us for repeat_kv's
# two copies plus SDPA, but 62.5 us at 4096 slots against 45.3 us. The two cross near 650
# slots; 512 keeps to the side measured as a gain.
PACK_MAX_SLOTS = 512


def pack_grouped_queries(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` in place; return the names of the SDPA calls rewritten."""
    packed = []
    for node in list(gm.graph.nodes):
        if _pack(gm.graph, node):
            packed.append(node.name)
    return _finish(gm, packed, "attention without repeated K/V")


def share_mask_conversion(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` in place: each boolean one-row mask that two or more SDPA calls pass
    (with queries of one dtype) becomes additive once. Return one entry per mask converted,
    ``"<mask node> (<n> calls)"``."""
    by_mask: dict[tuple[torch.fx.Node, torch.dtype], list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        a = _arguments(node)
        if a is None or not isinstance(a["attn_mask"], torch.fx.Node):
            continue
        m, q = example_value(a["attn_mask"]), example_value(a["query"])
        if (static_tensor(m) and m.dtype == torch.bool and m.dim() == 4 and m.shape[2] == 1
                and isinstance(q, torch.Tensor) and q.is_floating_point()):  # fmt: skip
            by_mask.setdefault((a["attn_mask"], q.dtype), []).append(node)
    shared = []
    for (mask, dtype), calls in by_mask.items():
        if len(calls) < 2:
            continue  # one call: SDPA's own conversion costs the same
        with gm.graph.inserting_before(calls[0]):  # after the mask, before every call
            blocked = gm.graph.call_function(torch.full_like, (mask, -math.inf), {"dtype": dtype})
            blocked.meta["example_value"] = torch.full_like(
                example_value(mask), -math.inf, dtype=dtype
            )
            converted = gm.graph.call_method("masked_fill", (blocked, mask, 0.0))
            converted.meta["example_value"] = blocked.meta["example_value"].masked_fill(
                example_value(mask), 0.0
            )
        for call in calls:
            call.replace_input_with(mask, converted)
        shared.append(f"{mask.name} ({len(calls)} calls)")
    return _finish(gm, shared, "boolean attention masks made additive once")


def drop_key_uniform_masks(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` in place: an SDPA call whose boolean mask is the same for every key of
    a query row runs without the mask, and the rows that allowed no key are set to 0
    afterwards. Return the names of the calls rewritten."""
    dropped = []
    for node in list(gm.graph.nodes):
        a = _arguments(node)
        if a is None or not isinstance(a["attn_mask"], torch.fx.Node):
            continue
        m, out = example_value(a["attn_mask"]), example_value(node)
        if not (static_tensor(m) and static_tensor(out) and m.dtype == torch.bool and m.dim()):
            continue
        if m.shape[-1] == 0 or (m.shape[-1] > 1 and m.stride(-1) != 0):
            continue  # keys masked one by one (or no keys)
        if a["is_causal"] is not False or a["dropout_p"] != 0.0:
            continue
        rows = m[..., :1]
        with getattr(m, "fake_mode", None) or contextlib.nullcontext():
            kept = torch.where(rows, out, 0.0)
        if kept.shape != out.shape or kept.stride() != out.stride():
            continue  # later views rely on SDPA's output layout
        with gm.graph.inserting_before(node):
            row_mask = gm.graph.call_function(
                operator.getitem, (a["attn_mask"], (Ellipsis, slice(None, 1)))
            )
            row_mask.meta["example_value"] = rows
        if "attn_mask" in node.kwargs:
            node.update_kwarg("attn_mask", None)
        else:
            node.update_arg(3, None)
        users = list(node.users)
        with gm.graph.inserting_after(node):
            zeroed = gm.graph.call_function(torch.where, (row_mask, node, 0.0))
            zeroed.meta["example_value"] = kept
        for user in users:
            user.replace_input_with(node, zeroed)
        dropped.append(node.name)
    return _finish(gm, dropped, "attention masks uniform along the keys dropped")


def _finish(gm: torch.fx.GraphModule, rewritten: list[str], what: str) -> list[str]:
    """After a rewrite of ``gm``: check and recompile it, and log what changed."""
    if rewritten:
        gm.graph.lint()
        gm.recompile()
        log.info("%s: %s", what, ", ".join(rewritten))
    return rewritten


def _arguments(node: torch.fx.Node) -> dict[str, Any] | None:
    """An SDPA call's arguments by name, defaults filled in; None for any other node."""
    if not (node.op == "call_function" and node.target is F.scaled_dot_product_attention):
        return None
    try:
        bound = _SDPA.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


def _pack(graph: torch.fx.Graph, sdpa: torch.fx.Node) -> bool:
    a = _arguments(sdpa)
    if a is None:
        return False
    if a["dropout_p"] != 0.0 or a["is_causal"] is not False or a["enable_gqa"] is not False:
        return False
    query, mask = a["query"], a["attn_mask"]
    keys, values = _repeated(a["key"]), _repeated(a["value"])
    if keys is None or values is None or keys[1] != values[1]:
        return False
    (key_source, n_rep), (value_source, _) = keys, values
    q, original = example_value(query), example_value(sdpa)
    if not (static_tensor(q) and static_tensor(original)) or q.dim() != 4 or n_rep < 2:
        return False
    batch, heads, rows, width = q.shape
    if rows != 1:
        # Decode only: with several query rows SDPA returns [B, H, T, D] laid out as
        # [B, T, H, D] (seen on the CPU), a layout the packed result would not keep, and a
        # prefill is bound by its matmuls, not by the copies.
        return False
    if heads % n_rep or tuple(original.shape) != (batch, heads, rows, width):
        return False  # a broadcast batch, or values of another width than the queries
    if example_value(key_source).shape[2] > PACK_MAX_SLOTS:
        return False  # a long cache: one block per K/V head walks it too slowly
    if not original.is_contiguous():
        # SDPA may return [B, H, T, D] laid out as [B, T, H, D]; the packed result is
        # contiguous, and later views (.transpose(1, 2).view(...)) rely on the layout.
        return False
    if _written_between(a["key"], sdpa, key_source) or _written_between(
        a["value"], sdpa, value_source
    ):
        return False  # the repeat copied the cache before a write that SDPA must not see
    kv_heads = heads // n_rep
    m = example_value(mask) if isinstance(mask, torch.fx.Node) else None
    if mask is not None and not (static_tensor(m) and m.dim() == 4 and m.shape[1] == 1
                                 and m.shape[2] == rows):  # fmt: skip
        return False
    with graph.inserting_before(sdpa):
        packed_q = _call(graph, "reshape", query, (batch, kv_heads, n_rep * rows, width))
        packed_mask = None
        if mask is not None:  # a view: the one mask row serves every packed query row
            packed_mask = _call(graph, "expand", mask, (m.shape[0], 1, n_rep, m.shape[3]))
        out = graph.call_function(
            F.scaled_dot_product_attention,
            (packed_q, key_source, value_source),
            {"attn_mask": packed_mask, "dropout_p": 0.0, "is_causal": False,
             "scale": a["scale"]},
        )  # fmt: skip
        out.meta["example_value"] = original.reshape(batch, kv_heads, n_rep * rows, width)
        result = _call(graph, "reshape", out, tuple(original.shape))
    sdpa.replace_all_uses_with(result)
    graph.erase_node(sdpa)
    for repeated in dict.fromkeys((a["key"], a["value"])):  # K and V may be one node
        _erase_unused_chain(graph, repeated)
    return True


def _call(graph: torch.fx.Graph, method: str, node: torch.fx.Node, args: tuple) -> Any:
    call = graph.call_method(method, (node, *args))
    call.meta["example_value"] = getattr(example_value(node), method)(*args)
    return call


def _repeated(node: Any) -> tuple[torch.fx.Node, int] | None:
    """(source, n_rep) when ``node`` is repeat_kv of ``source``: ``source[:, :, None]`` (or
    ``unsqueeze(2)``), expanded to ``[B, Hkv, n_rep, S, D]``, reshaped to ``[B, Hkv*n_rep,
    S, D]``; else None."""
    if not (isinstance(node, torch.fx.Node) and _method(node, "reshape")):
        return None
    expand = node.args[0]
    if not (isinstance(expand, torch.fx.Node) and _method(expand, "expand")):
        return None
    new_axis = expand.args[0]
    if not isinstance(new_axis, torch.fx.Node):
        return None
    if new_axis.op == "call_function" and new_axis.target is operator.getitem:
        if not (isinstance(new_axis.args[1], tuple) and new_axis.args[1] == _NEW_AXIS):
            return None
    elif not (_method(new_axis, "unsqueeze") and tuple(new_axis.args[1:]) == (2,)):
        return None
    source = new_axis.args[0]
    src, expanded, out = (example_value(n) for n in (source, expand, node))
    if not all(static_tensor(v) for v in (src, expanded, out)) or src.dim() != 4:
        return None
    b, kv_heads, length, width = src.shape
    n_rep = expanded.shape[2]
    if tuple(expanded.shape) != (b, kv_heads, n_rep, length, width):
        return None
    if tuple(out.shape) != (b, kv_heads * n_rep, length, width):
        return None
    return source, n_rep


def _written_between(start: torch.fx.Node, end: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Does a node after ``start`` and before ``end`` write ``source``'s storage?"""
    target = storage_id(example_value(source))
    return target is None or target in written_storages(nodes_between(start, end))


def _method(node: torch.fx.Node, name: str) -> bool:
    return node.op == "call_method" and node.target == name


def _erase_unused_chain(graph: torch.fx.Graph, reshape: torch.fx.Node) -> None:
    """Erase a repeat's reshape, expand and new axis once nothing reads them (its source
    stays: the cache itself)."""
    node = reshape
    for _ in range(3):
        if node.users:
            return
        source = node.args[0]
        graph.erase_node(node)
        node = source
