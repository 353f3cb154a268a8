"""GraphCache: one captured CUDA graph per input signature, with a counted fallback chain.

A compiled graph is wrapped in a ``GraphCache``. Each call builds a signature key (a plain
tuple: shape, stride, dtype and device of every non-static tensor input, type and value of
every other input, and whether the fused graph is selected). The key picks an entry whose
mode says how the call runs:

    "fusion"        the fused callable; captured in a CUDA graph when capture is on
    "graph_replay"  the unfused callable, captured (capture on only)
    "eager"         the unfused callable, run directly

A new key starts in "fusion" when a fused callable exists and fusion is enabled, else in the
first unfused mode. It moves down the chain with each reason recorded and logged:
the fused callable raises on its first run or (``validate``) its outputs differ from the
unfused ones -> unfused; a capture fails (host sync such as ``.item()``, CPU tensors,
out of memory) -> "graph_replay" from "fusion", "eager" from "graph_replay". A key's
verdict (success too) is remembered, so a key that fell back never retries after an
eviction, and a returning key is neither validated nor left uncaptured again.

What a new shape costs (shapes that keep changing: a corpus sorted by length, one query at a
time): a key is captured on its ``capture_on_call``-th call (2 by default), its earlier
calls run the graph directly, so a shape seen once costs one run, not warm-up + capture; a
decode step (the same key every call) is captured on its 2nd call. The fused graph is
compared with the unfused one once per cache and validation class (``keys.plan_class``:
the inputs' dtypes, ranks and layouts, not their sizes) until one comparison matches.
Captured entries are bounded by bytes across every cache (``graph_memory``, least recently
used first), with ``max_graphs`` an optional count cap; a cache drops the entries that
older compilations of the same Dynamo frame hold for the shapes it is now handed
(``_supersede``). ``length_buckets`` pads the sequence dim of masked encoders' inputs,
checked against the unpadded run on each bucket's first call.

Captured entries: warm-up runs on a side stream, capture goes into one memory pool shared
by all graphs of the device (``torch.cuda.graph_pool_handle()``). Non-static tensor inputs
are copied into static buffers on each replay; static inputs (parameters, buffers, KV caches,
written inputs, and inputs sharing a storage with them) are used in place and their
addresses checked on each hit: a change re-records, and an input that moves on
``_MAX_ADDRESS_CHANGES`` consecutive calls is copied in from then on. CPU inputs the graph
wants on the device (``host_inputs``) are copied through pinned staging buffers without a
host sync. Outputs are cloned unless ``static_outputs``. A hit never synchronizes the host,
except during a large-output trial (below) and when the staging ring is full.

Each call executes the model's in-place effects exactly once: a new key's call runs its
graph on private copies of the mutated inputs, captures, and commits the winning run's
values into the caller's tensors last (``effects.py``). A key whose outputs are large times
replay + copy against a direct run on its first calls and keeps the cheaper (``payoff.py``).
Captures and dropped entries are ordered against replays on other streams (``capture.py``).

Inference only: capture records no autograd graph.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fusebackend.config import FusionConfig
from fusebackend.runtime import capture as _capture
from fusebackend.runtime import payoff
from fusebackend.runtime.buckets import (
    LengthInputs,
    length_inputs,
    pad,
    pad_length,
    slice_length,
    slice_outputs,
)
from fusebackend.runtime.counters import COUNTERS, live_caches, register_cache
from fusebackend.runtime.effects import (
    Effects,
    RngState,
    shared_storages,
    storage_ptr,
    write_back,
)
from fusebackend.runtime.keys import (
    Key,
    Signatures,
    label,
    plan_class,
    shapes,
    static_ptrs_equal,
    tensor_signature,
)
from fusebackend.runtime.staging import PinnedRing
from fusebackend.runtime.validation import mismatch, one_line

log = logging.getLogger(__name__)

__all__ = ["EAGER", "FUSION", "GRAPH_REPLAY", "GraphCache", "StatsRow", "captures"]

FUSION = "fusion"
GRAPH_REPLAY = "graph_replay"
EAGER = "eager"

# Verdicts (a key's mode, reason and call count, successes included) kept per cache after
# their entries are evicted; a few hundred bytes each. A key seen again finds its verdict:
# no second validation, and it is captured at once (it recurs).
_MAX_VERDICTS = 4096

# Entries kept per cache whatever their memory: an uncaptured entry holds no device memory,
# so graph_memory never evicts it; this bounds the keys and entry objects (~1 KB each) of a
# stream of ever-new shapes.
_MAX_ENTRIES = 4096

# A static input (used in place: parameters, buffers, KV caches, every mutated input) that
# arrives at a new address on this many consecutive calls is copied in from then on, like any
# other input: an output buffer passed fresh on every call otherwise re-recorded the graph on
# every call. A replay without a move resets the count, so a cache or weights that move once
# (a new StaticCache per generate, a reload) keep being used in place.
_MAX_ADDRESS_CHANGES = 3

_serials = itertools.count()
# Process-wide use clock: each entry's last use, so graph_memory evicts the least recently
# used captured entry of any cache (one counter step per call, no shared structure to move).
_clock = itertools.count(1).__next__

# Caches by the Dynamo frame they were compiled for, in compile order (see _supersede).
_FRAMES: dict[Any, list[weakref.ref[GraphCache]]] = {}
_FRAMES_LOCK = threading.Lock()


class _Verdict(NamedTuple):
    """A key's remembered outcome: its mode and reason, whether it may be captured, and how
    many calls it has had (a key that returns after an eviction recurs: captured at once)."""

    mode: str
    reason: str | None
    capture: bool
    calls: int


def _compile_frame() -> tuple[Any, Any] | None:
    """(frame, compilation of that frame) of the Dynamo compile in progress, or None outside
    one (a cache built directly). The frame stands for the compiled function; Dynamo numbers
    its recompiles 0, 1, ... (``torch._dynamo.reset()`` starts frames again at 0)."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except Exception:  # an older or newer torch without it: no supersession
        return None
    frame = getattr(compile_id, "frame_id", None)
    if frame is None:
        return None
    # explain() compiles the same frame again with its own backend in an isolated recompile
    # slot (-1 outside one): keyed by frame alone, its graph superseded the user's and their
    # next call of that shape missed.
    isolate = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_isolate_recompiles_id", None)
    slot = isolate() if isolate is not None else -1
    return (frame, slot), getattr(compile_id, "frame_compile_id", None)


