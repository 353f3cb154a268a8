"""GraphCache: one captured CUDA graph per input signature, with a counted fallback chain.

A compiled graph is wrapped in a ``GraphCache``. Each call builds a signature key (a plain
tuple: shape, stride, dtype and device of every non-static tensor input, type and value of
every other input, and whether the fused graph is selected). The key picks an entry whose
mode says how the call runs:

    "fusion"        the fused callable; captured in a CUDA graph when capture is on
    "graph_replay"  the unfused callable, captured (capture on only)
    "eager"         the unfused callable, run directly

A new key starts in "fusion" when a fused callable exists and fusion is enabled, else in the
first unfused mode. It moves down the chain, once, with the reason recorded and logged:
the fused callable raises on its first run or (``validate``) its outputs differ from the
unfused ones -> unfused; a capture fails (host sync such as ``.item()``, CPU tensors,
out of memory) -> "graph_replay" from "fusion", "eager" from "graph_replay". A key's
final verdict is remembered, so a key that fell back never retries after an eviction.

Captured entries: warm-up runs on a side stream, capture goes into one memory pool shared
by all graphs of the device (``torch.cuda.graph_pool_handle()``). Non-static tensor inputs
are copied into static buffers on each replay; static inputs (parameters, buffers) are used
in place and their addresses checked on each hit (a change re-records). CPU inputs the
graph wants on the device (``host_inputs``) are copied through pinned staging buffers
without a host sync. Outputs are cloned unless ``static_outputs``.

Each call executes the model's effects exactly once: the first call of a key runs the
callable directly (that run is the call's result), then captures; warm-up and capture
happen on private copies of the inputs, and mutated parameters/buffers are restored after
them.

Inference only: capture records no autograd graph.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fusebackend.config import FusionConfig
from fusebackend.runtime import stats as _stats
from fusebackend.runtime.stats import COUNTERS

log = logging.getLogger(__name__)

__all__ = [
    "EAGER",
    "FUSION",
    "GRAPH_REPLAY",
    "CaptureError",
    "GraphCache",
    "capture_graph",
    "pool_bytes",
    "release_pools",
]

FUSION = "fusion"
GRAPH_REPLAY = "graph_replay"
EAGER = "eager"

Key = tuple[Any, ...]

# Per-dtype (rtol, atol) for the first-run comparison of fused against unfused outputs. The
# fused kernel computes in fp32 and rounds once; eager rounds every op to fp16/bf16, so the
# two legitimately differ by a few ulps of the storage type per op in the chain.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

# Fallback verdicts kept per cache after their entries are evicted; a few hundred bytes each.
_MAX_VERDICTS = 1024

# Pinned staging buffers per host input. A slot is reused only once the copy that last read
# it has completed; the ring grows while every slot is busy and only past this size does the
# host wait, i.e. when it runs this many calls ahead of the device.
_MAX_STAGING_SLOTS = 8

_serials = itertools.count()

# C++ check used by torch's own cudagraph trees on the hot path (CUDA builds only):
# all(tensors[i].data_ptr() == ptrs[i] for i in indices).
_data_ptrs_equal: Callable[[Sequence[Any], list[int | None], list[int]], bool] | None = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None
)


class CaptureError(RuntimeError):
    """A graph could not be captured; the entry falls back."""


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
    host_copies: tuple[tuple[int, Tensor, _PinnedRing], ...] = ()
    write_back: tuple[tuple[int, Tensor], ...] = ()  # mutated inputs: (index, static buffer)
    static_idx: list[int] = dataclasses.field(default_factory=list)
    static_ptrs: list[int | None] = dataclasses.field(default_factory=list)
    outputs: Sequence[Any] = ()
    aliases: tuple[int | None, ...] = ()  # output j is input aliases[j] itself
    out_tuple: bool = True
    hits: int = 0


class GraphCache:
    """Run a compiled graph through per-signature CUDA graphs, falling back when needed.

    Args:
        unfused: The graph without fusion; returns a tuple or list of outputs.
        fused: The fused graph, or None when nothing was fused.
        config: Options; reads ``cudagraphs``, ``warmup_iterations``, ``max_graphs``,
            ``batch_buckets``, ``static_outputs``, ``validate`` and ``fusion``.
        device: The CUDA device the graph runs on; None for a CPU graph (never captured,
            no CUDA call at all).
        static_input_indices: Inputs used in place (parameters, buffers): not copied, not
            padded, not in the key; their addresses are checked on each hit.
        mutated_input_indices: Inputs the graph writes into; the write reaches the caller's
            tensor exactly once per call.
        host_inputs: Input index -> device, for inputs the caller passes on the CPU but the
            graph reads on that device; the copy becomes part of the replayed input copy.
        name: Used in logs and readable keys.
        batch_size_input_indices: Integer inputs that carry the batch size (a dynamic-shape
            symbol); with ``batch_buckets`` they are replaced by the bucket like the padded
            tensors. Other integers are passed unchanged.
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
        self._batch_ints = frozenset(batch_size_input_indices)
        self.name = name
        self._label_prefix = f"{name}#{next(_serials)}"
        self._buckets = config.batch_buckets
        self._static_outputs = config.static_outputs
        self._capture = device is not None and (
            config.cudagraphs is True or (config.cudagraphs is None and torch.cuda.is_available())
        )
        # Device whose replays are ordered across streams (None: test doubles without CUDA).
        self._replay_device: int | None = None
        if self._capture and torch.cuda.is_available():
            index = device.index
            self._replay_device = index if index is not None else torch.cuda.current_device()
        # Where a key goes when the fused graph is not (or no longer) an option.
        self._unfused_mode = GRAPH_REPLAY if self._capture else EAGER
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()
        self._verdicts: dict[Key, tuple[str, str]] = {}
        self._warned = False  # this cache's one warning (fallback or eviction) was issued
        self._evicting = False
        # Held for lookup, misses and the whole copy-in/replay/copy-out of captured entries:
        # static buffers are shared by every call of a key. Reentrant: a callable that calls
        # back into this cache (a compiled function calling itself) must not deadlock.
        self._lock = threading.RLock()
        # (number of args, indices of the non-static ones), swapped as one object so that a
        # concurrent call never pairs one arity with the other's indices.
        self._layout: tuple[int, tuple[int, ...], tuple[int, ...]] = (-1, (), ())
        _stats.register_cache(self)

    # ----------------------------------------------------------------------------- hot path

    def __call__(self, *args: Any) -> Sequence[Any]:
        user_args = args
        batch = bucket = None
        if self._buckets is not None:
            args, batch, bucket = self._pad(args)
        key = self._key(args)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                COUNTERS.cache_misses += 1
                return self._miss(key, args, user_args, batch, bucket)
            self._entries.move_to_end(key)
            COUNTERS.cache_hits += 1
            entry.hits += 1
            if entry.graph is not None:
                if entry.static_idx and not _ptrs_equal(args, entry.static_ptrs, entry.static_idx):
                    return self._rerecord(key, entry, args, user_args, batch, bucket)
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
                why = f"fused graph raised {type(exc).__name__}: {_one_line(exc)}"
                mode, reason = self._fall_back(key, FUSION, self._unfused_mode, why, entry.reason)
                entry.mode, entry.fn, entry.reason = mode, self._unfused, reason
                self._remember(key, mode, reason)
            return outputs

    def _key(self, args: tuple[Any, ...]) -> Key:
        nargs, dynamic, scalars = self._layout
        if nargs != len(args):
            dynamic = tuple(i for i in range(len(args)) if i not in self._static)
            # CPU 0-d tensors (a Python float under dynamic shapes becomes one) are read on
            # the host at launch, so a captured graph keeps the value it had: their values
            # are part of the key. Dynamo guards device and rank, so the set is fixed.
            scalars = tuple(
                i
                for i in dynamic
                if self._capture
                and isinstance(args[i], Tensor)
                and args[i].dim() == 0
                and args[i].device.type == "cpu"
            )
            self._layout = (len(args), dynamic, scalars)
        items = args if len(dynamic) == len(args) else [args[i] for i in dynamic]
        return (
            self._fused is not None and _stats.fusion_enabled(),
            *[
                (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, Tensor) else (type(a), a)
                for a in items
            ],
            *[(float, args[i].item()) for i in scalars],
        )

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
        with _CAPTURE.replay_lock:
            _wait_for_last_replay(self._replay_device)
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
        for i, buf in entry.write_back:
            dst = user_args[i]
            dst.copy_(buf if batch is None else buf[: dst.shape[0]])
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
            self._write_back(call_args, user_args)
        return outputs if bucket is None else _slice(outputs, batch, bucket)

    # ------------------------------------------------------------------------ miss handling

    def _miss(
        self,
        key: Key,
        args: tuple[Any, ...],
        user_args: tuple[Any, ...],
        batch: int | None,
        bucket: int | None,
    ) -> Sequence[Any]:
        verdict = self._verdicts.get(key)
        if verdict is not None:
            mode, reason = verdict
        else:
            mode, reason = (FUSION if key[0] else self._unfused_mode), None
        outputs = None
        if mode == FUSION and verdict is None:
            outputs, failure = self._first_fused_run(args, user_args)
            if failure is not None:
                mode, reason = self._fall_back(key, FUSION, self._unfused_mode, failure, reason)
            if bucket is not None:
                outputs = _slice(outputs, batch, bucket)
        if outputs is None:
            fn = self._fused if mode == FUSION else self._unfused
            outputs = self._direct(fn, args, user_args, batch, bucket)
        entry = self._settle(key, mode, reason, args)
        self._insert(key, entry)
        return outputs

    def _first_fused_run(
        self, args: tuple[Any, ...], user_args: tuple[Any, ...]
    ) -> tuple[Sequence[Any] | None, str | None]:
        """Run the fused callable once, validating it; return (outputs, failure reason).

        The fused and the reference run each write into their own clones of the mutated
        inputs; the winner's clones are copied into the caller's tensors, so the mutation
        happens once and a fused callable that fails halfway leaves no trace.
        """
        assert self._fused is not None
        COUNTERS.fusion_attempts += 1
        dev_args = self._to_device(args) if self._host else args
        mutated = [i for i in self._mutated if i < len(args) and isinstance(args[i], Tensor)]
        fused_args = _with_clones(dev_args, mutated)
        # The reference run must draw the same random numbers (dropout in the graph) and
        # leave the generators where one run of the model would.
        rng = _RngState(self._device)
        try:
            outputs = self._fused(*fused_args)
        except Exception as exc:
            # Run the unfused graph: if it raises too, the error is the model's own (an
            # out-of-range index, a shape error) and reaches the caller as eager's would,
            # without being counted or logged as a fusion failure.
            rng.restore()
            ref_args = _with_clones(dev_args, mutated)
            try:
                expected = self._unfused(*ref_args)
            except Exception:
                raise exc from None  # the fused error names the bad value (kernels' checks)
            self._write_back(ref_args, user_args)
            return expected, f"fused graph raised {type(exc).__name__}: {_one_line(exc)}"
        winner, failure = fused_args, None
        if self._config.validate:
            ref_args = _with_clones(dev_args, mutated)
            rng.restore()
            expected = self._unfused(*ref_args)
            failure = _mismatch(outputs, expected, "output")
            for i in mutated:
                failure = failure or _mismatch(
                    [fused_args[i]], [ref_args[i]], f"mutated input {i} after"
                )
            if failure is not None:
                failure = f"fused graph does not match the unfused graph: {failure}"
                outputs, winner = expected, ref_args
        if failure is None:
            COUNTERS.fusion_successes += 1
        self._write_back(winner, user_args)
        return outputs, failure

    def _settle(self, key: Key, mode: str, reason: str | None, args: tuple[Any, ...]) -> _Entry:
        """Make the entry for ``key`` starting from ``mode``: capture, or fall back."""
        entry = None
        while entry is None and self._capture and mode != EAGER:
            fn = self._fused if mode == FUSION else self._unfused
            assert fn is not None
            try:
                entry = self._record(mode, fn, args)
            except Exception as exc:
                COUNTERS.capture_failures += 1
                why = f"capture failed: {type(exc).__name__}: {_one_line(exc)}"
                next_mode = GRAPH_REPLAY if mode == FUSION else EAGER
                mode, reason = self._fall_back(key, mode, next_mode, why, reason)
        if entry is None:
            entry = _Entry(mode, self._fused if mode == FUSION else self._unfused)
        entry.reason = reason
        if reason is not None:
            self._remember(key, mode, reason)
        return entry

    def _warn_once(self) -> int:
        """WARNING for this cache's first noteworthy event, INFO after that."""
        if self._warned:
            return logging.INFO
        self._warned = True
        return logging.WARNING

    def _remember(self, key: Key, mode: str, reason: str) -> None:
        """Keep a key's fallback verdict, so it never retries (bounded: oldest dropped)."""
        if key not in self._verdicts and len(self._verdicts) >= _MAX_VERDICTS:
            del self._verdicts[next(iter(self._verdicts))]
        self._verdicts[key] = (mode, reason)

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
        log.info(
            "%s: static input(s) %s changed address; re-recording %s",
            self.name,
            moved,
            self._label(key),
        )
        # Drop the old graph before capturing the new one so both never coexist in memory.
        del self._entries[key]
        outputs = self._direct(entry.fn, args, user_args, batch, bucket)
        new = self._settle(key, entry.mode, entry.reason, args)
        new.hits = entry.hits
        self._insert(key, new)
        return outputs

    def _record(self, mode: str, fn: Callable[..., Sequence[Any]], args: tuple[Any, ...]) -> _Entry:
        inputs = list(args)
        copies: list[tuple[int, Tensor]] = []
        host_copies: list[tuple[int, Tensor, _PinnedRing]] = []
        static_idx: list[int] = []
        static_ptrs: list[int | None] = [None] * len(args)
        for i, a in enumerate(args):
            if not isinstance(a, Tensor):
                continue
            if i in self._static:
                static_idx.append(i)
                static_ptrs[i] = a.data_ptr()
            elif a.dim() == 0 and a.device.type == "cpu":
                continue  # read on the host at capture, baked in: its value is in the key
            elif i in self._host and a.device.type == "cpu":
                buf = torch.empty_like(a, device=self._host[i])
                ring = _PinnedRing(a)
                ring.copy(buf, a)
                host_copies.append((i, buf, ring))
                inputs[i] = buf
            else:
                buf = torch.empty_like(a)
                buf.copy_(a)
                copies.append((i, buf))
                inputs[i] = buf
        # Warm-up and capture write into mutated parameters/buffers too; this call's write
        # already happened in the direct run, so their state is put back afterwards.
        saved = [(args[i], args[i].clone()) for i in static_idx if i in self._mutated]
        try:
            graph, outputs = capture_graph(
                fn, inputs, device=self._device, warmup_iterations=self._config.warmup_iterations
            )
        finally:
            with torch.no_grad():
                for tensor, value in saved:
                    tensor.copy_(value)
        COUNTERS.recordings += 1
        in_place = {id(inputs[i]): i for i, a in enumerate(args) if isinstance(a, Tensor)}
        host_idx = {i for i, _, _ in host_copies}
        aliases = tuple(
            in_place.get(id(out)) if isinstance(out, Tensor) else None for out in outputs
        )
        # A returned host input lives on the device in the graph; the caller's tensor is on
        # the CPU, so it is returned as a device copy like any other output.
        aliases = tuple(None if a in host_idx else a for a in aliases)
        buffers = {i: buf for i, buf in copies} | {i: buf for i, buf, _ in host_copies}
        return _Entry(
            mode=mode,
            fn=fn,
            graph=graph,
            copy_idx=tuple(i for i, _ in copies),
            copy_bufs=[buf for _, buf in copies],
            host_copies=tuple(host_copies),
            write_back=tuple((i, buffers[i]) for i in self._mutated if i in buffers),
            static_idx=static_idx,
            static_ptrs=static_ptrs,
            outputs=tuple(outputs),
            aliases=aliases,
            out_tuple=isinstance(outputs, tuple),
        )

    def _insert(self, key: Key, entry: _Entry) -> None:
        self._entries[key] = entry
        while len(self._entries) > self._config.max_graphs:
            old_key, _ = self._entries.popitem(last=False)
            COUNTERS.evictions += 1
            if not self._evicting:
                self._evicting = True
                log.log(
                    self._warn_once(),
                    "%s: more than max_graphs=%d input signatures; the oldest are evicted "
                    "and re-captured when they return (raise max_graphs, or use batch_buckets "
                    "for varying batch sizes)",
                    self.name,
                    self._config.max_graphs,
                )
            log.debug(
                "%s: evicted %s (max_graphs=%d)",
                self.name,
                self._label(old_key),
                self._config.max_graphs,
            )

    # ------------------------------------------------------------------------- arg plumbing

    def _to_device(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        moved = list(args)
        for i, device in self._host.items():
            if i < len(args) and isinstance(args[i], Tensor) and args[i].device.type == "cpu":
                moved[i] = args[i].to(device, non_blocking=True)
        return tuple(moved)

    def _write_back(self, call_args: Sequence[Any], user_args: tuple[Any, ...]) -> None:
        """Copy mutated inputs that ran on a copy (padded, moved, cloned) into the caller's."""
        for i in self._mutated:
            if i >= len(user_args):
                continue
            src, dst = call_args[i], user_args[i]
            if src is dst or not isinstance(dst, Tensor):
                continue
            dst.copy_(src if src.shape == dst.shape else src[: dst.shape[0]])

    def _pad(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], int | None, int | None]:
        """Zero-pad the batch dim of non-static inputs to the next bucket."""
        assert self._buckets is not None
        batch = next(
            (
                a.shape[0]
                for i, a in enumerate(args)
                if i not in self._static and isinstance(a, Tensor) and a.dim() > 0
            ),
            None,
        )
        if batch is None:
            return args, None, None
        pos = bisect.bisect_left(self._buckets, batch)
        if pos == len(self._buckets) or self._buckets[pos] == batch:
            return args, None, None
        bucket = self._buckets[pos]
        padded = list(args)
        for i, a in enumerate(args):
            if i in self._static:
                continue
            if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == batch:
                p = a.new_zeros((bucket, *a.shape[1:]))
                p[:batch] = a
                padded[i] = p
            elif i in self._batch_ints and type(a) is int and a == batch:
                padded[i] = bucket
        return tuple(padded), batch, bucket

    # -------------------------------------------------------------------------- inspection

    def key_for(self, *args: Any) -> Key:
        """The cache key a call with ``args`` uses (after batch-bucket padding)."""
        if self._buckets is not None:
            args = self._pad(args)[0]
        return self._key(args)

    def mode_for(self, *args: Any) -> str | None:
        """The mode a call with ``args`` would run in now, or None if it would be a miss."""
        key = self.key_for(*args)
        with self._lock:
            entry = self._entries.get(key)
        return None if entry is None else entry.mode

    def describe(self) -> list[dict[str, Any]]:
        """One dict per live entry: key (readable), mode, reason, captured, hits."""
        with self._lock:
            items = list(self._entries.items())
        return [
            {
                "key": self._label(key),
                "mode": entry.mode,
                "reason": entry.reason,
                "captured": entry.graph is not None,
                "hits": entry.hits,
            }
            for key, entry in items
        ]

    def stats_rows(self) -> list[StatsRow]:
        with self._lock:
            items = list(self._entries.items())
        return [
            StatsRow(self._label(key), _shapes(key), entry.mode, entry.reason)
            for key, entry in items
        ]

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (captured graphs, static buffers) and every fallback verdict."""
        with self._lock:
            self._entries.clear()
            self._verdicts.clear()

    def __repr__(self) -> str:
        return (
            f"GraphCache({self._label_prefix}, device={self._device}, "
            f"capture={self._capture}, entries={len(self._entries)})"
        )

    def _label(self, key: Key) -> str:
        own = self._device if self._device is not None else torch.device("cpu")
        parts = []
        for item in key[1:]:
            if len(item) == 4:
                shape, stride, dtype, device = item
                text = f"{str(dtype).removeprefix('torch.')}{list(shape)}"
                if tuple(stride) != _contiguous_strides(shape):
                    text += f"/strides{tuple(stride)}"
                if device.type != own.type or (own.index is not None and device != own):
                    text += f"@{device}"
            else:
                text = repr(item[1])
            parts.append(text)
        return f"{self._label_prefix} {'fused' if key[0] else 'unfused'} ({', '.join(parts)})"


# ----------------------------------------------------------------------------- capture


class _CaptureState:
    """Per-device side streams and the shared graph memory pools."""

    def __init__(self) -> None:
        # One capture at a time in the process: two captures must not allocate into the same
        # pool at once (the allocator refuses: "already recording to mempool_id").
        self.lock = threading.RLock()
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.pools: dict[int, Any] = {}
        # Every pool handed out since the last release, including retired ones whose graphs
        # may still be alive: pool_bytes() counts them all.
        self.pool_ids: set[tuple[int, int]] = set()
        # Live graphs captured into each device's current pool. The allocator drops a pool
        # whose last graph died and then asserts ("use_count > 0") if its id is reused, so a
        # pool with no live graph (all evicted or cleared, or only failed captures) is
        # replaced by a fresh one. Measured on an H200 (torch 2.11): reusing it broke every
        # later capture on the device.
        self.pool_users: dict[int, weakref.WeakSet] = {}
        # The stream of each device's last replay, and the lock that makes "wait for it,
        # then queue this replay" one step (see _wait_for_last_replay).
        self.replay_streams: dict[int, tuple[int, int, int]] = {}
        self.replay_lock = threading.Lock()


_CAPTURE = _CaptureState()


def _wait_for_last_replay(index: int) -> None:
    """Make the caller's stream wait for the device's last replay if it ran on another stream.

    The graphs of a device share one memory pool, and each entry its static buffers, so a
    replay must not overlap the one before it. On one stream they queue in order; a thread
    replaying on its own stream would otherwise copy its inputs over buffers that a replay
    still queued on another stream has yet to read. Free when the stream does not change.
    """
    # (stream id, device, device type), as torch.cuda.current_stream reads it, without
    # building a Stream object on every call.
    current = torch._C._cuda_getCurrentStream(index)
    last = _CAPTURE.replay_streams.get(index)
    if last is not None and last != current:
        _stream(current).wait_stream(_stream(last))
    _CAPTURE.replay_streams[index] = current


def _stream(data: tuple[int, int, int]) -> torch.cuda.Stream:
    return torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])


def _live_pool(index: int) -> Any:
    """The device's shared pool, or a fresh one when no live graph holds the current one."""
    pool = _CAPTURE.pools.get(index)
    if pool is None or not _CAPTURE.pool_users.get(index):
        pool = _CAPTURE.pools[index] = torch.cuda.graph_pool_handle()
        _CAPTURE.pool_ids.add(tuple(pool))
        _CAPTURE.pool_users[index] = weakref.WeakSet()
    return pool


