"""CUDA-graph capture: side streams, the shared memory pools, and the cross-stream order.

``capture_graph`` is the one place that touches CUDA graphs, so tests replace it (on this
module: the graph cache looks it up here on every capture) to drive the runtime without a
GPU.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CaptureError",
    "capture_graph",
    "join_replay_order",
    "retire",
    "pool_bytes",
    "reap",
    "release_pools",
    "side_stream_warm",
    "wait_for_last_replay",
]


class CaptureError(RuntimeError):
    """A graph could not be captured; the entry falls back."""


class _CaptureState:
    """Per-device side streams and the shared graph memory pools."""

    def __init__(self) -> None:
        # One capture at a time in the process: two captures must not allocate into the same
        # pool at once (the allocator refuses: "already recording to mempool_id").
        self.lock = threading.RLock()
        self.streams: dict[int, torch.cuda.Stream] = {}
        # Devices whose side stream has finished a capture that ran a warm-up first
        # (side_stream_warm).
        self.warm_streams: set[int] = set()
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
        # then queue this replay" one step (see wait_for_last_replay).
        self.replay_streams: dict[int, tuple[int, int, int]] = {}
        self.replay_lock = threading.Lock()
        # Dropped entries' graphs and buffers, each held until an event recorded on the
        # device's last replay stream has completed (see retire).
        self.retired: list[tuple[Any, list[Any]]] = []


_CAPTURE = _CaptureState()


def wait_for_last_replay(index: int) -> None:
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


def replay_lock() -> threading.Lock:
    """The lock that makes "wait for the last replay, then queue this one" one step."""
    return _CAPTURE.replay_lock


def join_replay_order(index: int | None) -> None:
    """Put the caller's stream into the device's replay order (None: no CUDA, nothing to do).

    A new signature's capture is called twice: before its first run, so that its copies
    into new static buffers, its side-stream warm-up and its first run queue after every
    replay already queued on other streams; and after the capture, so that the next replay
    on another stream (of this new entry, whose static buffers this stream just filled, or
    of any other) queues after all of it. Without the first, a capture on stream s2 runs
    beside a replay still queued on s1; without the second, a thread on s1 could replay the
    new graph before s2 has written its static buffers.
    """
    if index is None:
        return
    with _CAPTURE.replay_lock:
        wait_for_last_replay(index)


def retire(things: list[Any], index: int | None) -> None:
    """Keep a dropped entry's graph and buffers alive until the device's replays are past.

    An entry dropped by eviction, ``clear`` or a re-record may still have a replay queued on
    another stream (a thread on s1 replayed it; a thread on s2 evicts it). Freed at once, its
    static buffers go back to the caching allocator as free memory of the stream that
    allocated them, and the next allocation there (the evicting call's own new buffers)
    could overwrite them while the queued replay has yet to read them. Held here until an
    event recorded on the device's last replay stream (after every replay so far, through
    the replay order) has completed; released by a later ``retire`` or by ``release_pools``.
    """
    if index is None:
        return  # no CUDA (CPU graphs, test doubles): nothing can be in flight
    with _CAPTURE.replay_lock:
        last = _CAPTURE.replay_streams.get(index)
        stream = _stream(last) if last is not None else None
        event = _new_event()
        event.record(stream)
        _CAPTURE.retired.append((event, things))
    _reap()


def reap() -> None:
    """Free the retired entries whose replays are done (cheap when there are none); called
    before each capture, so a dropped entry does not wait for the next eviction."""
    if _CAPTURE.retired:
        _reap()


def _reap(wait: bool = False) -> None:
    """Drop the retired entries whose replays are done (all of them, waiting, with ``wait``)."""
    with _CAPTURE.replay_lock:
        retired, _CAPTURE.retired = _CAPTURE.retired, []
    keep = []
    for event, things in retired:
        if wait:
            event.synchronize()
        elif not event.query():
            keep.append((event, things))
    with _CAPTURE.replay_lock:
        _CAPTURE.retired.extend(keep)


def _new_event() -> Any:
    return torch.cuda.Event()


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


def side_stream_warm(device: torch.device) -> bool:
    """Whether ``device``'s capture stream has finished a capture with a warm-up: the
    stream-bound lazy set-up (cuBLAS's workspace for the stream) is done, so a graph that
    has just run at the signature being captured (its kernels compiled, launch plans
    built, library plans made for these shapes) needs no warm-up run of its own."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index in _CAPTURE.warm_streams


def capture_graph(
    fn: Callable[..., Sequence[Any]],
    inputs: Sequence[Any],
    *,
    device: torch.device,
    warmup_iterations: int,
) -> tuple[Any, Sequence[Any]]:
    """Warm ``fn`` up on a side stream (``warmup_iterations`` runs; 0 where the caller has
    just run it at these shapes and ``side_stream_warm``), capture it; return (graph, its
    output buffers).

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
                if warmup_iterations:
                    _CAPTURE.warm_streams.add(index)
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
    _reap(wait=True)
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
