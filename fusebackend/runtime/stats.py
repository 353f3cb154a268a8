"""Process-wide counters, the global fusion switch, and the registry of live graph caches.

Counters are plain integer fields incremented by ``cudagraph_cache`` at the point where the
event happens (a capture that succeeded, a key that left "fusion", ...); nothing here guesses
them after the fact. ``stats()`` adds a snapshot of every live ``GraphCache``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fusebackend.runtime.cudagraph_cache import GraphCache

__all__ = [
    "COUNTERS",
    "Counters",
    "clear_cache",
    "fusion_enabled",
    "register_cache",
    "reset_stats",
    "set_fusion_enabled",
    "stats",
]


@dataclasses.dataclass(slots=True)
class Counters:
    """Event counts since the last ``reset_stats()`` (meanings: see ``stats``)."""

    cache_hits: int = 0
    cache_misses: int = 0
    recordings: int = 0
    fusion_attempts: int = 0
    fusion_successes: int = 0
    fusion_fallbacks: int = 0
    evictions: int = 0
    rerecords: int = 0
    capture_failures: int = 0

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


COUNTERS = Counters()

_fusion_enabled = True

# Caches register themselves so clear_cache() and stats() can reach every compiled graph
# without keeping any of them alive. WeakSet iteration is not safe against a concurrent add
# from another thread ("Set changed size during iteration"), hence the lock.
_CACHES: weakref.WeakSet[GraphCache] = weakref.WeakSet()
_CACHES_LOCK = threading.Lock()


def register_cache(cache: GraphCache) -> None:
    with _CACHES_LOCK:
        _CACHES.add(cache)


def _live_caches() -> list[GraphCache]:
    with _CACHES_LOCK:
        return list(_CACHES)


def fusion_enabled() -> bool:
    """Whether compiled graphs run their fused version (see ``set_fusion_enabled``)."""
    return _fusion_enabled


def set_fusion_enabled(enabled: bool) -> None:
    """Switch fusion on or off for every compiled graph, from the next call on.

    No recompile: the switch is part of every cache key, so with fusion off a call finds (or
    records) the unfused entry of its signature ("graph_replay" or "eager"), and switching
    back finds the fused entries again if they were not evicted meanwhile.
    """
    global _fusion_enabled
    if not isinstance(enabled, bool):
        raise TypeError(
            f"set_fusion_enabled expects a bool, got {type(enabled).__name__} ({enabled!r})"
        )
    _fusion_enabled = enabled


def reset_stats() -> None:
    """Zero every counter. Cached graphs stay; use ``clear_cache()`` to drop them."""
    COUNTERS.reset()


def clear_cache() -> None:
    """Free every captured graph, static buffer and fallback verdict of every live cache.

    Also drops the shared graph memory pools so their memory goes back to the allocator
    (and, with ``torch.cuda.empty_cache()``, to the device). Outputs a caller still holds
    (``static_outputs=True`` views) keep their own memory alive. Counters are not reset.
    """
    # cudagraph_cache imports this module for the counters, so it is imported here, late.
    from fusebackend.runtime import cudagraph_cache

    for cache in _live_caches():
        cache.clear()
    cudagraph_cache.release_pools()
    # The collection is for device memory held by reference cycles (tensors inside a cycle
    # with the model); without CUDA there is none, and a full collection costs ~0.1 s.
    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def stats() -> dict[str, Any]:
    """Counters and a snapshot of the live caches.

    Keys:
        enabled: The global fusion switch (``set_fusion_enabled``).
        fusion_scheduler_available: Triton imports and a CUDA device is available, i.e.
            fused kernels can run natively (without ``TRITON_INTERPRET``).
        cache_size: Live entries (input signatures) across all caches, any mode.
        cache_hits: Calls whose signature already had an entry.
        cache_misses: Calls that created an entry (first call of a signature, or again after
            its entry was evicted or cleared).
        recordings: Successful CUDA-graph captures (re-records included).
        fusion_attempts: First runs of a fused callable (one per new signature in "fusion").
        fusion_successes: Fused first runs that ran without error and, when
            ``validate`` is on, matched the unfused graph; with ``validate`` off, that ran
            without error. A graph rewritten but never run counts nothing.
        fusion_fallbacks: Signatures that left "fusion" for another mode (fused callable
            raised, mismatched, or could not be captured).
        cached_shapes: For each live entry, the shapes of its non-static tensor inputs as a
            tuple of tuples (after batch-bucket padding). Parameters and buffers are not in
            keys: their addresses are checked instead.
        fusion_modes: Readable key -> "fusion" | "graph_replay" | "eager" for each live entry.
            "fusion": the fused graph (captured when CUDA graphs are on); "graph_replay": the
            unfused graph, captured; "eager": the unfused graph run directly.
        fallback_reasons: Readable key -> why the entry is not in its first-choice mode, for
            live entries that fell back.
        evictions: Entries dropped by the ``max_graphs`` LRU limit.
        rerecords: Captures redone because a parameter or buffer changed address
            (e.g. ``param.data = ...``).
        capture_failures: CUDA-graph captures (warm-up included) that raised; each one moves
            its signature one step down the fallback chain.
        graph_pool_bytes: Device memory reserved by the shared graph memory pools (0 without
            CUDA).

    Readable keys look like ``"embed#0 fused (int64[4, 7], float16[7, 64]@cpu, 3)"``: cache
    name and number, whether the fused graph is selected, then each non-static input (dtype
    and shape, then strides if not contiguous and device if not the graph's own).
    """
    from fusebackend.runtime import cudagraph_cache

    result: dict[str, Any] = {
        "enabled": _fusion_enabled,
        "fusion_scheduler_available": _scheduler_available(),
    }
    rows = [row for cache in _live_caches() for row in cache.stats_rows()]
    result["cache_size"] = len(rows)
    result.update(COUNTERS.as_dict())
    result["cached_shapes"] = [row.shapes for row in rows]
    result["fusion_modes"] = {row.label: row.mode for row in rows}
    result["fallback_reasons"] = {row.label: row.reason for row in rows if row.reason}
    result["graph_pool_bytes"] = cudagraph_cache.pool_bytes()
    return result


def _scheduler_available() -> bool:
    return torch.cuda.is_available() and _triton_importable()


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install raises more than ImportError
        return False
    return True
