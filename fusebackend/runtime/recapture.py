"""Making a signature's entry once its call has run (``settle``: capture it, keep it for a
later call, or fall back; ``record``), and what a hit of a captured or pending entry may
run instead of a plain replay: the capture of an uncaptured entry when it recurs
(``promote``, on the call ``recurrence.CaptureCall.recurring`` names), a re-record after a
static input moved (``rerecord``; an input that keeps moving is copied in from then on), and
the timed calls that decide whether capture pays for large outputs (``trial_call``,
``payoff.py``).

A ``GraphCache`` owns one ``Recapture``. It holds no reference to the cache (a cycle would
leave a dropped cache's graphs to the next garbage collection): the cache's own steps it
needs (run a new entry, insert, replay, run directly) are passed to each method.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fusebackend.config import FusionConfig
from fusebackend.runtime import capture as _capture
from fusebackend.runtime import payoff
from fusebackend.runtime.counters import COUNTERS
from fusebackend.runtime.entries import Call, Entry, Verdict
from fusebackend.runtime.keys import Key
from fusebackend.runtime.logbook import Logbook
from fusebackend.runtime.modes import Cause, Mode
from fusebackend.runtime.recording import capture_blocker, record
from fusebackend.runtime.recurrence import recurring_call
from fusebackend.runtime.table import EntryTable
from fusebackend.runtime.validation import one_line

# GraphCache's logger: the cache's parts log under one name.
log = logging.getLogger("fusebackend.runtime.graph_cache")

# The cache's steps a method here may take (bound methods of the cache, passed per call).
NewEntry = Callable[[Key, Verdict, Call], Sequence[Any]]  # GraphCache._new_entry
Insert = Callable[[Key, Entry], None]  # GraphCache._insert
Replay = Callable[[Entry, Call], Sequence[Any]]  # GraphCache._replay
Direct = Callable[[Callable[..., Sequence[Any]], Call], Sequence[Any]]  # GraphCache._direct

__all__ = ["Recapture"]

# A static input (used in place: parameters, buffers, KV caches, every mutated input) that
# arrives at a new address on this many consecutive calls is copied in from then on, like any
# other input: an output buffer passed fresh on every call otherwise re-recorded the graph on
# every call. A replay without a move resets the count, so a cache or weights that move once
# (a new StaticCache per generate, a reload) keep being used in place.
_MAX_ADDRESS_CHANGES = 3


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class Recapture:
    """How a graph cache makes and re-makes captured entries.

    Args:
        config: Reads ``warmup_iterations``, ``graph_memory`` and ``capture_on_call``.
        device: The CUDA device (None: a CPU graph, never captured).
        replay_device: Device whose replays are ordered across streams (None: no order).
        capture: Whether the cache captures at all (``graph_cache.captures``).
        static: Inputs used in place.
        mutated: Inputs the graph writes.
        host: Input index -> device, for inputs passed on the CPU (staged in).
        static_outputs: Replays hand out the static output buffers (no clone).
        per_signature_count: How many last inputs are per-signature (used in place).
        unfused: The unfused graph.
        fused: The fused graph, or None.
        table: The cache's entries and verdicts.
        logbook: The cache's logs, readable keys and demotions.

    ``moves`` counts each static input's consecutive address changes (a replay without a move
    clears it); ``copied_static`` holds those copied in from then on.
    """

    def __init__(
        self,
        config: FusionConfig,
        *,
        device: torch.device | None,
        replay_device: int | None,
        capture: bool,
        static: frozenset[int],
        mutated: tuple[int, ...],
        host: Mapping[int, torch.device],
        static_outputs: bool,
        per_signature_count: int,
        unfused: Callable[..., Sequence[Any]],
        fused: Callable[..., Sequence[Any]] | None,
        table: EntryTable,
        logbook: Logbook,
    ) -> None:
        self._config = config
        self._device = device
        self._replay_device = replay_device
        self._capture = capture
        self._static = static
        self._mutated = mutated
        self._host = host
        self._static_outputs = static_outputs
        self._per_signature_count = per_signature_count
        self._unfused = unfused
        self._fused = fused
        self._table = table
        self._logbook = logbook
        # Static inputs seen at a new address too often: copied in like the others (their
        # values are still read on every call: only where the graph reads them changes).
        self.moves: dict[int, int] = {}
        self.copied_static: set[int] = set()

    def clear(self) -> None:
        """Forget the address moves (``GraphCache.clear``)."""
        self.moves.clear()
        self.copied_static.clear()

    def callable(self, mode: Mode) -> Callable[..., Sequence[Any]]:
        """The callable ``mode`` runs (the fused graph or the unfused one)."""
        fn = self._fused if mode.fused else self._unfused
        assert fn is not None
        return fn

    def promote(
        self, key: Key, entry: Entry, call: Call, new_entry: NewEntry, insert: Insert,
        replay: Replay,
    ) -> Sequence[Any]:  # fmt: skip
        """The recurring call of an uncaptured entry (``CaptureCall``): capture it now. Its
        earlier runs at this signature were the warm-up: where the capture stream is warm
        it is captured straight away and replayed for this call (``_capture_and_replay``),
        else (or if that capture fails) run, then captured, as a new key is."""
        self._table.remove(key)
        replayed = self._capture_and_replay(key, entry, call, insert, replay)
        if replayed is not None:
            return replayed
        return new_entry(key, Verdict(entry.mode, entry.reason, True, entry.hits), call)

    def _capture_and_replay(
        self, key: Key, old: Entry, call: Call, insert: Insert, replay: Replay
    ) -> Sequence[Any] | None:
        """Capture ``old``'s mode on this call's inputs without running it first, insert the
        entry and replay it for the call's outputs (the replay runs the call's in-place
        effects once, as any replay does); None where that is not done (a cold capture
        stream, a capture blocker, a failed or over-budget capture: the caller runs the
        usual path). One direct run fewer per captured signature, and the graph's first
        replay, which costs far more host time than the next ones, falls in the call that
        captures it."""
        mode = old.mode
        args = call.args
        if not (self._capture and mode.capturable and self._device is not None):
            return None
        if not _capture.side_stream_warm(self._device):
            return None
        if capture_blocker(args, self._static, self._mutated) is not None:
            return None
        _capture.join_replay_order(self._replay_device)
        try:
            entry = self.record(mode, self.callable(mode), args, warmed=True)
        except Exception as exc:
            log.info("%s: %s: capture without a run first failed (%s: %s); run, then capture",
                     self._logbook.name, self._logbook.label(key), type(exc).__name__,
                     one_line(exc))  # fmt: skip
            return None
        finally:
            _capture.join_replay_order(self._replay_device)
        if self.over_budget(entry) is not None:
            return None
        entry.reason, entry.hits, entry.derived = old.reason, old.hits, call.derived
        self._table.remember(key, Verdict(mode, old.reason, True, old.hits + 1))
        insert(key, entry)
        return replay(entry, call)

    def rerecord(self, key: Key, entry: Entry, call: Call, new_entry: NewEntry) -> Sequence[Any]:
        """A hit whose static input(s) moved: capture ``key`` again (``new_entry``); an input
        that moved on ``_MAX_ADDRESS_CHANGES`` consecutive calls is copied in from now on."""
        COUNTERS.rerecords += 1
        args = call.args
        book = self._logbook
        moved = [i for i in entry.static_idx if args[i].data_ptr() != entry.static_ptrs[i]]
        for i in moved:
            self.moves[i] = self.moves.get(i, 0) + 1
            if self.moves[i] == _MAX_ADDRESS_CHANGES:
                self.copied_static.add(i)
                log.log(
                    book.warn_once(),
                    "%s: input %d changed address %d times; it is copied into the captured "
                    "graph from now on instead of re-recording",
                    book.name,
                    i,
                    _MAX_ADDRESS_CHANGES,
                )
        log.info(
            "%s: static input(s) %s changed address; re-recording %s",
            book.name,
            moved,
            book.label(key),
        )
        # Retire the old graph before capturing the new one (freed once replays are past it).
        self._table.remove(key)
        seen = max(entry.hits, recurring_call(self._config.capture_on_call) - 1)  # at once
        outputs = new_entry(key, Verdict(entry.mode, entry.reason, True, seen), call)
        new = self._table[key]
        new.hits = entry.hits
        if entry.decision is not None and new.trial is not None:
            new.trial, new.decision = None, entry.decision  # "capture pays" was decided: keep it
        return outputs

    def trial_call(
        self, key: Key, entry: Entry, call: Call, replay: Replay, direct: Direct
    ) -> Sequence[Any]:
        """One of the timed calls that decide whether capturing ``key`` pays (``payoff``):
        replayed or run directly, in turn; each call runs the graph once either way."""
        trial = entry.trial
        assert trial is not None
        replayed = trial.next_is_replay()
        if replayed:
            run = functools.partial(replay, entry, call)
        else:
            run = functools.partial(direct, entry.fn, call)
        outputs, host_s, device_s = payoff.time_call(
            run, self._replay_device, trial.prime_for(replayed)
        )
        trial.add(replayed, host_s, device_s)
        verdict = trial.verdict()
        if verdict is None:
            return outputs
        keep, why = verdict
        log.info("%s: %s %s", self._logbook.name, self._logbook.label(key), why)
        entry.trial, entry.decision = None, why
        if not keep:
            # Logged above; a fused entry stays in fusion, run directly.
            mode, reason = self._logbook.demote(key, entry.mode, Cause.NO_PAYOFF, why, entry.reason)
            uncaptured = Entry(
                mode, entry.fn, reason, hits=entry.hits, decision=why, last_use=entry.last_use,
                derived=entry.derived,
            )  # fmt: skip
            self._table.replace(key, entry, uncaptured)
            self._table.remember(key, Verdict(mode, reason, False, entry.hits + 1))
        return outputs

    def settle(
        self,
        key: Key,
        mode: Mode,
        reason: str | None,
        capture: bool,
        defer: bool,
        args: tuple[Any, ...],
        warmed: Mode | None = None,
    ) -> Entry:
        """Make the entry for ``key`` starting from ``mode``: capture (or, with ``defer``, an
        uncaptured entry captured on a later call), or fall back. ``warmed``: the mode whose
        callable has just run on ``args`` (its capture needs no warm-up: ``record``)."""
        entry = None
        demote = self._logbook.demote
        blocker = capture_blocker(args, self._static, self._mutated) if capture else None
        if blocker is not None:
            capture = False
            # The fused graph runs directly (its kernels need no capture); others go eager.
            mode, reason = demote(key, mode, Cause.NOT_CAPTURABLE, blocker, reason)
        if capture and defer:
            return Entry(mode, self.callable(mode), reason, pending=True)
        while entry is None and capture and mode.capturable:
            try:
                entry = self.record(mode, self.callable(mode), args, warmed=mode is warmed)
            except Exception as exc:
                COUNTERS.capture_failures += 1
                why = f"capture failed: {type(exc).__name__}: {one_line(exc)}"
                mode, reason = demote(key, mode, Cause.CAPTURE_FAILED, why, reason)
        why = self.over_budget(entry) if entry is not None else None
        if why is not None:
            entry = None
            mode, reason = demote(key, mode, Cause.OVER_BUDGET, why, reason)
        if entry is None:
            entry = Entry(mode, self.callable(mode))
        entry.reason = reason
        return entry

    def over_budget(self, entry: Entry) -> str | None:
        """Why a captured ``entry`` is not kept: its buffers exceed ``graph_memory`` (kept, it
        would evict every other captured entry and then itself at the next capture); its
        graph is then retired. None where it fits."""
        budget = self._config.graph_memory
        if budget is None or entry.nbytes <= budget:
            return None
        _capture.retire(entry.resources(), self._replay_device)
        return f"its buffers ({_mib(entry.nbytes)}) exceed graph_memory ({_mib(budget)})"

    def _in_place(self, args: tuple[Any, ...]) -> frozenset[int]:
        """Inputs a capture on ``args`` uses in place: the static ones and the entry's
        per-signature inputs (last in ``args``)."""
        if not self._per_signature_count:
            return self._static
        n = len(args)
        return self._static | frozenset(range(n - self._per_signature_count, n))

    def record(
        self, mode: Mode, fn: Callable[..., Sequence[Any]], args: tuple[Any, ...], warmed: bool
    ) -> Entry:
        """Capture ``fn`` on ``args``. ``warmed``: ``fn`` has just run on ``args`` (this
        call's direct run): where the capture stream is set up, that run is the warm-up.
        Measured on an H100 (benchmarks/diag/diag_sentence_passes.py, MiniLM-L6 shape,
        2026-11-26): a capture took 10.6 ms with its warm-up run and 5.9 ms without."""
        assert self._device is not None
        skip = warmed and _capture.side_stream_warm(self._device)
        return record(
            mode,
            fn,
            args,
            device=self._device,
            warmup_iterations=0 if skip else self._config.warmup_iterations,
            static=self._in_place(args),
            copied_static=self.copied_static,
            host=self._host,
            mutated=self._mutated,
            static_outputs=self._static_outputs,
        )