class StatsRow(NamedTuple):
    label: str
    shapes: tuple[tuple[int, ...], ...]
    mode: str
    reason: str | None


@dataclasses.dataclass(eq=False, slots=True)
class _Entry:
    mode: str
    fn: Callable[..., Sequence[Any]]
    reason: str | None = None
    graph: Any = None  # torch.cuda.CUDAGraph (or a test double with .replay()), None if direct
    copy_idx: tuple[int, ...] = ()  # inputs copied into static buffers on each replay
    copy_bufs: list[Tensor] = dataclasses.field(default_factory=list)  # their buffers
    host_copies: tuple[tuple[int, Tensor, PinnedRing], ...] = ()
    written: tuple[int, ...] = ()  # mutated inputs copied in: written back after each replay
    buffers_by_index: dict[int, Tensor] = dataclasses.field(default_factory=dict)  # their buffers
    static_idx: list[int] = dataclasses.field(default_factory=list)
    static_ptrs: list[int | None] = dataclasses.field(default_factory=list)
    outputs: Sequence[Any] = ()
    aliases: tuple[int | None, ...] = ()  # output j is input aliases[j] itself
    out_tuple: bool = True
    hits: int = 0
    trial: payoff.CaptureTrial | None = None  # large outputs: does capture pay? (timing)
    decision: str | None = None  # the trial's outcome
    pending: bool = False  # uncaptured until its capture_on_call-th call
    nbytes: int = 0  # device memory it holds alone (static input and output buffers)
    last_use: int = 0  # the process-wide use clock at its last call

    def resources(self) -> list[Any]:
        """What a queued replay may still read: held by ``capture.retire`` once dropped."""
        return [self.graph, self.copy_bufs, self.host_copies, self.outputs]


def captures(config: FusionConfig, device: torch.device | None) -> bool:
    """Whether a graph on ``device`` with ``config`` is captured in CUDA graphs."""
    if device is None or device.type != "cuda":
        return False
    return config.cudagraphs is True or (config.cudagraphs is None and torch.cuda.is_available())


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _symbols_of(values: Sequence[Any]) -> dict[int, Any]:
    """Input index -> the dynamic-shape symbol of each dim of a tensor (None: static), or of
    an integer input; read once from the traced example values (nothing of them is kept)."""

    def symbol(value: Any) -> str | None:
        if isinstance(value, torch.SymInt) and getattr(value.node.expr, "free_symbols", None):
            return str(value.node.expr)
        return None

    out: dict[int, Any] = {}
    for i, value in enumerate(values):
        if isinstance(value, Tensor):
            out[i] = tuple(symbol(size) for size in value.shape)
        elif isinstance(value, torch.SymInt):
            out[i] = symbol(value)
    return out


_EVICTION_HINTS: dict[str, Callable[[FusionConfig], str]] = {
    "max_graphs": lambda c: (
        f"more than max_graphs={c.max_graphs} input signatures; the oldest are evicted "
        "and re-captured when they return (raise max_graphs, or use batch_buckets / "
        "length_buckets for varying batch sizes / lengths)"
    ),
    "graph_memory": lambda c: (
        f"captured graphs hold more than graph_memory={c.graph_memory} bytes; the least "
        "recently used are evicted and re-captured when they return (raise graph_memory, or "
        "use batch_buckets / length_buckets)"
    ),
    "entry_limit": lambda c: (
        f"more than {_MAX_ENTRIES} input signatures; the oldest are evicted (use "
        "batch_buckets / length_buckets, or dynamic=True)"
    ),
    "superseded": lambda c: (
        "a newer compilation of this function serves its shapes; their entries here are dropped"
    ),
}


def _enforce_memory(budget: int, cache: GraphCache, key: Key) -> None:
    """Evict the least recently used captured entries of any cache until the captured entries
    of all caches hold at most ``budget`` bytes (``key`` of ``cache``, just captured, stays).

    The caller holds ``cache``'s lock; another cache whose lock is busy (a call in flight on
    another thread) is skipped, never waited on.
    """
    busy: set[int] = set()
    while True:
        caches = live_caches()
        if sum(c._held_bytes for c in caches) <= budget:
            return
        oldest: tuple[int, GraphCache, Key] | None = None
        for other in caches:
            if id(other) in busy or not other._held_bytes:
                continue
            if not other._lock.acquire(blocking=False):
                busy.add(id(other))
                continue
            try:
                # Entries are in use order (moved to the end on each call): the first
                # captured one is the cache's least recently used.
                for k, entry in other._entries.items():
                    if entry.graph is not None and not (other is cache and k == key):
                        if oldest is None or entry.last_use < oldest[0]:
                            oldest = (entry.last_use, other, k)
                        break
            finally:
                other._lock.release()
        if oldest is None:
            return
        _, other, k = oldest
        if not other._lock.acquire(blocking=False):
            busy.add(id(other))
            continue
        try:
            if k in other._entries:
                other._evict(k, "graph_memory")
        finally:
            other._lock.release()


