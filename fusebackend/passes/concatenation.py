"""Concatenations read by a row group: ``torch.cat`` as one ``concat`` op of its parts.

``torch.cat`` is a kernel of its own in eager (it copies every part into a new tensor), and
the consumers that read its result are another. Where a group reads the concatenation, the
kernel can read each part where it lies instead: an element at index ``i`` along the cat's
dim comes from the part whose range holds ``i``, at ``i`` less that part's offset
(``kernels/ir.Concat``). The concatenation then costs no kernel and no write of its result:
ViT's ``cat([cls_token.expand(B, -1, -1), x], 1) + pos_embed`` and the LayerNorm after it,
GhostNet's ``cat([conv_a, conv_b], 1)[:, :k] + shortcut``, DenseNet's concatenated features
feeding BatchNorm + ReLU are one kernel each, as Inductor makes them.

``match_concat`` gives the op, or why a concatenation is left as traced: its parts must be
tensors of its dtype, device and rank with static sizes along its dim (the offsets are
constants of the kernel; other dims may be symbolic), at most ``MAX_PARTS`` of them (each
part is one masked load per element; Inductor's limit for a concatenation read as pointwise
is 8 too). Its parts are read from memory, so none may be computed in the same group
(passes/partition.py); a concatenation whose parts are all group outputs is written in place
instead (passes/concat_writes.py).

``drop_identity_slices`` removes ``x[:, :k]`` slices that keep every element (GhostNet's
``out[:, :self.out_chs]`` of a concatenation of exactly ``out_chs`` channels): the slice is
a view of ``x`` with ``x``'s own shape, strides and offset, so its readers read ``x``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusebackend.passes.fx_util import evaluate, example_value, same_layout, static_layout
from fusebackend.passes.mutations import known_written_storages, storage_id, written_args
from fusebackend.passes.ops import OP_TABLE, OpCall

__all__ = ["CAT_FUNCTIONS", "MAX_PARTS", "cat_arguments", "drop_identity_slices", "match_concat"]

MAX_PARTS = 8
CAT_FUNCTIONS = (torch.cat, torch.concat, torch.concatenate)  # the spellings of a cat


def cat_arguments(node: torch.fx.Node) -> tuple[Any, Any]:
    """(tensors, dim) of a ``torch.cat`` call, as given (positional or keyword)."""
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return tensors, dim


def match_concat(node: torch.fx.Node) -> OpCall | str | None:
    """The ``concat`` op of a ``torch.cat`` node (params: ``dim``, counted from the end,
    and ``sizes``, each part's size along it), why it is left as traced, or None (not a
    ``torch.cat``)."""
    if node.op != "call_function" or node.target not in CAT_FUNCTIONS:
        return None
    tensors, dim = cat_arguments(node)
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or not isinstance(tensors, list | tuple):
        return "a cat of values that are not tensors"
    if not isinstance(dim, int) or not 2 <= len(tensors) <= MAX_PARTS:
        return f"a cat of {len(tensors)} parts (fused: 2 to {MAX_PARTS}, along a constant dim)"
    rank = value.dim()
    dim = dim % rank if rank else 0
    sizes = []
    for part in tensors:
        part_value = example_value(part) if isinstance(part, torch.fx.Node) else None
        if not isinstance(part_value, torch.Tensor):
            return "a cat of parts that are not tensors"
        if (part_value.dim(), part_value.dtype, part_value.device) != (
            rank, value.dtype, value.device):  # fmt: skip
            return "a cat of parts of another rank, dtype or device than its result"
        size = part_value.shape[dim]  # other dims may be symbolic: read by strides
        if not isinstance(size, int):
            return "a cat of parts of symbolic size along its dim (the offsets are constants)"
        if size == 0:
            return "a cat with an empty part"
        sizes.append(size)
    width = value.shape[-1]
    if dim == rank - 1 and isinstance(width, int) and width == 1:
        return "a cat into rows of width 1"
    return OpCall(OP_TABLE["concat"], tuple(tensors), {"dim": dim - rank, "sizes": tuple(sizes)})


def drop_identity_slices(graph: torch.fx.Graph) -> list[str]:
    """Readers of a ``getitem`` that keeps every element of a tensor, of an ``expand`` to
    the tensor's own shape (transformers' masks: ``mask.expand(B, -1, L, L)`` of a mask
    already that shape), or of a ``torch.cat`` of the tensor and empty parts (Phi-3's and
    GPT-NeoX's rotary embeddings, ``cat([q_embed, q[..., rotary_dim:]], -1)`` where the
    rotation takes every column: where its layout is the cat's, or its readers take any
    layout or copy it into one layout either way), read the tensor; returns the nodes
    removed."""
    dropped = []
    written = known_written_storages(graph.nodes)
    for node in list(graph.nodes):
        if not node.users or any(user.op == "output" for user in node.users):
            continue  # a graph output stays the view eager returns
        source = _only_filled_part(node) if node.target in CAT_FUNCTIONS else None
        if node.op == "call_method" and node.target in ("expand", "expand_as"):
            source = node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
        if source is not None:
            # (a copy the graph writes through, or one of a source it writes, is no longer
            # the source's value)
            storages = {storage_id(example_value(n)) for n in (node, source)}
            free = written is not None and not storages & written
            kept = same_layout(example_value(source), example_value(node))
            alike = node.target in CAT_FUNCTIONS and _copied_alike(node, source)
            if free and (kept or _reads_any_layout(node) or alike):
                node.replace_all_uses_with(source)
                graph.erase_node(node)
                dropped.append(node.name)
            continue
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        source, index = node.args
        if isinstance(source, torch.fx.Node) and _keeps_everything(source, index):
            node.replace_all_uses_with(source)
            graph.erase_node(node)
            dropped.append(node.name)
    return dropped


def _only_filled_part(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one part of a ``torch.cat`` node whose other parts are all empty along its dim
    (a cat of that part alone copies it), else None."""
    if node.op != "call_function":
        return None
    tensors, dim = cat_arguments(node)
    if not isinstance(tensors, list | tuple) or not isinstance(dim, int):
        return None
    values = [example_value(part) if isinstance(part, torch.fx.Node) else None
              for part in tensors]  # fmt: skip
    if not all(static_layout(v) for v in values):
        return None
    filled = [part for part, v in zip(tensors, values) if v.shape[dim % v.dim()] != 0]
    return filled[0] if len(filled) == 1 else None