def capture_graph(
    fn: Callable[..., Sequence[Any]],
    inputs: Sequence[Any],
    *,
    device: torch.device,
    warmup_iterations: int,
) -> tuple[Any, Sequence[Any]]:
    """Warm ``fn`` up on a side stream, capture it; return (graph, its output buffers).

    Raises (``CaptureError`` or what ``fn`` raised) with the capture ended, the caller's
    stream current again, and the shared pool retired if the allocator may still consider
    it in use by the failed capture. This is the one place that touches CUDA graphs, so
    tests replace it to drive the runtime without a GPU.
    """
    for i, x in enumerate(inputs):
        # CPU 0-d tensors are baked in by value, which GraphCache keys on; any other CPU
        # tensor would silently keep its capture-time contents.
        if isinstance(x, Tensor) and x.device.type != "cuda" and x.dim() != 0:
            raise CaptureError(
                f"input {i} is a {x.device.type} tensor: a CUDA graph would replay the value "
                f"it had during capture"
            )
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _CAPTURE.lock:
        stream = _CAPTURE.streams.get(index)
        if stream is None:
            stream = _CAPTURE.streams[index] = torch.cuda.Stream(device=index)
        caller = torch.cuda.current_stream(index)
        stream.wait_stream(caller)
        try:
            # torch.cuda.stream restores the caller's stream on the way out even when capture
            # fails; torch.cuda.graph's own __exit__ skips that when capture_end raises, and
            # hides whether the body or the capture failed, hence begin/end by hand.
            with torch.cuda.stream(stream):
                for _ in range(warmup_iterations):
                    fn(*inputs)
                pool = _live_pool(index)
                graph = torch.cuda.CUDAGraph()
                # A failed capture can leave the generator "capturing" (capture_end raised
                # before the RNG epilogue; on torch 2.11 also after a body that raised), and
                # every later torch.randn on the device raises "Offset increment outside
                # graph capture". Its state is put back from this copy on any failure.
                rng = torch.cuda.default_generators[index]
                rng_before = rng.clone_state()
                try:
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    try:
                        outputs = fn(*inputs)
                    except BaseException:
                        _end_capture(graph, index, pool)
                        raise
                    error = _end_capture(graph, index, pool)
                    if error is not None:
                        raise CaptureError(f"capture ended with {type(error).__name__}: {error}")
                except BaseException:
                    rng.graphsafe_set_state(rng_before)
                    raise
                _CAPTURE.pool_users[index].add(graph)
        finally:
            caller.wait_stream(stream)
    for j, out in enumerate(outputs):
        if isinstance(out, Tensor) and out.device.type != "cuda":
            raise CaptureError(
                f"output {j} is a {out.device.type} tensor: it would keep its capture-time value"
            )
    return graph, outputs


