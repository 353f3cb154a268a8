"""What a graph cache says about itself: its name in logs and readable keys, its one warning
(fallback or eviction), the options it was given that cannot take effect, and its demotions,
counted and logged. The cache, its entry table and its helpers share one ``Logbook``; it
holds no reference to the cache (so a dropped cache is freed at once, not at the next
garbage collection)."""

from __future__ import annotations

import logging

import torch

from fusebackend.runtime.counters import COUNTERS
from fusebackend.runtime.keys import Key, label
from fusebackend.runtime.modes import Cause, Mode, demote

# GraphCache's logger: the cache's parts log under one name.
log = logging.getLogger("fusebackend.runtime.graph_cache")

__all__ = ["Logbook"]


class Logbook:
    """One graph cache's logging state.

    Args:
        name: The cache's name (logs, readable keys).
        label_prefix: ``name#number``: the prefix of readable keys.
        device: The cache's device (None: the CPU); readable keys show other devices.
    """

    __slots__ = ("device", "ignored", "label_prefix", "name", "_warned")

    def __init__(self, name: str, label_prefix: str, device: torch.device | None) -> None:
        self.name = name
        self.label_prefix = label_prefix
        self.device = device
        # Options the user set that cannot take effect on this graph, with the reason:
        # logged once as a warning and listed by stats()["ignored_options"].
        self.ignored: list[str] = []
        self._warned = False  # this cache's one warning (fallback or eviction) was issued

    def label(self, key: Key) -> str:
        """``key`` as logs and ``stats()`` show it (``keys.label``)."""
        return label(self.label_prefix, self.device, key)

    def warn_once(self) -> int:
        """WARNING for this cache's first noteworthy event, INFO after that."""
        if self._warned:
            return logging.INFO
        self._warned = True
        return logging.WARNING

    def ignore(self, why: str) -> None:
        """An option that cannot take effect on this graph: kept and logged as a warning."""
        self.ignored.append(why)
        log.warning("%s: %s", self.name, why)

    def demote(
        self,
        key: Key,
        mode: Mode,
        cause: Cause,
        why: str,
        previous: str | None,
        *,
        captures: bool = True,
    ) -> tuple[Mode, str]:
        """Where ``key`` goes from ``mode`` for ``cause`` and its new reason
        (``modes.demote``); a key that leaves ``fusion`` is counted (``fusion_fallbacks``)."""
        demotion = demote(mode, cause, why, previous, captures=captures)
        if demotion.mode is not mode and mode is Mode.FUSION:
            COUNTERS.fusion_fallbacks += 1
        if cause.logged:
            # One warning per cache (a fault on every one of 300 shapes is one warning, not
            # 600); later events are logged at INFO. Every reason stays in
            # stats()["fallback_reasons"].
            level = self.warn_once()
            if demotion.mode is not mode:
                args = (mode, demotion.mode, self.label(key), demotion.why)
                log.log(level, "%s: %s -> %s for %s: %s", self.name, *args)
            else:
                log.log(level, "%s: %s %s", self.name, self.label(key), demotion.step)
        return demotion.mode, demotion.reason