# Writes into a tensor that read their source by index, whatever its strides (a KV cache's
# update: ``cache[:, :, positions] = key_states``, ``index_copy_``).
_COPIES_INTO = {operator.setitem, "index_copy_", "index_put_", "copy_",
                torch.Tensor.index_copy_, torch.Tensor.index_put_, torch.Tensor.copy_}  # fmt: skip


def _reads_any_layout(node: torch.fx.Node) -> bool:
    """Do ``node``'s readers all take its values whatever its strides (attention calls and
    copies into a cache: the cat's part may keep a layout of its own, a transposed view's)?"""
    for user in node.users:
        if user.target is F.scaled_dot_product_attention:
            continue
        if user.target in _COPIES_INTO and node not in written_args(user):
            continue
        return False
    return True


# Views a reader may take of a cat before a copy (repeat_kv: x[:, :, None].expand().reshape())
_VIEWS = {operator.getitem, torch.unsqueeze, torch.reshape, torch.flatten, "unsqueeze",
          "expand", "view", "reshape", "flatten"}  # fmt: skip


def _copied_alike(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Does every reader of ``node`` reach, through views that only it reads, a tensor of
    the same strides whether those views start at ``node`` or at ``source``? (Phi-3's key
    heads, rotated in their transposed layout, then expanded and reshaped for grouped-query
    attention: the reshape copies either way, into the same layout.)"""
    for user in node.users:
        chain = [user]
        while len(chain[-1].users) == 1 and next(iter(chain[-1].users)).target in _VIEWS:
            chain.append(next(iter(chain[-1].users)))
        if any(n.target not in _VIEWS or n.op == "output" for n in chain):
            return False
        values = {node: example_value(source)}
        try:
            for view in chain:
                values[view] = evaluate(view, lambda a, seen=values: seen.get(a, example_value(a)))
        except (RuntimeError, ValueError):  # a view the source's strides do not allow
            return False
        if not same_layout(values[chain[-1]], example_value(chain[-1])):
            return False
    return True


def _keeps_everything(source: torch.fx.Node, index: Any) -> bool:
    """Is ``source[index]`` all of ``source``: slices of step 1 from 0 that reach the end
    of their dims (an ``Ellipsis`` anywhere), nothing else?"""
    value = example_value(source)
    if not static_layout(value):
        return False
    items = index if isinstance(index, tuple) else (index,)
    if sum(item is Ellipsis for item in items) > 1:
        return False
    slices = [item for item in items if item is not Ellipsis]
    if len(slices) > value.dim() or not all(isinstance(item, slice) for item in slices):
        return False
    if Ellipsis in items:
        at = items.index(Ellipsis)
        dims = [*range(at), *range(value.dim() - (len(items) - at - 1), value.dim())]
    else:
        dims = list(range(len(slices)))
    for dim, item in zip(dims, slices):
        start, stop, step = item.start, item.stop, item.step
        if not all(x is None or isinstance(x, int) for x in (start, stop, step)):
            return False
        if start not in (None, 0) or step not in (None, 1):
            return False
        if stop is not None and stop < value.shape[dim]:
            return False
    return True
