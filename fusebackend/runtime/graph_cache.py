"""GraphCache: one captured CUDA graph per input signature, with a counted fallback chain.

A compiled graph is wrapped in a ``GraphCache``. Each call builds a signature key
(``keys.Key``: whether the fused graph is selected, then shape, stride, dtype and device of
every non-static tensor input, type and value of every other input). The key picks an
``entries.Entry`` whose ``modes.Mode`` says which callable runs; a new key starts in
``fusion`` when a fused callable exists and fusion is enabled, else in the first unfused
mode, and moves down the chain by ``modes.demote`` (one rule, each step counted, logged and
kept in the entry's reason). A key's ``Verdict`` (success too) is remembered, so a key that
fell back never retries after an eviction, and a returning key is neither validated nor
left uncaptured again.

A key is captured on the call ``recurrence.CaptureCall`` names (by default the 2nd for the
graph's first key and a step of a growing sequence, the 1st for other new keys: a corpus's
lengths, queries); its earlier calls run the graph directly. The fused graph is compared with
the unfused one once per cache and validation class (``keys.plan_class``) until one
comparison matches (``validation.fused_run``). Captured entries are bounded by
bytes across every cache (``eviction.enforce_memory``), with ``max_graphs`` an optional
count cap; a cache drops the entries that older compilations of the same Dynamo frame hold
for the shapes it is now handed (``frames.supersede``). ``length_buckets`` pads the
sequence dim of masked encoders' inputs, checked against the unpadded run on each bucket's
first call.

Captured entries (``recording.record``): static inputs (parameters, buffers, KV caches,
written inputs, and inputs sharing a storage with them) are used in place and their
addresses checked on each hit: a change re-records, and an input that moves on
``recapture._MAX_ADDRESS_CHANGES`` consecutive calls is copied in from then on; others are
copied into static buffers (host inputs through pinned staging) on each replay. Outputs are
copied out unless ``static_outputs`` (``outputs.py``). A hit never synchronizes the host,
except during a large-output trial (``payoff.py``) and when the staging ring is full. Each
call executes the model's in-place effects exactly once (``effects.py``). Captures and
dropped entries are ordered against replays on other streams (``capture.py``).

This module holds the lookup, the replay and direct runs and the handling of a miss (run,
validate, capture or demote, remember). The cache owns its parts, none of which refers back
to it: ``table.EntryTable`` (entries, verdicts, bytes, bounds, evictions, the lock),
``logbook.Logbook``, ``recapture.Recapture``, ``padding.Padding`` and
``inspection.Inspection``. Other modules read only its public surface (``frames.Member``).

Inference only: capture records no autograd graph.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fusebackend.config import FusionConfig
from fusebackend.runtime import capture as _capture
from fusebackend.runtime import frames
from fusebackend.runtime.before_call import BeforeCall
from fusebackend.runtime.buckets import pad, pad_length, symbols_of
from fusebackend.runtime.counters import COUNTERS, register_cache
from fusebackend.runtime.effects import Effects, shared_storages, write_back
from fusebackend.runtime.entries import Call, Entry, StatsRow, Verdict
from fusebackend.runtime.eviction import enforce_memory
from fusebackend.runtime.inspection import Inspection
from fusebackend.runtime.keys import Key, Signatures, plan_class, static_ptrs_equal
from fusebackend.runtime.logbook import Logbook
from fusebackend.runtime.modes import Cause, Mode, first_mode
from fusebackend.runtime.outputs import copy_out
from fusebackend.runtime.padding import Padding
from fusebackend.runtime.recapture import Recapture
from fusebackend.runtime.recurrence import CaptureCall
from fusebackend.runtime.specialization import GraphForm
from fusebackend.runtime.table import EntryTable
from fusebackend.runtime.validation import fused_run, one_line

log = logging.getLogger(__name__)

__all__ = ["EAGER", "FUSION", "GRAPH_REPLAY", "GraphCache", "StatsRow", "captures"]

# The modes by their old names (tests and callers compare them with the strings).
FUSION = Mode.FUSION
GRAPH_REPLAY = Mode.GRAPH_REPLAY
EAGER = Mode.EAGER

# Verdicts (a key's mode, reason and call count, successes included) kept per cache after
# their entries are evicted; a few hundred bytes each. A key seen again finds its verdict:
# no second validation, and it is captured at once (it recurs).
_MAX_VERDICTS = 4096

# Entries kept per cache whatever their memory: an uncaptured entry holds no device memory,
# so graph_memory never evicts it; this bounds the keys and entry objects (~1 KB each) of a
# stream of ever-new shapes.
_MAX_ENTRIES = 4096

_serials = itertools.count()
# Process-wide use clock: each entry's last use, so graph_memory evicts the least recently
# used captured entry of any cache (one counter step per call, no shared structure to move).
_clock = itertools.count(1).__next__


def captures(config: FusionConfig, device: torch.device | None) -> bool:
    """Whether a graph on ``device`` with ``config`` is captured in CUDA graphs."""
    if device is None or device.type != "cuda":
        return False
    return config.cudagraphs is True or (config.cudagraphs is None and torch.cuda.is_available())


class GraphCache:
    """Run a compiled graph through per-signature CUDA graphs, falling back when needed.

    Args:
        unfused: The graph without fusion; returns a tuple or list of outputs.
        fused: The fused graph, or None when nothing was fused.
        config: Options; reads ``cudagraphs``, ``warmup_iterations``, ``max_graphs``,
            ``graph_memory``, ``capture_on_call``, ``batch_buckets``, ``length_buckets``,
            ``static_outputs``, ``validate`` and ``fusion``.
        device: The CUDA device the graph runs on; None for a CPU graph (never captured,
            no CUDA call at all).
        static_input_indices: Inputs used in place (parameters, buffers, KV caches): not
            copied, not padded, not in the key; their addresses are checked on each hit (one
            that moves on consecutive calls is copied in: ``recapture.py``).
        mutated_input_indices: Inputs the graph writes into; the write reaches the caller's
            tensor exactly once per call.
        host_inputs: Input index -> device, for inputs the caller passes on the CPU but the
            graph reads on that device; the copy becomes part of the replayed input copy.
        name: Used in logs and readable keys.
        batch_size_input_indices: Integer inputs that carry the batch size (a dynamic-shape
            symbol); with ``batch_buckets`` they are replaced by the bucket like the padded
            tensors. Other integers are passed unchanged.
        example_values: The graph's inputs as traced (fake tensors with symbolic sizes,
            SymInts), or None (a plain callable: every dim may vary). Buckets pad only dims
            that are dynamic in the graph: a graph traced for batch 3 fails at batch 4.
        form: ``unfused`` without its size arithmetic (``specialization.form_of``), or None:
            with it, a signature that an older compilation of the same function holds is
            routed there when the two compute the same function for it (``frames.route``).
        per_signature: A callable of a call's inputs (after padding) returning the graphs'
            last ``per_signature_count`` inputs, which depend only on the signature (tensors
            built from sizes: relative position buckets). Evaluated once per new entry,
            before its runs and capture; the entry owns the tensors and a captured graph
            reads them in place, so a replay copies nothing. The caller passes the other
            inputs only.
        before_call: Run with each call's inputs (routed calls too): keeps constants the
            fused graph derives from its inputs (folded BatchNorms) in step with them.
        stale_after_replay: Its check (whether it has work): given, a replay of a graph that
            writes no input launches first and checks after (``before_call.py``).
    """

    def __init__(
        self,
        *,
        unfused: Callable[..., Sequence[Any]],
        fused: Callable[..., Sequence[Any]] | None,
        config: FusionConfig,
        device: torch.device | None,
        static_input_indices: frozenset[int] = frozenset(),
        mutated_input_indices: frozenset[int] = frozenset(),
        host_inputs: Mapping[int, torch.device] | None = None,
        name: str = "graph",
        batch_size_input_indices: frozenset[int] = frozenset(),
        example_values: Sequence[Any] | None = None,
        form: GraphForm | None = None,
        per_signature: Callable[..., Sequence[Any]] | None = None,
        per_signature_count: int = 0,
        before_call: Callable[[Sequence[Any]], None] | None = None,
        stale_after_replay: Callable[[Sequence[Any]], bool] | None = None,
    ) -> None:
        if device is not None and device.type != "cuda":
            device = None  # only CUDA graphs are captured; anything else runs directly
        self._unfused = unfused
        self._fused = fused if config.fusion else None
        self._config = config
        self._device = device
        self._static = frozenset(static_input_indices)
        self._mutated = tuple(sorted(mutated_input_indices))
        self._host = dict(host_inputs or {}) if device is not None else {}
        self._per_signature = per_signature if per_signature_count else None
        self._before = BeforeCall(before_call, stale_after_replay, bool(mutated_input_indices))
        self._per_signature_count = per_signature_count if per_signature is not None else 0
        self.name = name
        self.label_prefix = f"{name}#{next(_serials)}"
        self._static_outputs = config.static_outputs
        self._capture = captures(config, device)
        self._logbook = Logbook(name, self.label_prefix, device)
        # Options that cannot take effect on this graph (stats()["ignored_options"]).
        self.ignored_options: list[str] = self._logbook.ignored
        if config.cudagraphs is True and not self._capture:
            self._logbook.ignore(
                "cudagraphs=True has no effect: "
                + ("CUDA is not available" if device is not None else "the graph runs on the CPU")
                + "; nothing is captured"
            )
        # Validation classes (keys.plan_class) whose fused run matched the unfused graph.
        self._validated: set[Key] = set()
        # The use clock at this cache's creation and at its last call (frames.supersede).
        self._last_call = created = _clock()
        self._unpadded_seen: set[Key] = set()  # caller signatures of padded calls (supersede)
        # Signatures served by an older compilation (frames.route).
        self._routes: dict[Key, frames.Route] = {}
        # Device whose replays are ordered across streams (None: test doubles without CUDA).
        self._replay_device: int | None = None
        if self._capture and torch.cuda.is_available():
            index = device.index
            self._replay_device = index if index is not None else torch.cuda.current_device()
        self._table = EntryTable(
            self._logbook, config, replay_device=self._replay_device, max_entries=_MAX_ENTRIES,
            max_verdicts=_MAX_VERDICTS,
        )  # fmt: skip
        # Held for lookup, misses and the whole copy-in/replay/copy-out of captured entries:
        # static buffers are shared by every call of a key. Reentrant: a callable that calls
        # back into this cache (a compiled function calling itself) must not deadlock.
        self._lock = self._table.lock
        self._signatures = Signatures(
            self._static, self._fused is not None, self._capture, frozenset(self._host)
        )
        # Input index -> dynamic-shape symbol of each dim (tensors) or of the value (ints).
        symbols = None if example_values is None else symbols_of(example_values)
        self._padding = Padding(
            config, static=self._static, mutated=self._mutated, symbols=symbols,
            batch_ints=frozenset(batch_size_input_indices), signatures=self._signatures,
            unfused=unfused, table=self._table, logbook=self._logbook,
        )  # fmt: skip
        self._recapture = Recapture(
            config, device=device, replay_device=self._replay_device, capture=self._capture,
            static=self._static, mutated=self._mutated, host=self._host,
            static_outputs=self._static_outputs, per_signature_count=self._per_signature_count,
            unfused=unfused, fused=self._fused, table=self._table, logbook=self._logbook,
        )  # fmt: skip
        self._capture_call = CaptureCall(config.capture_on_call)
        self._inspection = Inspection(
            self._table, self._routes, self._padding.key_for, self._logbook,
            self._capture_call.recurring,
        )  # fmt: skip
        # The Dynamo frame this cache was compiled for (None outside a compile: frames.py).
        compiled = frames.compiling()
        self._identity = frames.Identity(
            frame=compiled[0] if compiled is not None else None, device=device, form=form,
            symbols=symbols, signatures=self._signatures, created=created,
        )  # fmt: skip
        register_cache(self)
        frames.register(self, compiled)
        # A cache collected with live entries (Dynamo recompiled, the model was deleted) lets
        # them go through retire like an eviction: a replay queued on another stream may still
        # read their buffers, which freeing them at once would hand to other tensors.
        weakref.finalize(self, self._table.retire)

    # ------------------------------------------------------------------- public surface

    @property
    def identity(self) -> frames.Identity:
        """What this cache is, fixed at its creation (frame, device, form, ...: ``frames``)."""
        return self._identity

    @property
    def table(self) -> EntryTable:
        """Its entries, verdicts and captured bytes (``eviction.py``, ``frames.py``)."""
        return self._table

    @property
    def last_call(self) -> int:
        """The process-wide use clock at its last call (``frames.supersede``)."""
        return self._last_call

    @property
    def bucketed(self) -> bool:
        """Whether its keys are padded shapes (batch or length buckets in use)."""
        return self._padding.bucketed

    @property
    def copied_static(self) -> frozenset[int]:
        """Static inputs copied in from now on (they moved on consecutive calls)."""
        return frozenset(self._recapture.copied_static)

    def routed_call(self, args: tuple[Any, ...]) -> Sequence[Any]:
        """A call handed over by a newer compilation of the same function (``frames.route``),
        its inputs as this graph takes them."""
        return self._call(args)

    def key_for(self, *args: Any) -> Key:
        """The cache key a call with ``args`` uses (after length- and batch-bucket padding)."""
        return self._padding.key_for(*args)

    def mode_for(self, *args: Any) -> str | None:
        """The mode a call with ``args`` would run in now, or None if it would be a miss."""
        return self._inspection.mode_for(*args)

    def describe(self) -> list[dict[str, Any]]:
        """One dict per live entry and per routed signature (``Inspection.describe``)."""
        return self._inspection.describe()

    def stats_rows(self) -> list[StatsRow]:
        """One row per live entry (``stats()``)."""
        return self._inspection.stats_rows()

    # ----------------------------------------------------------------------------- hot path

    def __call__(self, *args: Any) -> Sequence[Any]:
        padding = self._padding
        if padding.lengths is not None:
            if not padding.lengths_checked:
                padding.check_lengths(args)
            if padding.length_plan is not None:
                padded = pad_length(args, padding.length_plan, padding.lengths)
                if padded is not None:
                    return padding.length_call(args, *padded, self._call, self._direct)
        return self._call(args)

    def _call(
        self, args: tuple[Any, ...], original: tuple[Any, ...] | None = None
    ) -> Sequence[Any]:
        """A call with ``args`` (``original``: the caller's, before length padding)."""
        deferred = self._before.start(args)  # (deferred: checked after a replay's launch)
        user_args = args
        batch = bucket = None
        padding = self._padding
        if padding.buckets is not None:
            if not padding.buckets_checked:
                padding.check_buckets(args)
            # Padding copies each input on its own: inputs sharing a storage with a written
            # one would lose the write through the other, so such a call runs unpadded.
            buckets = padding.buckets  # None once the first call found a static batch dim
            if buckets is not None and not (self._mutated and shared_storages(args, self._mutated)):
                args, batch, bucket = pad(args, buckets, self._static, padding.batch_ints)
        key = self._signatures.key(args)
        found = self._routes.get(key) if self._routes else None
        if found is not None:
            deferred = self._before.settle(deferred, args)
            routed = self._routed(found, key, args)
            if routed is not None:
                return routed
        call = Call(args, user_args, batch, bucket)
        given = original if original is not None else user_args
        with self._lock:
            entry = self._table.get(key)
            if deferred and (entry is None or entry.graph is None or entry.pending
                             or entry.trial is not None):  # fmt: skip
                deferred = self._before.settle(deferred, args)  # (not a plain replay)
            if given is not args and self._identity.frame is not None:
                # A padded call: an older compilation may hold the caller's own shapes even
                # when this padded key is a hit here (its bucket served other sizes first).
                self._supersede_unpadded(given)
            if entry is None:
                verdict = self._table.verdict(key)
                seen = 0
                if verdict is None and self._identity.frame is not None:
                    # An older compilation that holds this signature serves it (and counts
                    # it); else this one takes the older ones' entries for it over.
                    found = frames.route(self, key, args)
                    if found is not None:
                        if len(self._routes) >= _MAX_VERDICTS:
                            del self._routes[next(iter(self._routes))]
                        self._routes[key] = found
                        routed = self._routed(found, key, args)
                        if routed is not None:
                            return routed
                    seen = frames.supersede(self, key)
                COUNTERS.cache_misses += 1
                return self._new_entry(key, verdict, call, seen)
            self._table.touch(key)
            if entry.derived:
                call = call.with_derived(entry.derived)
            COUNTERS.cache_hits += 1
            entry.hits += 1
            entry.last_use = self._last_call = _clock()
            if entry.pending and entry.hits + 1 >= self._capture_call.recurring:
                return self._recapture.promote(
                    key, entry, call, self._new_entry, self._insert, self._replay
                )
            if entry.graph is not None:
                if entry.static_idx and not static_ptrs_equal(
                    call.args, entry.static_ptrs, entry.static_idx
                ):
                    self._before.settle(deferred, args)
                    return self._recapture.rerecord(key, entry, call, self._new_entry)
                moves = self._recapture.moves
                if moves:
                    moves.clear()  # moves must be consecutive to stop in-place use
                if entry.trial is not None:
                    return self._recapture.trial_call(key, entry, call, self._replay, self._direct)
                outputs = self._replay(entry, call)
                if self._before.stale_after(deferred, args):
                    COUNTERS.replays_on_stale_constants += 1
                    outputs = self._replay(entry, call)
                return outputs
        # Direct entries share no buffers between calls: run outside the lock.
        if entry.mode is not FUSION:
            return self._direct(entry.fn, call)
        try:
            return self._direct(entry.fn, call)
        except Exception as exc:
            if self._mutated:  # the fused graph may have written half its mutations
                raise
            # The unfused graph tells the model's own errors (it fails too: the fused error,
            # which names the bad value, is raised) from a failing fused kernel (fall back,
            # once, with the reason).
            try:
                outputs = self._direct(self._unfused, call)
            except Exception:
                raise exc from None
            log.debug("the fused graph's error, in full", exc_info=exc)
            with self._lock:
                why = f"fused graph raised {type(exc).__name__}: {one_line(exc)}"
                # An entry the large-output trial left uncaptured runs directly from now on.
                mode, reason = self._logbook.demote(
                    key,
                    FUSION,
                    Cause.FUSED_FAILED,
                    why,
                    entry.reason,
                    captures=self._capture and entry.decision is None,
                )
                capture = entry.pending and self._capture and mode.capturable
                entry.mode, entry.fn, entry.reason = mode, self._unfused, reason
                entry.pending = capture
                self._table.remember(key, Verdict(mode, reason, capture, entry.hits + 1))
            return outputs

    def _routed(self, found: frames.Route, key: Key, args: tuple[Any, ...]) -> Sequence[Any] | None:
        """The outputs of the older compilation ``key`` is routed to (``frames.route``), or
        None where that compilation is gone (the route is dropped)."""
        outputs = found.call(args)
        if outputs is None:
            self._routes.pop(key, None)
            return None
        COUNTERS.older_graph_calls += 1
        return outputs

    def _replay(self, entry: Entry, call: Call) -> Sequence[Any]:
        if self._replay_device is None:
            return self._enqueue_replay(entry, call)
        with _capture.replay_lock():
            _capture.wait_for_last_replay(self._replay_device)
            return self._enqueue_replay(entry, call)

    def _enqueue_replay(self, entry: Entry, call: Call) -> Sequence[Any]:
        """Copy the inputs in, replay, write mutations back, copy the outputs out: all
        queued on the caller's current stream."""
        args, user_args, batch, bucket = call.args, call.user_args, call.batch, call.bucket
        if entry.copy_bufs:
            # One call for all inputs (a single multi-tensor kernel where dtypes agree).
            torch._foreach_copy_(entry.copy_bufs, [args[i] for i in entry.copy_idx])
        for i, buf, ring in entry.host_copies:
            ring.copy(buf, args[i])
        entry.graph.replay()
        if entry.written:
            write_back(entry.written, entry.buffers_by_index, user_args)
        result, copied = [], []  # copied: where result holds a graph buffer, to copy out
        for out, alias in zip(entry.outputs, entry.aliases, strict=True):
            if alias is None and isinstance(out, Tensor):
                if bucket is not None and out.dim() and out.shape[0] == bucket:
                    out = out[:batch]
                copied.append(len(result))
            result.append(out if alias is None else user_args[alias])
        if copied and not self._static_outputs:
            copy_out(result, copied)
        return tuple(result) if entry.out_tuple else result

    def _direct(self, fn: Callable[..., Sequence[Any]], call: Call) -> Sequence[Any]:
        if self._per_signature is not None and not call.derived:
            call = call.with_derived(self._derive(call.args))  # a one-off run (a reference)
        args = self._to_device(call.args) if self._host else call.args
        outputs = fn(*args)
        if args is not call.user_args:
            write_back(self._mutated, args, call.user_args)
        return call.unpad(outputs)

    # ------------------------------------------------------------------------ miss handling

    def _new_entry(
        self, key: Key, verdict: Verdict | None, call: Call, seen: int = 0
    ) -> Sequence[Any]:
        """A call of a signature without a live entry (its first, again after an eviction, a
        re-record, or the call that captures it): run the graph (a new fused key validated
        unless its class already matched), capture it from its ``capture_on_call``-th call,
        and commit the call's in-place effects into the caller's tensors once, last
        (``effects.Effects``). ``seen``: calls of this signature known from elsewhere (an
        older compilation of the same function that served it)."""
        if self._per_signature is not None and not call.derived:
            # Once per entry, before its runs and capture: host work and its copy to the
            # device, as eager does them, into tensors the entry owns.
            call = call.with_derived(self._derive(call.args))
        args = call.args
        if verdict is not None:
            mode, reason, capture = verdict.mode, verdict.reason, verdict.capture
            seen = max(seen, verdict.calls)
        else:
            mode, reason, capture = first_mode(key.fused, self._capture), None, True
        calls = seen + 1
        capture = capture and self._capture and mode.capturable
        # The call that captures this signature (recurrence.py says which and why).
        defer = capture and calls < self._capture_call.first_miss(key)
        capture_now = capture and not defer
        if capture_now:
            _capture.join_replay_order(self._replay_device)
        effects = Effects(self._to_device(args) if self._host else args, self._mutated)
        ran = mode  # the mode whose callable runs now (a capture's warm-up: Recapture.record)
        if mode is FUSION:
            outputs, winner, failure = self._fused_run(key, effects, first=verdict is None)
            if failure is not None:
                mode, reason = self._logbook.demote(
                    key, mode, Cause.FUSED_FAILED, failure, reason, captures=self._capture
                )
        else:
            winner = effects.isolate()
            outputs = self._recapture.callable(mode)(*winner)
        effects.release()
        try:
            # Warm-up and capture write mutated static inputs (parameters, buffers, a KV
            # cache marked static) in place; the commit below overwrites whatever they did.
            # The run above, at this signature, is the capture's warm-up where the capture
            # stream is set up (Recapture.record).
            entry = self._recapture.settle(key, mode, reason, capture, defer, args, warmed=ran)
        finally:
            effects.commit(winner, call.user_args)
            if capture_now:
                _capture.join_replay_order(self._replay_device)
        entry.hits = calls - 1
        entry.derived = call.derived
        self._table.remember(
            key, Verdict(entry.mode, entry.reason, entry.graph is not None or entry.pending, calls)
        )
        self._insert(key, entry)
        return call.unpad(effects.own_outputs(outputs, winner, call.user_args))

    def _fused_run(
        self, key: Key, effects: Effects, first: bool
    ) -> tuple[Sequence[Any], list[Any], str | None]:
        """Run the fused callable once (``validation.fused_run``); the key's first run in
        this cache is compared with the unfused graph (``validate``) unless another key of
        its validation class (``keys.plan_class``: the same graph at other sizes) already
        matched."""
        assert self._fused is not None
        cls = plan_class(key)
        validate = first and self._config.validate and cls not in self._validated
        outputs, winner, failure = fused_run(
            self._fused, self._unfused, effects, self._device, first=first, validate=validate
        )
        if validate and failure is None:
            self._validated.add(cls)
        return outputs, winner, failure

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

    def _insert(self, key: Key, entry: Entry) -> None:
        """Add ``key``'s entry to the table (bounded by count there) as just used, then keep
        the captured entries of every cache within ``graph_memory``."""
        entry.last_use = self._last_call = _clock()
        self._table.insert(key, entry)
        if entry.nbytes and self._config.graph_memory is not None:
            enforce_memory(self._config.graph_memory, self._table, key)

    def _supersede_unpadded(self, given: tuple[Any, ...]) -> None:
        """Once per caller signature of padded calls: drop older compilations' entries for
        the caller's own shapes (``frames.supersede``), hit or miss of the padded key."""
        own = self._signatures.key(given)
        if own in self._unpadded_seen:
            return
        if len(self._unpadded_seen) >= _MAX_VERDICTS:
            self._unpadded_seen.clear()
        self._unpadded_seen.add(own)
        frames.supersede(self, own)

    # ------------------------------------------------------------------------- arg plumbing

    def _to_device(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        moved = list(args)
        for i, device in self._host.items():
            if i < len(args) and isinstance(args[i], Tensor) and args[i].device.type == "cpu":
                moved[i] = args[i].to(device, non_blocking=True)
        return tuple(moved)

    # ---------------------------------------------------------------------------- controls

    def __len__(self) -> int:
        return len(self._table)

    def clear(self) -> None:
        """Drop every entry (captured graphs, static buffers) and every fallback verdict."""
        with self._lock:
            self._table.clear()
            self._validated.clear()
            self._padding.clear()
            self._unpadded_seen.clear()
            self._recapture.clear()
            self._capture_call.clear()

    def __repr__(self) -> str:
        return (
            f"GraphCache({self.label_prefix}, device={self._device}, "
            f"capture={self._capture}, entries={len(self._table)})"
        )