def _retire_entries(entries: Mapping[Key, _Entry], device_index: int | None) -> None:
    for entry in list(entries.values()):
        if entry.graph is not None:
            _capture.retire(entry.resources(), device_index)


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
            that moves on consecutive calls is copied in after ``_MAX_ADDRESS_CHANGES``).
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
    ) -> None:
        if device is not None and device.type != "cuda":
            device = None  # only CUDA graphs are captured; anything else runs directly
        self._unfused = unfused
        self._fused = fused if config.fusion else None
        self._config = config
        self._device = device
        self._static = frozenset(static_input_indices)
        # Static inputs seen at a new address too often: copied in like the others (their
        # values are still read on every call: only where the graph reads them changes).
        self._moves: dict[int, int] = {}
        self._copied_static: set[int] = set()
        self._mutated = tuple(sorted(mutated_input_indices))
        self._host = dict(host_inputs or {}) if device is not None else {}
        self._batch_ints = frozenset(batch_size_input_indices)
        self.name = name
        self.label_prefix = f"{name}#{next(_serials)}"
        self._buckets = config.batch_buckets
        self._static_outputs = config.static_outputs
        self._capture = captures(config, device)
        # Options the user set that cannot take effect on this graph, with the reason:
        # logged once as a warning and listed by stats()["ignored_options"].
        self.ignored_options: list[str] = []
        if config.cudagraphs is True and not self._capture:
            self._ignore(
                "cudagraphs=True has no effect: "
                + ("CUDA is not available" if device is not None else "the graph runs on the CPU")
                + "; nothing is captured"
            )
        self._buckets_checked = self._buckets is None
        # Input index -> dynamic-shape symbol of each dim (tensors) or of the value (ints).
        self._symbols = None if example_values is None else _symbols_of(example_values)
        self._lengths = config.length_buckets
        # length_buckets: which inputs carry the length (found at the first call), and each
        # bucket's check against the unpadded run: bucket -> outputs to slice, or the reason
        # it is not used.
        self._length_plan: LengthInputs | None = None
        self._lengths_checked = self._lengths is None
        self._length_state: dict[int, tuple[bool, ...] | str] = {}
        # Validation classes (keys.plan_class) whose fused run matched the unfused graph.
        self._validated: set[Key] = set()
        self._held_bytes = 0  # nbytes of the captured entries (graph_memory)
        # The use clock at this cache's creation and at its last call (_supersede).
        self._created = self._last_call = _clock()
        self._unpadded_seen: set[Key] = set()  # caller signatures of padded calls (_supersede)
        # Device whose replays are ordered across streams (None: test doubles without CUDA).
        self._replay_device: int | None = None
        if self._capture and torch.cuda.is_available():
            index = device.index
            self._replay_device = index if index is not None else torch.cuda.current_device()
        # Where a key goes when the fused graph is not (or no longer) an option.
        self._unfused_mode = GRAPH_REPLAY if self._capture else EAGER
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._verdicts: dict[Key, _Verdict] = {}
        self._warned = False  # this cache's one warning (fallback or eviction) was issued
        self._evicting = False
        # Held for lookup, misses and the whole copy-in/replay/copy-out of captured entries:
        # static buffers are shared by every call of a key. Reentrant: a callable that calls
        # back into this cache (a compiled function calling itself) must not deadlock.
        self._lock = threading.RLock()
        self._signatures = Signatures(
            self._static, self._fused is not None, self._capture, frozenset(self._host)
        )
        register_cache(self)
        compiled = _compile_frame()
        self._frame = None if compiled is None else compiled[0]
        if compiled is not None:
            with _FRAMES_LOCK:
                if compiled[1] == 0:
                    # A frame's first compilation: caches listed under its number belong to
                    # another function, compiled before a torch._dynamo.reset().
                    _FRAMES[self._frame] = []
                siblings = _FRAMES.setdefault(self._frame, [])
                siblings[:] = [ref for ref in siblings if ref() is not None]
                siblings.append(weakref.ref(self))
        # A cache collected with live entries (Dynamo recompiled, the model was deleted) lets
        # them go through retire like an eviction: a replay queued on another stream may still
        # read their buffers, which freeing them at once would hand to other tensors.
        weakref.finalize(self, _retire_entries, self._entries, self._replay_device)

    # ----------------------------------------------------------------------------- hot path

    def __call__(self, *args: Any) -> Sequence[Any]:
        if self._lengths is not None:
            if not self._lengths_checked:
                self._check_lengths(args)
            if self._length_plan is not None:
                padded = pad_length(args, self._length_plan, self._lengths)
                if padded is not None:
                    return self._length_call(args, *padded)
        return self._call(args)

    def _call(
        self, args: tuple[Any, ...], original: tuple[Any, ...] | None = None
    ) -> Sequence[Any]:
        """A call with ``args`` (``original``: the caller's, before length padding)."""
        user_args = args
        batch = bucket = None
        if self._buckets is not None:
            if not self._buckets_checked:
                self._check_buckets(args)
            # Padding copies each input on its own: inputs sharing a storage with a written
            # one would lose the write through the other, so such a call runs unpadded.
            buckets = self._buckets  # None once the first call found a static batch dim
            if buckets is not None and not (self._mutated and shared_storages(args, self._mutated)):
                args, batch, bucket = pad(args, buckets, self._static, self._batch_ints)
        key = self._signatures.key(args)
        given = original if original is not None else user_args
        with self._lock:
            entry = self._entries.get(key)
            if given is not args and self._frame is not None:
                # A padded call: an older compilation may hold the caller's own shapes even
                # when this padded key is a hit here (its bucket served other sizes first).
                self._supersede_unpadded(given)
            if entry is None:
                COUNTERS.cache_misses += 1
                verdict = self._verdicts.get(key)
                seen = 0
                if verdict is None and self._frame is not None:
                    seen = self._supersede(key)
                return self._new_entry(key, verdict, args, user_args, batch, bucket, seen)
            self._entries.move_to_end(key)
            COUNTERS.cache_hits += 1
            entry.hits += 1
            entry.last_use = self._last_call = _clock()
            if entry.pending and entry.hits + 1 >= self._config.capture_on_call:
                return self._promote(key, entry, args, user_args, batch, bucket)
            if entry.graph is not None:
                if entry.static_idx and not static_ptrs_equal(
                    args, entry.static_ptrs, entry.static_idx
                ):
                    return self._rerecord(key, entry, args, user_args, batch, bucket)
                if self._moves:
                    self._moves.clear()  # moves must be consecutive to stop in-place use
                if entry.trial is not None:
                    return self._trial_call(key, entry, args, user_args, batch, bucket)
                return self._replay(entry, args, user_args, batch, bucket)
        # Direct entries share no buffers between calls: run outside the lock.
        if entry.mode != FUSION:
            return self._direct(entry.fn, args, user_args, batch, bucket)
        try:
            return self._direct(entry.fn, args, user_args, batch, bucket)
        except Exception as exc:
            if self._mutated:  # the fused graph may have written half its mutations
                raise
            # The unfused graph tells the model's own errors (it fails too: the fused error,
            # which names the bad value, is raised) from a failing fused kernel (fall back,
            # once, with the reason).
            try:
                outputs = self._direct(self._unfused, args, user_args, batch, bucket)
            except Exception:
                raise exc from None
            with self._lock:
                why = f"fused graph raised {type(exc).__name__}: {one_line(exc)}"
                # An entry the large-output trial left uncaptured runs directly from now on.
                fallback = self._unfused_mode if entry.decision is None else EAGER
                mode, reason = self._fall_back(key, FUSION, fallback, why, entry.reason)
                capture = entry.pending and self._capture and mode != EAGER
                entry.mode, entry.fn, entry.reason = mode, self._unfused, reason
                entry.pending = capture
                self._remember(key, _Verdict(mode, reason, capture, entry.hits + 1))
            return outputs

    def _replay(
        self,
        entry: _Entry,
        args: tuple[Any, ...],
        user_args: tuple[Any, ...],
        batch: int | None,
        bucket: int | None,
    ) -> Sequence[Any]:
        if self._replay_device is None:
            return self._enqueue_replay(entry, args, user_args, batch, bucket)
        with _capture.replay_lock():
            _capture.wait_for_last_replay(self._replay_device)
            return self._enqueue_replay(entry, args, user_args, batch, bucket)

    def _enqueue_replay(
        self,
        entry: _Entry,
        args: tuple[Any, ...],
        user_args: tuple[Any, ...],
        batch: int | None,
        bucket: int | None,
    ) -> Sequence[Any]:
        """Copy the inputs in, replay, write mutations back, clone the outputs: all queued
        on the caller's current stream."""
        if entry.copy_bufs:
            # One call for all inputs (a single multi-tensor kernel where dtypes agree).
            torch._foreach_copy_(entry.copy_bufs, [args[i] for i in entry.copy_idx])
        for i, buf, ring in entry.host_copies:
            ring.copy(buf, args[i])
        entry.graph.replay()
        if entry.written:
            write_back(entry.written, entry.buffers_by_index, user_args)
        clone = not self._static_outputs
        result = []
        for out, alias in zip(entry.outputs, entry.aliases, strict=True):
            if alias is not None:
                result.append(user_args[alias])
            elif isinstance(out, Tensor):
                if bucket is not None and out.dim() and out.shape[0] == bucket:
                    out = out[:batch]
                result.append(out.clone() if clone else out)
            else:
                result.append(out)
        return tuple(result) if entry.out_tuple else result

    def _direct(
        self,
        fn: Callable[..., Sequence[Any]],
        args: tuple[Any, ...],
        user_args: tuple[Any, ...],
        batch: int | None,
        bucket: int | None,
    ) -> Sequence[Any]:
        call_args = self._to_device(args) if self._host else args
        outputs = fn(*call_args)
        if call_args is not user_args:
            write_back(self._mutated, call_args, user_args)
        return outputs if bucket is None else slice_outputs(outputs, batch, bucket)

    # ------------------------------------------------------------------------ miss handling

    def _new_entry(
        self,
        key: Key,
        verdict: _Verdict | None,
        args: tuple[Any, ...],
        user_args: tuple[Any, ...],
        batch: int | None,
        bucket: int | None,
        seen: int = 0,
    ) -> Sequence[Any]:
        """A call of a signature without a live entry (its first, again after an eviction, a
        re-record, or the call that captures it): run the graph (a new fused key validated
        unless its class already matched), capture it from its ``capture_on_call``-th call,
        and commit the call's in-place effects into the caller's tensors once, last
        (``effects.Effects``). ``seen``: calls of this signature known from elsewhere (an
        older compilation of the same function that served it)."""
        if verdict is not None:
            mode, reason, capture = verdict.mode, verdict.reason, verdict.capture
            seen = max(seen, verdict.calls)
        else:
            mode, reason, capture = (FUSION if key[0] else self._unfused_mode), None, True
        calls = seen + 1
        capture = capture and self._capture and mode != EAGER
        # Capture pays for what recurs: a shape seen once (a corpus of varied lengths, one
        # query) costs one run instead of warm-up + capture, and what comes back (a decode
        # step, on its 2nd call; any shape of a second pass) is captured then.
        defer = capture and calls < self._config.capture_on_call
        capture_now = capture and not defer
        if capture_now:
            _capture.join_replay_order(self._replay_device)
        effects = Effects(self._to_device(args) if self._host else args, self._mutated)
        if mode == FUSION:
            outputs, winner, failure = self._fused_run(key, effects, first=verdict is None)
            if failure is not None:
                mode, reason = self._fall_back(key, FUSION, self._unfused_mode, failure, reason)
        else:
            winner = effects.isolate()
            outputs = self._callable(mode)(*winner)
        effects.release()
        try:
            # Warm-up and capture write mutated static inputs (parameters, buffers, a KV
            # cache marked static) in place; the commit below overwrites whatever they did.
            entry = self._settle(key, mode, reason, capture, defer, args)
        finally:
            effects.commit(winner, user_args)
            if capture_now:
                _capture.join_replay_order(self._replay_device)
        entry.hits = calls - 1
        self._remember(
            key, _Verdict(entry.mode, entry.reason, entry.graph is not None or entry.pending, calls)
        )
        self._insert(key, entry)
        outputs = effects.own_outputs(outputs, winner, user_args)
        return outputs if bucket is None else slice_outputs(outputs, batch, bucket)

    def _fused_run(
        self, key: Key, effects: Effects, first: bool
    ) -> tuple[Sequence[Any], list[Any], str | None]:
        """Run the fused callable once; return (outputs, the inputs of the run whose effects
        count, failure reason or None).

        ``first``: the key's first run in this cache (counted in ``fusion_attempts``); it is
        compared with the unfused graph (``validate``) unless another key of its validation
        class (``keys.plan_class``: the same graph at other sizes) already matched. A fused
        run that raises falls back when the unfused graph does not. The fused and the
        reference run each write into their own copies of the mutated inputs
        (``effects.isolate``), so a fused callable that fails halfway leaves no trace.
        """
        assert self._fused is not None
        if first:
            COUNTERS.fusion_attempts += 1
        cls = plan_class(key)
        validate = first and self._config.validate and cls not in self._validated
        fused_args = effects.isolate()
        # The reference run must draw the same random numbers (dropout in the graph) and
        # leave the generators where one run of the model would.
        rng = RngState(self._device)
        try:
            outputs = self._fused(*fused_args)
        except Exception as exc:
            # Run the unfused graph: if it raises too, the error is the model's own (an
            # out-of-range index, a shape error) and reaches the caller as eager's would,
            # without being counted or logged as a fusion failure.
            rng.restore()
            ref_args = effects.isolate()
            effects.release()
            try:
                expected = self._unfused(*ref_args)
            except Exception:
                raise exc from None  # the fused error names the bad value (kernels' checks)
            return expected, ref_args, f"fused graph raised {type(exc).__name__}: {one_line(exc)}"
        winner, failure = fused_args, None
        if validate:
            COUNTERS.validations += 1
            ref_args = effects.isolate()
            effects.release()
            rng.restore()
            expected = self._unfused(*ref_args)
            failure = mismatch(outputs, expected, "output")
            for i in effects.indices:
                failure = failure or mismatch(
                    [fused_args[i]], [ref_args[i]], f"mutated input {i} after"
                )
            if failure is not None:
                # The class stays unvalidated: its next new key is compared again.
                failure = f"fused graph does not match the unfused graph: {failure}"
                outputs, winner = expected, ref_args
            else:
                self._validated.add(cls)
        if failure is None and first:
            COUNTERS.fusion_successes += 1
        return outputs, winner, failure

    def _settle(
        self,
        key: Key,
        mode: str,
        reason: str | None,
        capture: bool,
        defer: bool,
        args: tuple[Any, ...],
    ) -> _Entry:
        """Make the entry for ``key`` starting from ``mode``: capture (or, with ``defer``, an
        uncaptured entry captured on a later call), or fall back."""
        entry = None
        blocker = self._capture_blocker(args) if capture else None
        if blocker is not None:
            capture = False
            if mode == FUSION:  # the fused graph runs directly (its kernels need no capture)
                step = f"not captured: {blocker}"
                reason = step if reason is None else f"{reason}; {step}"
                log.log(self._warn_once(), "%s: %s %s", self.name, self._label(key), step)
            else:
                mode, reason = self._fall_back(key, mode, EAGER, blocker, reason)
        if capture and defer:
            return _Entry(mode, self._callable(mode), reason, pending=True)
        while entry is None and capture and mode != EAGER:
            try:
                entry = self._record(mode, self._callable(mode), args)
            except Exception as exc:
                COUNTERS.capture_failures += 1
                why = f"capture failed: {type(exc).__name__}: {one_line(exc)}"
                next_mode = GRAPH_REPLAY if mode == FUSION else EAGER
                mode, reason = self._fall_back(key, mode, next_mode, why, reason)
        budget = self._config.graph_memory
        if entry is not None and budget is not None and entry.nbytes > budget:
            # Kept, it would evict every other captured entry and then itself at the next
            # capture; run directly instead.
            _capture.retire(entry.resources(), self._replay_device)
            why = f"its buffers ({_mib(entry.nbytes)}) exceed graph_memory ({_mib(budget)})"
            entry = None
            if mode == FUSION:
                step = f"not captured: {why}"
                reason = step if reason is None else f"{reason}; {step}"
                log.log(self._warn_once(), "%s: %s %s", self.name, self._label(key), step)
            else:
                mode, reason = self._fall_back(key, mode, EAGER, f"not captured: {why}", reason)
        if entry is None:
            entry = _Entry(mode, self._callable(mode))
        entry.reason = reason
        return entry

    def _ignore(self, why: str) -> None:
        self.ignored_options.append(why)
        log.warning("%s: %s", self.name, why)

    def _check_buckets(self, args: tuple[Any, ...]) -> None:
        """Once, at the first call: batch_buckets needs a non-static tensor input with a
        leading (batch) dim; a graph without one (only parameters and scalars) pads nothing."""
        self._buckets_checked = True
        first = next(
            (
                i
                for i, a in enumerate(args)
                if i not in self._static and isinstance(a, Tensor) and a.dim() > 0
            ),
            None,
        )
        if first is None:
            self._ignore(
                f"batch_buckets={list(self._buckets or ())} has no effect: the graph has no "
                "non-parameter tensor input with a batch dimension"
            )
        elif self._symbols is not None and (self._symbols.get(first) or (0,))[0] is None:
            # Dynamo traced this graph for one batch size (its first call: a transformers
            # BertModel then views with that size baked in, and batch 3 padded to 4 failed
            # with "The size of tensor a (4) must match the size of tensor b (3)"). Dynamo
            # routes only that size here; the next batch size recompiles with a dynamic
            # batch, where the buckets apply.
            log.info(
                "%s: batch_buckets: the graph's batch dim is static (%d); it runs unpadded",
                self.name,
                args[first].shape[0],
            )
            self._buckets = None

    def _check_lengths(self, args: tuple[Any, ...]) -> None:
        """Once, at the first call: which inputs carry the length (``buckets.length_inputs``)."""
        self._lengths_checked = True
        given = f"length_buckets={list(self._lengths or ())}"
        if self._mutated:
            self._ignore(
                f"{given} has no effect: the graph writes its inputs in place (a cache or "
                "state padded along the length would not be the caller's)"
            )
            return
        plan = length_inputs(args, self._static, self._symbols)
        if isinstance(plan, LengthInputs):
            self._length_plan = plan
        elif "static" in plan:
            log.info("%s: %s: %s; it runs unpadded", self.name, given, plan)
        else:
            self._ignore(f"{given} has no effect: {plan}")

    def _length_call(
        self, args: tuple[Any, ...], padded: tuple[Any, ...], length: int, bucket: int
    ) -> Sequence[Any]:
        """A call padded to a length bucket. The bucket's first call also runs the unpadded
        graph and compares: a model whose padded positions are not masked out (no attention
        mask passed, a position-dependent output) leaves the bucket unpadded, with the
        reason in ``ignored_options``."""
        state = self._length_state.get(bucket)
        if isinstance(state, str):
            return self._call(args)
        if state is not None:
            return slice_length(self._call(padded, args), length, state)
        reference = self._direct(self._unfused, args, args, None, None)
        why = None
        try:
            outputs = self._call(padded, args)
        except Exception as exc:
            why = f"the padded run raised {type(exc).__name__}: {one_line(exc)}"
        else:
            along = tuple(
                isinstance(o, Tensor)
                and isinstance(r, Tensor)
                and o.dim() >= 2
                and o.dim() == r.dim()
                and o.shape[1] == bucket
                and r.shape[1] == length
                for o, r in zip(outputs, reference, strict=False)
            )
            if len(outputs) != len(reference):
                why = f"{len(outputs)} outputs, expected {len(reference)}"
            else:
                sliced = slice_length(outputs, length, along)
                why = mismatch(sliced, reference, "output")
                if why is None:
                    self._length_state[bucket] = along
                    return sliced
            why = f"the padded run differs from the unpadded run: {why}"
        self._length_state[bucket] = why
        # The padded entry made by the check serves no later call: let it go.
        padded_key = self.key_for(*padded)
        with self._lock:
            stale = self._entries.pop(padded_key, None)
            if stale is not None:
                self._drop(stale)
        self._ignore(
            f"length_buckets: bucket {bucket} is not used (length {length} and the others "
            f"padded to it run unpadded): {why}"
        )
        return reference

    def _capture_blocker(self, args: tuple[Any, ...]) -> str | None:
        """Why the graph must not be captured for these inputs, or None."""
        for i in self._static:
            a = args[i] if i < len(args) else None
            if isinstance(a, Tensor) and a.dim() == 0 and a.device.type == "cpu":
                # Read on the host at capture and baked in; as a static input its value is
                # not in the key either, so a later in-place change would never be seen.
                return (
                    f"input {i} is a CPU scalar tensor used in place: a CUDA graph would keep "
                    f"the value it had at capture"
                )
        for i in self._mutated:
            a = args[i] if i < len(args) else None
            if not isinstance(a, Tensor) or a.device.type != "cpu":
                continue
            # A CPU 0-d tensor (a counter on the host) is updated by a CPU kernel while the
            # graph is captured, never on replay. Other CPU tensors fail capture anyway
            # (capture_graph), except host inputs: the graph writes their device copy, which
            # each replay copies back.
            if a.dim() == 0:
                return (
                    f"input {i} is a CPU scalar tensor the graph writes in place: "
                    f"a CUDA graph replay would not update it"
                )
        return None

    def _callable(self, mode: str) -> Callable[..., Sequence[Any]]:
        fn = self._fused if mode == FUSION else self._unfused
        assert fn is not None
        return fn

    def _warn_once(self) -> int:
        """WARNING for this cache's first noteworthy event, INFO after that."""
        if self._warned:
            return logging.INFO
        self._warned = True
        return logging.WARNING

    def _remember(self, key: Key, verdict: _Verdict) -> None:
        """Keep a key's verdict, success or fallback: it never retries a fallback, is not
        validated again and is captured at once when it returns (bounded: oldest dropped)."""
        if key not in self._verdicts and len(self._verdicts) >= _MAX_VERDICTS:
            del self._verdicts[next(iter(self._verdicts))]
        self._verdicts[key] = verdict

    def _fall_back(
        self, key: Key, old: str, new: str, why: str, previous: str | None
    ) -> tuple[str, str]:
        if old == FUSION:
            COUNTERS.fusion_fallbacks += 1
        # One warning per cache (a fault on every one of 300 shapes is one warning, not 600);
        # later events are logged at INFO. Every reason stays in stats()["fallback_reasons"].
        level = self._warn_once()
        log.log(level, "%s: %s -> %s for %s: %s", self.name, old, new, self._label(key), why)
        step = f"{old} -> {new}: {why}"
        return new, step if previous is None else f"{previous}; {step}"

    def _rerecord(
        self,
        key: Key,
        entry: _Entry,
        args: tuple[Any, ...],
        user_args: tuple[Any, ...],
        batch: int | None,
        bucket: int | None,
    ) -> Sequence[Any]:
        COUNTERS.rerecords += 1
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
        outputs = self._new_entry(
            key, _Verdict(entry.mode, entry.reason, True, seen), args, user_args, batch, bucket
        )
        new = self._entries[key]
        new.hits = entry.hits
        if entry.decision is not None and new.trial is not None:
            new.trial, new.decision = None, entry.decision  # "capture pays" was decided: keep it
        return outputs

    def _trial_call(
        self,
        key: Key,
        entry: _Entry,
        args: tuple[Any, ...],
        user_args: tuple[Any, ...],
        batch: int | None,
        bucket: int | None,
    ) -> Sequence[Any]:
        """One of the timed calls that decide whether capturing ``key`` pays (``payoff``):
        replayed or run directly, in turn; each call runs the graph once either way."""
        trial = entry.trial
        assert trial is not None
        replayed = trial.next_is_replay()
        if replayed:
            run = functools.partial(self._replay, entry, args, user_args, batch, bucket)
        else:
            run = functools.partial(self._direct, entry.fn, args, user_args, batch, bucket)
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
            mode = FUSION if entry.mode == FUSION else EAGER
            step = why if mode == entry.mode else f"{entry.mode} -> {mode}: {why}"
            reason = step if entry.reason is None else f"{entry.reason}; {step}"
            self._entries[key] = _Entry(
                mode, entry.fn, reason, hits=entry.hits, decision=why, last_use=entry.last_use
            )
            self._remember(key, _Verdict(mode, reason, False, entry.hits + 1))
            self._drop(entry)
        return outputs

    def _record(self, mode: str, fn: Callable[..., Sequence[Any]], args: tuple[Any, ...]) -> _Entry:
        _capture.reap()
        inputs = list(args)
        copies: list[tuple[int, Tensor]] = []
        host_copies: list[tuple[int, Tensor, PinnedRing]] = []
        static_idx: list[int] = []
        static_ptrs: list[int | None] = [None] * len(args)
        tensors = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        staged = {i for i in tensors if i in self._host and args[i].device.type == "cpu"}
        in_place = {i for i in tensors if i in self._static} - self._copied_static - staged
        # An input sharing a storage with one used in place (b = a[1:] while the graph writes
        # a) is used in place too: a copy of it would miss the graph's own writes on replay.
        shared = {storage_ptr(args[i]) for i in in_place} - {0}
        for i in tensors:
            a = args[i]
            if i in in_place or (i not in staged and storage_ptr(a) in shared):
                static_idx.append(i)
                static_ptrs[i] = a.data_ptr()
            elif i in staged:
                # Before the 0-d case: a staged CPU scalar is copied in on every replay.
                buf = torch.empty_like(a, device=self._host[i])
                ring = PinnedRing(a)
                ring.copy(buf, a)
                host_copies.append((i, buf, ring))
                inputs[i] = buf
            elif a.dim() == 0 and a.device.type == "cpu":
                continue  # read on the host at capture, baked in: its value is in the key
            else:
                buf = torch.empty_like(a)
                buf.copy_(a)
                copies.append((i, buf))
                inputs[i] = buf
        graph, outputs = _capture.capture_graph(
            fn, inputs, device=self._device, warmup_iterations=self._config.warmup_iterations
        )
        COUNTERS.recordings += 1
        by_identity = {id(inputs[i]): i for i in tensors}
        host_idx = {i for i, _, _ in host_copies}
        aliases = tuple(
            by_identity.get(id(out)) if isinstance(out, Tensor) else None for out in outputs
        )
        # A returned host input lives on the device in the graph; the caller's tensor is on
        # the CPU, so it is returned as a device copy like any other output.
        aliases = tuple(None if a in host_idx else a for a in aliases)
        buffers = {i: buf for i, buf in copies} | {i: buf for i, buf, _ in host_copies}
        out_bytes = payoff.output_bytes(outputs, aliases)
        large = out_bytes >= payoff.LARGE_OUTPUT_BYTES
        return _Entry(
            mode=mode,
            fn=fn,
            graph=graph,
            copy_idx=tuple(i for i, _ in copies),
            copy_bufs=[buf for _, buf in copies],
            host_copies=tuple(host_copies),
            written=tuple(i for i in self._mutated if i in buffers),
            buffers_by_index=buffers,
            static_idx=static_idx,
            static_ptrs=static_ptrs,
            outputs=tuple(outputs),
            aliases=aliases,
            out_tuple=isinstance(outputs, tuple),
            # What this entry holds alone: the pool's intermediates are shared by all graphs
            # of the device (replays never overlap), its outputs and input buffers are not.
            nbytes=out_bytes + sum(_nbytes(buf) for buf in buffers.values()),
            # Kept outputs are copied after each replay; static_outputs copies nothing.
            trial=payoff.CaptureTrial() if large and not self._static_outputs else None,
        )

    def _insert(self, key: Key, entry: _Entry) -> None:
        entry.last_use = self._last_call = _clock()
        self._entries[key] = entry
        self._held_bytes += entry.nbytes
        cap = self._config.max_graphs
        while cap is not None and len(self._entries) > cap:
            self._evict(next(iter(self._entries)), "max_graphs")
        while len(self._entries) > _MAX_ENTRIES:
            self._evict(next(iter(self._entries)), "entry_limit")
        if entry.nbytes and self._config.graph_memory is not None:
            _enforce_memory(self._config.graph_memory, self, key)

    def _evict(self, key: Key, cause: str) -> None:
        """Drop one entry (the caller holds this cache's lock); its verdict stays, so it is
        neither validated nor kept uncaptured again when it returns."""
        entry = self._entries.pop(key)
        self._drop(entry)
        COUNTERS.evicted(cause)
        if cause == "superseded":  # the expected course of Dynamo's recompiles: no warning
            log.debug("%s: %s superseded by a newer compilation", self.name, self._label(key))
            return
        if not self._evicting:
            self._evicting = True
            log.log(self._warn_once(), "%s: %s", self.name, _EVICTION_HINTS[cause](self._config))
        log.debug("%s: evicted %s (%s)", self.name, self._label(key), cause)

    def _drop(self, entry: _Entry) -> None:
        """Let go of a dropped entry's graph and buffers once no queued replay reads them."""
        self._held_bytes -= entry.nbytes
        if entry.graph is not None:
            _capture.retire(entry.resources(), self._replay_device)

    def _promote(
        self,
        key: Key,
        entry: _Entry,
        args: tuple[Any, ...],
        user_args: tuple[Any, ...],
        batch: int | None,
        bucket: int | None,
    ) -> Sequence[Any]:
        """The ``capture_on_call``-th call of an uncaptured entry: capture it now."""
        del self._entries[key]
        self._drop(entry)
        verdict = _Verdict(entry.mode, entry.reason, True, entry.hits)
        return self._new_entry(key, verdict, args, user_args, batch, bucket)

    def _supersede_unpadded(self, given: tuple[Any, ...]) -> None:
        """Once per caller signature of padded calls: drop older compilations' entries for
        the caller's own shapes (``_supersede``), hit or miss of the padded key."""
        own = self._signatures.key(given)
        if own in self._unpadded_seen:
            return
        if len(self._unpadded_seen) >= _MAX_VERDICTS:
            self._unpadded_seen.clear()
        self._unpadded_seen.add(own)
        self._supersede(own)

    def _supersede(self, key: Key) -> int:
        """Drop the entries of older compilations of this cache's function that served the
        tensor shapes of ``key``; return how many calls they had (0: none).

        Dynamo checks its newest graph first, and a recompile after a new shape makes a more
        general graph (a dynamic length, then batch): from then on a shape first served by
        an older graph goes to the newer one, and the older entry, captured graph and
        buffers included, would stay alive unused (4 shapes twice made 7 entries). The rule
        needs no guess about Dynamo's guards: the newer graph has just been handed these
        shapes, so its guards won. Should an older graph still be routed the same shapes
        (two graphs that differ in a Python value, called in turn), it pays one more miss
        per shape once; its verdicts stay, so that miss captures at once. An older cache
        called since this one was created is still routed calls and keeps its entries (after
        Dynamo's recompiles the older graphs get none). A padded call also drops the entries
        of the caller's own shapes (``_supersede_unpadded``).
        """
        with _FRAMES_LOCK:
            refs = list(_FRAMES.get(self._frame, ()))
        older = []
        for ref in refs:
            cache = ref()
            if cache is self:
                break
            if cache is not None and cache._last_call < self._created:
                older.append(cache)
        if not older:
            return 0
        signature = tensor_signature(key)
        seen = 0
        for cache in older:
            # Never wait on another cache's lock while holding this one's (two caches
            # superseding each other would deadlock); a busy cache keeps its entry for now.
            if not cache._lock.acquire(blocking=False):
                continue
            try:
                for old in [k for k in cache._entries if tensor_signature(k) == signature]:
                    seen = max(seen, cache._entries[old].hits + 1)
                    cache._evict(old, "superseded")
            finally:
                cache._lock.release()
        return seen

    # ------------------------------------------------------------------------- arg plumbing

    def _to_device(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        moved = list(args)
        for i, device in self._host.items():
            if i < len(args) and isinstance(args[i], Tensor) and args[i].device.type == "cpu":
                moved[i] = args[i].to(device, non_blocking=True)
        return tuple(moved)

    # -------------------------------------------------------------------------- inspection

    def key_for(self, *args: Any) -> Key:
        """The cache key a call with ``args`` uses (after length- and batch-bucket padding)."""
        if self._length_plan is not None:
            padded = pad_length(args, self._length_plan, self._lengths or ())
            if padded is not None and not isinstance(self._length_state.get(padded[2]), str):
                args = padded[0]
        if self._buckets is not None:
            args = pad(args, self._buckets, self._static, self._batch_ints)[0]
        return self._signatures.key(args)

    def mode_for(self, *args: Any) -> str | None:
        """The mode a call with ``args`` would run in now, or None if it would be a miss."""
        key = self.key_for(*args)
        with self._lock:
            entry = self._entries.get(key)
        return None if entry is None else entry.mode

    def describe(self) -> list[dict[str, Any]]:
        """One dict per live entry: key (readable), mode, reason, captured, decision (whether
        capture pays, for large outputs: see ``payoff``; when an uncaptured entry is captured),
        hits."""
        with self._lock:
            items = list(self._entries.items())
        return [
            {
                "key": self._label(key),
                "mode": entry.mode,
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
            for key, entry in items
        ]

    def stats_rows(self) -> list[StatsRow]:
        with self._lock:
            items = list(self._entries.items())
        return [
            StatsRow(self._label(key), shapes(key), entry.mode, entry.reason)
            for key, entry in items
        ]

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (captured graphs, static buffers) and every fallback verdict."""
        with self._lock:
            for entry in self._entries.values():
                self._drop(entry)
            self._entries.clear()
            self._held_bytes = 0
            self._verdicts.clear()
            self._validated.clear()
            self._length_state.clear()
            self._unpadded_seen.clear()
            self._moves.clear()
            self._copied_static.clear()

    def __repr__(self) -> str:
        return (
            f"GraphCache({self.label_prefix}, device={self._device}, "
            f"capture={self._capture}, entries={len(self._entries)})"
        )

    def _label(self, key: Key) -> str:
        return label(self.label_prefix, self._device, key)
