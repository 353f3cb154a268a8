"""A layer's two KV-cache writes as one launch (``kernels/cache_write.py``).

transformers' StaticCache writes the new keys and values of a layer with
``keys.index_copy_(2, cache_position, k)`` and then ``values.index_copy_(2, cache_position,
v)``: two launches per layer. Two such writes ``a`` (earlier) and ``b`` become one call of
``kernels.cache_write.write_cache_pair`` at ``b``'s place when they use one index node along dim
2 (or -2) of 4-D caches (``can_write_pair``), nothing uses their
results, the two caches are different storages and hold neither new rows (which may share
one storage, as GPT-2's K and V split from one projection do), and no node between
them reads or writes ``a``'s cache or writes ``a``'s new rows or the index (``a``'s write
moves down to ``b``). Each write pairs at most once, with the next write that qualifies.

Applied to the fused graph only: the unfused graph stays as traced and remains the
reference that the fused one is validated against.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx

from fusebackend.passes.fx_util import example_value, nodes_between
from fusebackend.passes.mutations import storage_id, written_storages

__all__ = ["cache_write_of", "can_write_pair", "pair_cache_writes"]

log = logging.getLogger(__name__)


def pair_cache_writes(graph: torch.fx.Graph, write_pair: Any, checks: bool) -> list[str]:
    """Rewrite ``graph`` in place; return ``"<a> + <b>"`` for each pair of writes joined.
    ``write_pair``: the operator called as ``write_pair(k_cache, v_cache, index, k, v,
    checks)`` (``kernels.cache_write.write_cache_pair``); ``checks``: build its kernel with
    the device-side index assert."""
    writes = [n for n in graph.nodes if cache_write_of(n) is not None]
    paired: list[str] = []
    taken: set[torch.fx.Node] = set()
    for k, first in enumerate(writes):
        if first in taken:
            continue
        for second in writes[k + 1 :]:
            if second not in taken and _can_join(first, second):
                _join(graph, first, second, write_pair, checks)
                taken.update((first, second))
                paired.append(f"{first.name} + {second.name}")
                break
    if paired:
        graph.lint()
        log.info("KV-cache writes paired into one launch: %s", ", ".join(paired))
    return paired


def cache_write_of(
    node: torch.fx.Node,
) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(cache, index, new rows) of ``cache.index_copy_(2 or -2, index, rows)``, else None."""
    if not (node.op == "call_method" and node.target == "index_copy_" and not node.kwargs):
        return None
    if len(node.args) != 4 or node.args[1] not in (2, -2) or node.users:
        return None
    cache, _, index, rows = node.args
    if not all(isinstance(n, torch.fx.Node) for n in (cache, index, rows)):
        return None
    return cache, index, rows


def _can_join(first: torch.fx.Node, second: torch.fx.Node) -> bool:
    (k_cache, index, k), (v_cache, v_index, v) = cache_write_of(first), cache_write_of(second)
    if index is not v_index:
        return False
    values = [example_value(n) for n in (k_cache, v_cache, index, k, v)]
    if not can_write_pair(*values):
        return False
    caches = [storage_id(values[0]), storage_id(values[1])]
    rows = {storage_id(values[3]), storage_id(values[4])}
    # The new rows may share a storage (GPT-2 splits K and V from one projection); the
    # kernel writes a cache while it reads the rows, so neither cache may hold them.
    if None in caches or None in rows or caches[0] == caches[1] or rows & set(caches):
        return False
    k_cache_storage, moved = caches[0], {storage_id(values[2]), storage_id(values[3])}
    for node in nodes_between(first, second):
        read = {storage_id(example_value(n)) for n in node.all_input_nodes}
        written = written_storages([node])
        if k_cache_storage in read | written or moved & written:
            return False
    return True


def _join(
    graph: torch.fx.Graph,
    first: torch.fx.Node,
    second: torch.fx.Node,
    write_pair: Any,
    checks: bool,
) -> None:
    (k_cache, index, k), (v_cache, _, v) = cache_write_of(first), cache_write_of(second)
    with graph.inserting_before(second):
        joined = graph.call_function(write_pair, (k_cache, v_cache, index, k, v, checks))
    joined.meta["example_value"] = None
    graph.erase_node(second)
    graph.erase_node(first)


def can_write_pair(k_cache: Any, v_cache: Any, index: Any, k: Any, v: Any) -> bool:
    """Do these (example) values fit ``write_cache_pair``? Two 4-D caches of one shape,
    dtype and device, two new-row tensors of one shape in that dtype, a 1-D int64 index
    of one entry per new row, all sizes static."""
    tensors = (k_cache, v_cache, index, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if not all(isinstance(n, int) for t in tensors for n in t.shape):
        return False
    return (
        k_cache.dim() == 4
        and k_cache.shape == v_cache.shape
        and k.shape == v.shape
        and k.dim() == 4
        and k.shape[:2] == k_cache.shape[:2]
        and k.shape[3] == k_cache.shape[3]
        and {t.dtype for t in (k_cache, v_cache, k, v)} == {k_cache.dtype}
        and len({t.device for t in tensors}) == 1
        and index.dim() == 1
        and index.dtype == torch.int64  # as index_copy_ demands
        and index.shape[0] == k.shape[2]
    )
