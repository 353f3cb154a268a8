"""What a hit of a captured or pending entry may run instead of a plain replay: the capture
of an uncaptured entry on its ``capture_on_call``-th call (``_promote``), a re-record after a
static input moved (``_rerecord``; an input that keeps moving is copied in from then on),
and the timed calls that decide whether capture pays for large outputs (``_trial_call``,
``payoff.py``). ``GraphCache`` takes these methods from ``Recapture``.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from fusebackend.config import FusionConfig
from fusebackend.runtime import payoff
from fusebackend.runtime.counters import COUNTERS
from fusebackend.runtime.entries import Call, Entry, Verdict
from fusebackend.runtime.keys import Key
from fusebackend.runtime.modes import Cause, Mode

# GraphCache's logger: these are the cache's methods, and its records keep one name.
log = logging.getLogger("fusebackend.runtime.graph_cache")

__all__ = ["Recapture"]

# A static input (used in place: parameters, buffers, KV caches, every mutated input) that
# arrives at a new address on this many consecutive calls is copied in from then on, like any
# other input: an output buffer passed fresh on every call otherwise re-recorded the graph on
# every call. A replay without a move resets the count, so a cache or weights that move once
# (a new StaticCache per generate, a reload) keep being used in place.
_MAX_ADDRESS_CHANGES = 3


class Recapture:
    """The re-capture part of ``GraphCache`` (a mixin: the state below is set by its
    __init__)."""

    name: str
    _config: FusionConfig
    _replay_device: int | None
    _entries: OrderedDict[Key, Entry]
    _moves: dict[int, int]
    _copied_static: set[int]
    _new_entry: Callable[..., Sequence[Any]]
    _replay: Callable[[Entry, Call], Sequence[Any]]
    _direct: Callable[[Callable[..., Sequence[Any]], Call], Sequence[Any]]
    _drop: Callable[[Entry], None]
    _remember: Callable[[Key, Verdict], None]
    _demote: Callable[..., tuple[Mode, str]]
    _warn_once: Callable[[], int]
    _label: Callable[[Key], str]

    def _promote(self, key: Key, entry: Entry, call: Call) -> Sequence[Any]:
        """The ``capture_on_call``-th call of an uncaptured entry: capture it now."""
        del self._entries[key]
        self._drop(entry)
        return self._new_entry(key, Verdict(entry.mode, entry.reason, True, entry.hits), call)

    def _rerecord(self, key: Key, entry: Entry, call: Call) -> Sequence[Any]:
        COUNTERS.rerecords += 1
        args = call.args
        moved = [i for i in entry.static_idx if args[i].data_ptr() != entry.static_ptrs[i]]
        for i in moved:
            self._moves[i] = self._moves.get(i, 0) + 1
            if self._moves[i] == _MAX_ADDRESS_CHANGES:
                self._copied_static.add(i)
                log.log(
                    self._warn_once(),
                    "%s: input %d changed address %d times; it is copied into the captured "
                    "graph from now on instead of re-recording",
                    self.name,
                    i,
                    _MAX_ADDRESS_CHANGES,
                )
        log.info(
            "%s: static input(s) %s changed address; re-recording %s",
            self.name,
            moved,
            self._label(key),
        )
        # Retire the old graph before capturing the new one (freed once replays are past it).
        del self._entries[key]
        self._drop(entry)
        seen = max(entry.hits, self._config.capture_on_call - 1)
        outputs = self._new_entry(key, Verdict(entry.mode, entry.reason, True, seen), call)
        new = self._entries[key]
        new.hits = entry.hits
        if entry.decision is not None and new.trial is not None:
            new.trial, new.decision = None, entry.decision  # "capture pays" was decided: keep it
        return outputs

    def _trial_call(self, key: Key, entry: Entry, call: Call) -> Sequence[Any]:
        """One of the timed calls that decide whether capturing ``key`` pays (``payoff``):
        replayed or run directly, in turn; each call runs the graph once either way."""
        trial = entry.trial
        assert trial is not None
        replayed = trial.next_is_replay()
        if replayed:
            run = functools.partial(self._replay, entry, call)
        else:
            run = functools.partial(self._direct, entry.fn, call)
        outputs, host_s, device_s = payoff.time_call(
            run, self._replay_device, trial.prime_for(replayed)
        )
        trial.add(replayed, host_s, device_s)
        verdict = trial.verdict()
        if verdict is None:
            return outputs
        keep, why = verdict
        log.info("%s: %s %s", self.name, self._label(key), why)
        entry.trial, entry.decision = None, why
        if not keep:
            # Logged above; a fused entry stays in fusion, run directly.
            mode, reason = self._demote(key, entry.mode, Cause.NO_PAYOFF, why, entry.reason)
            self._entries[key] = Entry(
                mode, entry.fn, reason, hits=entry.hits, decision=why, last_use=entry.last_use
            )
            self._remember(key, Verdict(mode, reason, False, entry.hits + 1))
            self._drop(entry)
        return outputs
