"""Process-wide runtime state: event counters, the global fusion switch, the cache registry.

A leaf module: the graph cache increments the counters and registers itself here, and
``stats.py`` reads them, so neither imports the other. Counters are plain integer fields
incremented where the event happens (a capture that succeeded, a key that left "fusion",
...); nothing guesses them after the fact.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

__all__ = [
    "COUNTERS",
    "Counters",
    "EVICTION_REASONS",
    "fusion_enabled",
    "live_caches",
    "register_cache",
    "set_fusion_enabled",
]


@dataclasses.dataclass(slots=True)
class Counters:
    """Event counts since the last ``reset_stats()`` (meanings: see ``stats.stats``)."""

    cache_hits: int = 0
    cache_misses: int = 0
    recordings: int = 0
    fusion_attempts: int = 0
    fusion_successes: int = 0
    fusion_fallbacks: int = 0
    validations: int = 0
    validations_within_noise: int = 0
    validations_nearer_float32: int = 0
    evictions: int = 0
    rerecords: int = 0
    capture_failures: int = 0
    older_graph_calls: int = 0
    replays_on_stale_constants: int = 0

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)
        EVICTION_REASONS.clear()

    def evicted(self, cause: str) -> None:
        """One entry dropped to make room or as stale; ``cause`` names the rule (see
        ``stats.stats``: eviction_reasons)."""
        self.evictions += 1
        EVICTION_REASONS[cause] = EVICTION_REASONS.get(cause, 0) + 1

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# Evictions by cause: "max_graphs", "graph_memory", "superseded", "entry_limit".
EVICTION_REASONS: dict[str, int] = {}

COUNTERS = Counters()

_fusion_enabled = True

# Caches register themselves so clear_cache() and stats() can reach every compiled graph
# without keeping any of them alive. WeakSet iteration is not safe against a concurrent add
# from another thread ("Set changed size during iteration"), hence the lock.
_CACHES: weakref.WeakSet[Any] = weakref.WeakSet()
_CACHES_LOCK = threading.Lock()


def register_cache(cache: Any) -> None:
    """Make a live cache visible to ``stats()`` and ``clear_cache()`` (held weakly)."""
    with _CACHES_LOCK:
        _CACHES.add(cache)


def live_caches() -> list[Any]:
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
