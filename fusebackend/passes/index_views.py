"""Indexing by constant aranges read as a reshape (fused graph only).

transformers' mask functions (``masking_utils``, 5.x) read the padding mask as
``padding_mask[batch_idx, kv_idx]``, with ``batch_idx = arange(B)[:, None, None, None]`` and
``kv_idx = arange(L)[None, None, None, :]``; at static shapes ``passes/constants.py`` folds
the aranges into constants, and the indexing stays a gather: an index kernel every call,
between the cast of the mask to bool and the ``&`` with the causal or bidirectional part,
so no group takes the mask's ops (a 2-layer DistilBERT's mask took 11 kernels a call on an
H200, Inductor's one).

Indexing every dim ``k`` of ``x`` by ``arange(x.shape[k])`` laid along an output axis of its
own, the axes in the order of the dims, selects every element in order: the result equals
``x.reshape(shape)``, with each dim at its axis and ones elsewhere. Such a getitem becomes
that reshape, which ``passes/reshapes.py`` then moves ahead of the mask's elementwise ops, so
one group computes the mask. A dim of size 1 (a batch of one) is indexed by a single 0 and
takes no axis. The reshape is a view where the gather made a copy, so the rewrite is left
out when anything in the graph writes into the indexed tensor or the result.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from fusebackend.passes.fx_util import evaluate, example_value, static_layout
from fusebackend.passes.mutations import known_written_storages, storage_id

__all__ = ["arange_indices_as_reshapes"]

_INDEX_DTYPES = (torch.int64, torch.int32)


def arange_indices_as_reshapes(graph: torch.fx.Graph, module: torch.nn.Module) -> list[str]:
    """Rewrite ``graph`` in place: each ``x[i0, i1, ...]`` whose indices are constant aranges
    (``get_attr`` tensors of ``module``) as described above becomes ``x.reshape(shape)``.
    Return the names of the getitems rewritten."""
    written = known_written_storages(graph.nodes)
    if written is None:
        return []
    rewritten = []
    for node in list(graph.nodes):
        shape = _reshape_of(node, module)
        if shape is None:
            continue
        source, index = node.args
        if {storage_id(example_value(source)), storage_id(example_value(node))} & written:
            continue
        with graph.inserting_before(node):
            reshape = graph.call_method("reshape", (source, shape))
        reshape.meta["example_value"] = evaluate(reshape)
        node.replace_all_uses_with(reshape)
        graph.erase_node(node)
        for item in index:
            if not item.users:  # the arange nothing else reads
                graph.erase_node(item)
        rewritten.append(node.name)
    return rewritten


def _reshape_of(node: torch.fx.Node, module: torch.nn.Module) -> tuple[int, ...] | None:
    """The shape ``node`` (a getitem by constant aranges) equals its source reshaped to,
    else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    source, index = node.args
    value, result = example_value(source), example_value(node)
    if not (isinstance(source, torch.fx.Node) and static_layout(value) and static_layout(result)):
        return None
    if not isinstance(index, tuple) or len(index) != value.dim() or result.dtype != value.dtype:
        return None
    axes = []
    for dim, item in enumerate(index):
        axis = _arange_axis(_constant(item, module), value.shape[dim], result.dim())
        if axis is None:
            return None
        axes.append(axis)
    placed = [(axis, size) for axis, size in zip(axes, value.shape) if size != 1]
    if any(a >= b for (a, _), (b, _) in zip(placed, placed[1:])):
        return None  # the dims change order: not a reshape
    shape = [1] * result.dim()
    for axis, size in placed:
        shape[axis] = size
    return tuple(shape) if tuple(shape) == tuple(result.shape) else None


def _constant(item: Any, module: torch.nn.Module) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads from ``module``, else None."""
    if not (isinstance(item, torch.fx.Node) and item.op == "get_attr"):
        return None
    value: Any = module
    for name in str(item.target).split("."):
        value = getattr(value, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _arange_axis(index: torch.Tensor | None, size: int, rank: int) -> int | None:
    """The output axis along which ``index`` is ``arange(size)`` (every other dim 1); -1 for
    ``size`` 1 (a single 0, no axis of its own); None for any other index."""
    if index is None or index.dtype not in _INDEX_DTYPES or index.dim() > rank:
        return None
    if index.numel() != size:
        return None
    dims = [1] * (rank - index.dim()) + list(index.shape)  # broadcast from the right
    if size == 1:
        return -1 if int(index.reshape(-1)[0]) == 0 else None
    along = [d for d, n in enumerate(dims) if n != 1]
    if len(along) != 1 or dims[along[0]] != size:
        return None
    expected = torch.arange(size, device=index.device, dtype=index.dtype)
    return along[0] if torch.equal(index.reshape(-1), expected) else None
