"""One graph cache's table: its live entries by signature in use order (least recently used
first), the remembered verdicts of its signatures, the bytes its captured entries hold, and
the lock that guards them. Everything that lets an entry go goes through it: the count
bounds (``max_graphs``, the entry limit) on insert, evictions (counted by cause, the hint
logged once per cache), plain removals (a re-record, a capture, a stale bucket entry), and
the retirement of a collected cache's captured entries. ``eviction.py`` (the ``graph_memory``
bound over every cache) and ``frames.py`` (supersession, routing) use only this public API.

The table holds no reference to its cache: the cache's finalizer keeps it alive to retire
its entries (``retire``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

from fusebackend.config import FusionConfig
from fusebackend.runtime import capture as _capture
from fusebackend.runtime.counters import COUNTERS
from fusebackend.runtime.entries import Entry, Verdict
from fusebackend.runtime.keys import Key
from fusebackend.runtime.logbook import Logbook

# GraphCache's logger: the cache's parts log under one name.
log = logging.getLogger("fusebackend.runtime.graph_cache")

__all__ = ["EntryTable", "eviction_hint"]

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


class EntryTable:
    """A graph cache's entries, verdicts and captured bytes.

    Args:
        logbook: The cache's names and its one warning (eviction logs).
        config: Options; reads ``max_graphs`` (and the hints' ``graph_memory``).
        replay_device: Device whose replays are ordered across streams: a dropped captured
            entry is retired there (``capture.retire``); None: freed at once.
        max_entries: Entries kept whatever their memory (``entry_limit`` evictions).
        max_verdicts: Verdicts kept (oldest dropped).

    ``lock`` (reentrant) is held for lookups, misses and the whole copy-in/replay/copy-out of
    captured entries (static buffers are shared by every call of a key); another cache takes
    it without blocking only (``eviction.py``, ``frames.py``).
    """

    # The plain OrderedDict methods, bound once: the hot path pays no wrapper call.
    get: Callable[[Key], Entry | None]  # the live entry of a key, or None (use order kept)
    touch: Callable[[Key], None]  # a key's entry becomes the most recently used

    def __init__(
        self,
        logbook: Logbook,
        config: FusionConfig,
        *,
        replay_device: int | None,
        max_entries: int,
        max_verdicts: int,
    ) -> None:
        self.lock = threading.RLock()
        self._logbook = logbook
        self._config = config
        self._replay_device = replay_device
        self._max_entries = max_entries
        self._max_verdicts = max_verdicts
        self._entries: OrderedDict[Key, Entry] = OrderedDict()
        self._verdicts: dict[Key, Verdict] = {}
        self._held_bytes = 0  # nbytes of the captured entries (graph_memory)
        self._evicting = False  # the eviction hint was logged
        self.get = self._entries.get
        self.touch = self._entries.move_to_end

    # ---------------------------------------------------------------------------- reading

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: Key) -> Entry:
        return self._entries[key]

    def keys(self) -> list[Key]:
        """The live keys, least recently used first (a copy)."""
        return list(self._entries)

    def items(self) -> list[tuple[Key, Entry]]:
        """The live entries, least recently used first (a copy)."""
        return list(self._entries.items())

    def captured(self) -> Iterator[tuple[Key, Entry]]:
        """The captured entries (their ``nbytes`` and ``last_use``), least recently used
        first; the caller holds ``lock``."""
        for key, entry in self._entries.items():
            if entry.graph is not None:
                yield key, entry

    @property
    def held_bytes(self) -> int:
        """Device memory the captured entries hold alone (what ``graph_memory`` bounds)."""
        return self._held_bytes

    def verdict(self, key: Key) -> Verdict | None:
        """The remembered verdict of ``key`` (kept after its entry goes), or None."""
        return self._verdicts.get(key)

    @property
    def verdict_count(self) -> int:
        """How many verdicts are kept (at most ``max_verdicts``)."""
        return len(self._verdicts)

    # ---------------------------------------------------------------------------- writing

    def remember(self, key: Key, verdict: Verdict) -> None:
        """Keep a key's verdict, success or fallback: it never retries a fallback, is not
        validated again and is captured at once when it returns (bounded: oldest dropped)."""
        if key not in self._verdicts and len(self._verdicts) >= self._max_verdicts:
            del self._verdicts[next(iter(self._verdicts))]
        self._verdicts[key] = verdict

    def insert(self, key: Key, entry: Entry) -> None:
        """Add ``key``'s entry as the most recently used; the oldest go over ``max_graphs``
        and the entry limit (evictions)."""
        self._entries[key] = entry
        self._held_bytes += entry.nbytes
        cap = self._config.max_graphs
        while cap is not None and len(self._entries) > cap:
            self.evict(next(iter(self._entries)), "max_graphs")
        while len(self._entries) > self._max_entries:
            self.evict(next(iter(self._entries)), "entry_limit")

    def replace(self, key: Key, old: Entry, new: Entry) -> None:
        """Put ``new`` in the place of ``key``'s entry ``old`` (same use order) and let
        ``old`` go (``drop``)."""
        self._entries[key] = new
        self._held_bytes += new.nbytes
        self.drop(old)

    def remove(self, key: Key) -> Entry | None:
        """Take ``key``'s entry out and let it go (``drop``), uncounted (a re-record, the
        capture of a pending entry, a stale bucket entry); None where there is none."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.drop(entry)
        return entry

    def evict(self, key: Key, cause: str) -> None:
        """Drop ``key``'s entry for ``cause`` (counted: ``eviction_reasons``); its verdict
        stays, so it is neither validated nor kept uncaptured again when it returns. The
        caller holds ``lock``."""
        entry = self._entries.pop(key)
        self.drop(entry)
        COUNTERS.evicted(cause)
        book = self._logbook
        if cause == "superseded":  # the expected course of Dynamo's recompiles: no warning
            log.debug("%s: %s superseded by a newer compilation", book.name, book.label(key))
            return
        if not self._evicting:
            self._evicting = True
            hint = eviction_hint(cause, self._config, self._max_entries)
            log.log(book.warn_once(), "%s: %s", book.name, hint)
        log.debug("%s: evicted %s (%s)", book.name, book.label(key), cause)

    def drop(self, entry: Entry) -> None:
        """Let go of an entry out of the table: its bytes, and its graph and buffers once no
        queued replay reads them."""
        self._held_bytes -= entry.nbytes
        if entry.graph is not None:
            _capture.retire(entry.resources(), self._replay_device)

    def clear(self) -> None:
        """Drop every entry (captured graphs, static buffers) and every verdict."""
        for entry in self._entries.values():
            self.drop(entry)
        self._entries.clear()
        self._held_bytes = 0
        self._verdicts.clear()

    def retire(self) -> None:
        """Retire the captured entries of a collected cache (its finalizer): a replay queued
        on another stream may still read their buffers, which freeing them at once would hand
        to other tensors (``capture.retire``: freed once no queued replay reads them)."""
        for entry in list(self._entries.values()):
            if entry.graph is not None:
                _capture.retire(entry.resources(), self._replay_device)
