"""Letting entries go: the process-wide ``graph_memory`` bound over every cache's captured
entries (least recently used first), the hint logged once per cache for each cause, and the
retirement of a collected cache's captured entries."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from fusebackend.config import FusionConfig
from fusebackend.runtime import capture as _capture
from fusebackend.runtime.counters import live_caches
from fusebackend.runtime.entries import Entry
from fusebackend.runtime.keys import Key

if TYPE_CHECKING:
    from fusebackend.runtime.graph_cache import GraphCache

__all__ = ["enforce_memory", "eviction_hint", "retire_entries"]

_HINTS: dict[str, Callable[[FusionConfig, int], str]] = {
    "max_graphs": lambda c, limit: (
        f"more than max_graphs={c.max_graphs} input signatures; the oldest are evicted "
        "and re-captured when they return (raise max_graphs, or use batch_buckets / "
        "length_buckets for varying batch sizes / lengths)"
    ),
    "graph_memory": lambda c, limit: (
        f"captured graphs hold more than graph_memory={c.graph_memory} bytes; the least "
        "recently used are evicted and re-captured when they return (raise graph_memory, or "
        "use batch_buckets / length_buckets)"
    ),
    "entry_limit": lambda c, limit: (
        f"more than {limit} input signatures; the oldest are evicted (use "
        "batch_buckets / length_buckets, or dynamic=True)"
    ),
    "superseded": lambda c, limit: (
        "a newer compilation of this function serves its shapes; their entries here are dropped"
    ),
}


def eviction_hint(cause: str, config: FusionConfig, entry_limit: int) -> str:
    """What to do about evictions for ``cause`` (``entry_limit``: entries kept per cache)."""
    return _HINTS[cause](config, entry_limit)


def enforce_memory(budget: int, cache: GraphCache, key: Key) -> None:
    """Evict the least recently used captured entries of any cache until the captured entries
    of all caches hold at most ``budget`` bytes (``key`` of ``cache``, just captured, stays).

    The caller holds ``cache``'s lock; another cache whose lock is busy (a call in flight on
    another thread) is skipped, never waited on.
    """
    busy: set[int] = set()
    while True:
        caches = live_caches()
        if sum(c._held_bytes for c in caches) <= budget:
            return
        oldest: tuple[int, GraphCache, Key] | None = None
        for other in caches:
            if id(other) in busy or not other._held_bytes:
                continue
            if not other._lock.acquire(blocking=False):
                busy.add(id(other))
                continue
            try:
                # Entries are in use order (moved to the end on each call): the first
                # captured one is the cache's least recently used.
                for k, entry in other._entries.items():
                    if entry.graph is not None and not (other is cache and k == key):
                        if oldest is None or entry.last_use < oldest[0]:
                            oldest = (entry.last_use, other, k)
                        break
            finally:
                other._lock.release()
        if oldest is None:
            return
        _, other, k = oldest
        if not other._lock.acquire(blocking=False):
            busy.add(id(other))
            continue
        try:
            if k in other._entries:
                other._evict(k, "graph_memory")
        finally:
            other._lock.release()


def retire_entries(entries: Mapping[Key, Entry], device_index: int | None) -> None:
    """Retire the captured entries of a collected cache (``capture.retire``: freed once no
    queued replay reads them)."""
    for entry in list(entries.values()):
        if entry.graph is not None:
            _capture.retire(entry.resources(), device_index)
