"""What a graph cache shows of itself: readable keys, ``describe()`` (one dict per entry,
for ``explain``), the rows of ``stats()`` and ``mode_for``; modes are handed out as plain
strings. ``GraphCache`` takes these methods from ``Inspection``."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from fusebackend.config import FusionConfig
from fusebackend.runtime.entries import Entry, StatsRow
from fusebackend.runtime.keys import Key, label, shapes

__all__ = ["Inspection"]


class Inspection:
    """The read-only views of ``GraphCache`` (a mixin: the state below is set by its __init__)."""

    label_prefix: str
    _device: torch.device | None
    _config: FusionConfig
    _lock: threading.RLock
    _entries: OrderedDict[Key, Entry]
    _routes: dict[Key, Any]  # frames.Route per signature an older compilation serves
    key_for: Callable[..., Key]  # Padding.key_for: the key of a call, padded as it would be

    def mode_for(self, *args: Any) -> str | None:
        """The mode a call with ``args`` would run in now, or None if it would be a miss."""
        key = self.key_for(*args)
        with self._lock:
            entry = self._entries.get(key)
        return None if entry is None else entry.mode.value

    def describe(self) -> list[dict[str, Any]]:
        """One dict per live entry: key (readable), mode, reason, captured, decision (whether
        capture pays, for large outputs: see ``payoff``; when an uncaptured entry is captured),
        hits; then one per signature routed to an older compilation's entry (that entry's
        mode, reason, capture, decision and hits, and ``served_by``: the older cache)."""
        with self._lock:
            items = list(self._entries.items())
            routes = list(self._routes.items())
        rows = [self._row(key, entry) for key, entry in items]
        for key, route in routes:
            older = route.cache
            entry = None if older is None else older._entries.get(route.key)
            if entry is not None:  # gone: the next call makes it again (there or here)
                rows.append({**self._row(key, entry), "served_by": older.label_prefix})
        return rows

    def _row(self, key: Key, entry: Entry) -> dict[str, Any]:
        return {
            "key": self._label(key),
            "mode": entry.mode.value,
            "reason": entry.reason,
            "captured": entry.graph is not None,
            "decision": entry.decision
            or ("timing replay + output copy against direct" if entry.trial else None)
            or (
                f"captured on its call {self._config.capture_on_call} (recurs)"
                if entry.pending
                else None
            ),
            "hits": entry.hits,
        }

    def stats_rows(self) -> list[StatsRow]:
        with self._lock:
            items = list(self._entries.items())
        return [
            StatsRow(self._label(key), shapes(key), entry.mode.value, entry.reason)
            for key, entry in items
        ]

    def _label(self, key: Key) -> str:
        return label(self.label_prefix, self._device, key)
