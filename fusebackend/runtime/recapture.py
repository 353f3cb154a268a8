"""Making a signature's entry once its call has run (``_settle``: capture it, keep it for a
later call, or fall back; ``_record``), and what a hit of a captured or pending entry may
run instead of a plain replay: the capture of an uncaptured entry on its
``capture_on_call``-th call (``_promote``), a re-record after a static input moved
(``_rerecord``; an input that keeps moving is copied in from then on), and the timed calls
that decide whether capture pays for large outputs (``_trial_call``, ``payoff.py``).
``GraphCache`` takes these methods from ``Recapture``.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusebackend.config import FusionConfig
from fusebackend.runtime import capture as _capture
from fusebackend.runtime import payoff
from fusebackend.runtime.counters import COUNTERS
from fusebackend.runtime.entries import Call, Entry, Verdict
from fusebackend.runtime.keys import Key
from fusebackend.runtime.modes import Cause, Mode
from fusebackend.runtime.recording import capture_blocker, record
from fusebackend.runtime.validation import one_line

# GraphCache's logger: these are the cache's methods, and its records keep one name.
log = logging.getLogger("fusebackend.runtime.graph_cache")

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
    """The re-capture part of ``GraphCache`` (a mixin: the state below is set by its
    __init__)."""

    name: str
    _config: FusionConfig
    _replay_device: int | None
    _entries: OrderedDict[Key, Entry]
    _moves: dict[int, int]
    _copied_static: set[int]
    _per_signature: Callable[..., Sequence[Any]] | None
    _per_signature_count: int
    _new_entry: Callable[..., Sequence[Any]]
    _insert: Callable[[Key, Entry], None]
    _replay: Callable[[Entry, Call], Sequence[Any]]
    _direct: Callable[[Callable[..., Sequence[Any]], Call], Sequence[Any]]
    _drop: Callable[[Entry], None]
    _remember: Callable[[Key, Verdict], None]
    _demote: Callable[..., tuple[Mode, str]]
    _warn_once: Callable[[], int]
    _label: Callable[[Key], str]
    _callable: Callable[[Mode], Callable[..., Sequence[Any]]]
    _device: torch.device | None
    _static: frozenset[int]
    _mutated: tuple[int, ...]
    _host: dict[int, torch.device]
    _static_outputs: bool

    def _promote(self, key: Key, entry: Entry, call: Call) -> Sequence[Any]:
        """The ``capture_on_call``-th call of an uncaptured entry: capture it now. Its
        earlier runs at this signature were the warm-up: where the capture stream is warm
        it is captured straight away and replayed for this call (``_capture_and_replay``),
        else (or if that capture fails) run, then captured, as a new key is."""
        del self._entries[key]
        self._drop(entry)
        replayed = self._capture_and_replay(key, entry, call)
        if replayed is not None:
            return replayed
        return self._new_entry(key, Verdict(entry.mode, entry.reason, True, entry.hits), call)

    def _capture_and_replay(self, key: Key, old: Entry, call: Call) -> Sequence[Any] | None:
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
            entry = self._record(mode, self._callable(mode), args, warmed=True)
        except Exception as exc:
            log.info("%s: %s: capture without a run first failed (%s: %s); run, then capture",
                     self.name, self._label(key), type(exc).__name__, one_line(exc))  # fmt: skip
            return None
        finally:
            _capture.join_replay_order(self._replay_device)
        if self._over_budget(entry) is not None:
            return None
        entry.reason, entry.hits, entry.derived = old.reason, old.hits, call.derived
        self._remember(key, Verdict(mode, old.reason, True, old.hits + 1))
        self._insert(key, entry)
        return self._replay(entry, call)

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
                mode, entry.fn, reason, hits=entry.hits, decision=why, last_use=entry.last_use,
                derived=entry.derived,
            )  # fmt: skip
            self._remember(key, Verdict(mode, reason, False, entry.hits + 1))
            self._drop(entry)
        return outputs

    def _settle(
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
        callable has just run on ``args`` (its capture needs no warm-up: ``_record``)."""
        entry = None
        blocker = capture_blocker(args, self._static, self._mutated) if capture else None
        if blocker is not None:
            capture = False
            # The fused graph runs directly (its kernels need no capture); others go eager.
            mode, reason = self._demote(key, mode, Cause.NOT_CAPTURABLE, blocker, reason)
        if capture and defer:
            return Entry(mode, self._callable(mode), reason, pending=True)
        while entry is None and capture and mode.capturable:
            try:
                entry = self._record(mode, self._callable(mode), args, warmed=mode is warmed)
            except Exception as exc:
                COUNTERS.capture_failures += 1
                why = f"capture failed: {type(exc).__name__}: {one_line(exc)}"
                mode, reason = self._demote(key, mode, Cause.CAPTURE_FAILED, why, reason)
        why = self._over_budget(entry) if entry is not None else None
        if why is not None:
            entry = None
            mode, reason = self._demote(key, mode, Cause.OVER_BUDGET, why, reason)
        if entry is None:
            entry = Entry(mode, self._callable(mode))
        entry.reason = reason
        return entry

    def _over_budget(self, entry: Entry) -> str | None:
        """Why a captured ``entry`` is not kept: its buffers exceed ``graph_memory`` (kept, it
        would evict every other captured entry and then itself at the next capture); its
        graph is then retired. None where it fits."""
        budget = self._config.graph_memory
        if budget is None or entry.nbytes <= budget:
            return None
        _capture.retire(entry.resources(), self._replay_device)
        return f"its buffers ({_mib(entry.nbytes)}) exceed graph_memory ({_mib(budget)})"

    def _derive(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The per-signature inputs for ``args`` (``per_signature``)."""
        assert self._per_signature is not None
        with torch.no_grad():
            derived = tuple(self._per_signature(*args))
        if len(derived) != self._per_signature_count:
            raise RuntimeError(
                f"{self.name}: per_signature gave {len(derived)} values, "
                f"expected {self._per_signature_count}"
            )
        return derived

    def _in_place(self, args: tuple[Any, ...]) -> frozenset[int]:
        """Inputs a capture on ``args`` uses in place: the static ones and the entry's
        per-signature inputs (last in ``args``)."""
        if not self._per_signature_count:
            return self._static
        n = len(args)
        return self._static | frozenset(range(n - self._per_signature_count, n))

    def _record(
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
            copied_static=self._copied_static,
            host=self._host,
            mutated=self._mutated,
            static_outputs=self._static_outputs,
        )