def _end_capture(graph: Any, index: int, pool: Any) -> Exception | None:
    """End a capture; on failure, undo what the failed ``capture_end`` left behind.

    When the capture was invalidated (an illegal call such as a host sync), torch's
    ``capture_end`` raises on ``cudaStreamEndCapture`` (which does end the capture) before it
    tells the caching allocator to stop routing allocations to the pool and before it marks
    the capture ended, so the graph's destructor never drops its reference to the pool.
    Left so, every later capture into the shared pool fails ("already recording to
    mempool_id") and the pool is never freed.
    """
    try:
        graph.capture_end()
    except Exception as exc:
        if _CAPTURE.pools.get(index) == pool:
            del _CAPTURE.pools[index]  # retired: the next capture gets a fresh pool
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        release = getattr(torch._C, "_cuda_releasePool", None)
        if end is not None and release is not None:
            try:
                end(index, pool)
            except RuntimeError:
                pass  # capture_end got past its own end call: nothing left registered
            else:
                release(index, pool)
        return exc
    return None


def release_pools() -> None:
    """Forget the shared pools (new captures get fresh ones); their memory is freed when the
    last graph using each is gone and the allocator's cache is emptied."""
    with _CAPTURE.lock:
        _CAPTURE.pools.clear()
        _CAPTURE.pool_ids.clear()
        _CAPTURE.pool_users.clear()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        # Warm-up on the side stream gives it its own cuBLAS workspace, which otherwise
        # stays allocated (and counted by memory_allocated) forever.
        if clear_workspaces is not None and torch.cuda.is_initialized():
            clear_workspaces()


