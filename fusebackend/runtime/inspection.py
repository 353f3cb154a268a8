"""What a graph cache shows of itself: ``describe()`` (one dict per entry, for ``explain``),
the rows of ``stats()`` and ``mode_for``; modes are handed out as plain strings. A
``GraphCache`` owns one ``Inspection``, a read-only view of its table and routes that holds
no reference to the cache."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fusebackend.runtime.entries import Entry, StatsRow
from fusebackend.runtime.frames import Route
from fusebackend.runtime.keys import Key, shapes
from fusebackend.runtime.logbook import Logbook
from fusebackend.runtime.table import EntryTable

__all__ = ["Inspection"]


class Inspection:
    """The read-only views of a graph cache.

    Args:
        table: Its entries.
        routes: Its signatures served by an older compilation (``frames.Route``; the cache's
            own dict, read live).
        key_for: The key of a call, padded as it would be (``Padding.key_for``).
        logbook: Its readable keys.
        capture_on_call: The option (a pending entry's decision reads it).
    """

    def __init__(
        self,
        table: EntryTable,
        routes: Mapping[Key, Route],
        key_for: Callable[..., Key],
        logbook: Logbook,
        capture_on_call: int,
    ) -> None:
        self._table = table
        self._routes = routes
        self._key_for = key_for
        self._logbook = logbook
        self._capture_on_call = capture_on_call

    def mode_for(self, *args: Any) -> str | None:
        """The mode a call with ``args`` would run in now, or None if it would be a miss."""
        key = self._key_for(*args)
        with self._table.lock:
            entry = self._table.get(key)
        return None if entry is None else entry.mode.value

    def describe(self) -> list[dict[str, Any]]:
        """One dict per live entry: key (readable), mode, reason, captured, decision (whether
        capture pays, for large outputs: see ``payoff``; when an uncaptured entry is captured),
        hits; then one per signature routed to an older compilation's entry (that entry's
        mode, reason, capture, decision and hits, and ``served_by``: the older cache)."""
        with self._table.lock:
            items = self._table.items()
            routes = list(self._routes.items())
        rows = [self._row(key, entry) for key, entry in items]
        for key, route in routes:
            older = route.cache
            entry = None if older is None else older.table.get(route.key)
            if entry is not None:  # gone: the next call makes it again (there or here)
                rows.append({**self._row(key, entry), "served_by": older.label_prefix})
        return rows

    def _row(self, key: Key, entry: Entry) -> dict[str, Any]:
        return {
            "key": self._logbook.label(key),
            "mode": entry.mode.value,
            "reason": entry.reason,
            "captured": entry.graph is not None,
            "decision": entry.decision
            or ("timing replay + output copy against direct" if entry.trial else None)
            or (
                f"captured on its call {self._capture_on_call} (recurs)" if entry.pending else None
            ),
            "hits": entry.hits,
        }

    def stats_rows(self) -> list[StatsRow]:
        with self._table.lock:
            items = self._table.items()
        return [
            StatsRow(self._logbook.label(key), shapes(key), entry.mode.value, entry.reason)
            for key, entry in items
        ]
