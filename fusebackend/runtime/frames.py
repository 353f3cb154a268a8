"""Caches by the Dynamo frame they were compiled for, in compile order, so that a newer
compilation of one function takes over the shapes older ones served (``supersede``)."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from fusebackend.runtime.keys import Key, tensor_signature

if TYPE_CHECKING:
    from fusebackend.runtime.graph_cache import GraphCache

__all__ = ["register", "supersede"]

# Caches by the Dynamo frame they were compiled for, in compile order (see supersede).
_FRAMES: dict[Any, list[weakref.ref[GraphCache]]] = {}
_FRAMES_LOCK = threading.Lock()


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


def register(cache: GraphCache) -> Any:
    """List ``cache`` under the Dynamo frame being compiled; return that frame (None outside
    a compile: such a cache supersedes nothing)."""
    compiled = _compile_frame()
    if compiled is None:
        return None
    frame = compiled[0]
    with _FRAMES_LOCK:
        if compiled[1] == 0:
            # A frame's first compilation: caches listed under its number belong to
            # another function, compiled before a torch._dynamo.reset().
            _FRAMES[frame] = []
        siblings = _FRAMES.setdefault(frame, [])
        siblings[:] = [ref for ref in siblings if ref() is not None]
        siblings.append(weakref.ref(cache))
    return frame


def supersede(cache: GraphCache, key: Key) -> int:
    """Drop the entries of older compilations of ``cache``'s function that served the tensor
    shapes of ``key``; return how many calls they had (0: none).

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
    of the caller's own shapes (``GraphCache._supersede_unpadded``).
    """
    with _FRAMES_LOCK:
        refs = list(_FRAMES.get(cache._frame, ()))
    older = []
    for ref in refs:
        other = ref()
        if other is cache:
            break
        if other is not None and other._last_call < cache._created:
            older.append(other)
    if not older:
        return 0
    signature = tensor_signature(key)
    seen = 0
    for other in older:
        # Never wait on another cache's lock while holding this one's (two caches
        # superseding each other would deadlock); a busy cache keeps its entry for now.
        if not other._lock.acquire(blocking=False):
            continue
        try:
            for old in [k for k in other._entries if tensor_signature(k) == signature]:
                seen = max(seen, other._entries[old].hits + 1)
                other._evict(old, "superseded")
        finally:
            other._lock.release()
    return seen