def pool_bytes() -> int:
    """Device memory reserved by the shared graph pools (0 without CUDA)."""
    with _CAPTURE.lock:
        ids = set(_CAPTURE.pool_ids)
    if not ids or not torch.cuda.is_initialized():
        return 0
    return sum(
        segment["total_size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment.get("segment_pool_id", ())) in ids
    )


class _PinnedRing:
    """Pinned staging buffers for one host input, each guarded by the event of its last copy.

    ``copy`` never syncs the host unless ``_MAX_STAGING_SLOTS`` copies are still in flight.
    """

    __slots__ = ("_shape", "_dtype", "_slots", "_next")

    def __init__(self, like: Tensor) -> None:
        self._shape = like.shape
        self._dtype = like.dtype
        self._slots = [self._new_slot()]
        self._next = 0

    def _new_slot(self) -> tuple[Tensor, torch.cuda.Event]:
        return torch.empty(self._shape, dtype=self._dtype, pin_memory=True), torch.cuda.Event()

    def copy(self, dst: Tensor, src: Tensor) -> None:
        slots = self._slots
        i = self._next
        staging, done = slots[i]
        if not done.query():
            if len(slots) < _MAX_STAGING_SLOTS:
                slots.insert(i, self._new_slot())
                staging, done = slots[i]
            else:
                done.synchronize()
        staging.copy_(src)
        dst.copy_(staging, non_blocking=True)
        done.record()
        self._next = (i + 1) % len(slots)


# ------------------------------------------------------------------------------ helpers


def _ptrs_equal(args: tuple[Any, ...], ptrs: list[int | None], idx: list[int]) -> bool:
    if _data_ptrs_equal is not None:
        return _data_ptrs_equal(list(args), ptrs, idx)  # the binding takes lists, not tuples
    return all(args[i].data_ptr() == ptrs[i] for i in idx)


class _RngState:
    """The CPU generator's state and, for a CUDA graph, that device's, to replay draws."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        on_cuda = device is not None and torch.cuda.is_available()
        self.cuda = torch.cuda.get_rng_state(device) if on_cuda else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def _with_clones(args: tuple[Any, ...], indices: Iterable[int]) -> list[Any]:
    out = list(args)
    for i in indices:
        out[i] = args[i].clone()
    return out


def _slice(outputs: Sequence[Any], batch: int | None, bucket: int) -> Sequence[Any]:
    sliced = [
        o[:batch] if isinstance(o, Tensor) and o.dim() > 0 and o.shape[0] == bucket else o
        for o in outputs
    ]
    return tuple(sliced) if isinstance(outputs, tuple) else sliced


def _mismatch(actual: Sequence[Any], expected: Sequence[Any], what: str) -> str | None:
    """Why ``actual`` is not ``expected`` within the per-dtype tolerances, or None."""
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for j, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if isinstance(e, Tensor):
            if not isinstance(a, Tensor):
                return f"{what} {j} is a {type(a).__name__}, expected a tensor"
            # Dtypes not in the table get assert_close's defaults (exact for integers).
            rtol, atol = _TOLERANCES.get(e.dtype, (None, None))
            try:
                torch.testing.assert_close(
                    a, e, rtol=rtol, atol=atol, equal_nan=True, check_stride=False
                )
            except AssertionError as exc:
                return f"{what} {j}: {_one_line(exc)}"
        elif isinstance(a, Tensor) or a != e:
            return f"{what} {j} is {a!r}, expected {e!r}"
    return None


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shapes(key: Key) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(item[0]) for item in key[1:] if len(item) == 4)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
