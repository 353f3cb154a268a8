"""The process-wide ``graph_memory`` bound: the least recently used captured entries of any
cache are evicted until the captured entries of all caches fit. It reads and evicts through
each cache's entry table (``table.EntryTable``) only."""

from __future__ import annotations

from fusebackend.runtime.counters import live_caches
from fusebackend.runtime.keys import Key
from fusebackend.runtime.table import EntryTable

__all__ = ["enforce_memory"]


def enforce_memory(budget: int, table: EntryTable, key: Key) -> None:
    """Evict the least recently used captured entries of any cache until the captured entries
    of all caches hold at most ``budget`` bytes (``key`` of ``table``, just captured, stays).

    The caller holds ``table``'s lock; another cache whose lock is busy (a call in flight on
    another thread) is skipped, never waited on.
    """
    busy: set[int] = set()
    while True:
        tables = [cache.table for cache in live_caches()]
        if sum(t.held_bytes for t in tables) <= budget:
            return
        oldest: tuple[int, EntryTable, Key] | None = None
        for other in tables:
            if id(other) in busy or not other.held_bytes:
                continue
            if not other.lock.acquire(blocking=False):
                busy.add(id(other))
                continue
            try:
                # Entries are in use order (moved to the end on each call): the first
                # captured one is the cache's least recently used.
                for k, entry in other.captured():
                    if not (other is table and k == key):
                        if oldest is None or entry.last_use < oldest[0]:
                            oldest = (entry.last_use, other, k)
                        break
            finally:
                other.lock.release()
        if oldest is None:
            return
        _, other, k = oldest
        if not other.lock.acquire(blocking=False):
            busy.add(id(other))
            continue
        try:
            if k in other:
                other.evict(k, "graph_memory")
        finally:
            other.lock.release()
