"""Caches by the Dynamo frame they were compiled for, in compile order, so that a newer
compilation of one function hands a shape back to an older one that holds it and computes
the same function there (``route``), or else takes over the shapes older ones served
(``supersede``).

A cache takes part through its public surface (``Member``): its fixed ``Identity``, its entry
table (``table.EntryTable``), its last call on the use clock, whether it pads, and
``routed_call``; this module never reads a cache's private state.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fusebackend.runtime import specialization as spec
from fusebackend.runtime.keys import Key, Signatures, tensor_signature
from fusebackend.runtime.table import EntryTable

__all__ = ["Identity", "Member", "Route", "compiling", "register", "route", "supersede"]


@dataclasses.dataclass(frozen=True, eq=False)
class Identity:
    """What a graph cache is, fixed at its creation: what routing and supersession compare.

    Args:
        frame: The Dynamo frame (and recompile slot) it was compiled for; None outside a
            compile (such a cache is neither routed nor superseding).
        device: Its CUDA device, None for a CPU graph.
        form: Its graph without size arithmetic (``specialization.form_of``), or None (never
            routed to or from).
        symbols: Input index -> the dynamic-shape symbols of its dims or value
            (``buckets.symbols_of``), or None.
        signatures: Builds its keys (``keys.Signatures``).
        created: The use clock at its creation (``supersede``).
    """

    frame: Any
    device: torch.device | None
    form: spec.GraphForm | None
    symbols: dict[int, Any] | None
    signatures: Signatures
    created: int
    # How each older cache's graph relates to this one's (``specialization``; False: it
    # cannot serve it), computed once per pair by ``route``.
    relations: weakref.WeakKeyDictionary[Any, Any] = dataclasses.field(
        default_factory=weakref.WeakKeyDictionary, repr=False
    )


class Member(Protocol):
    """What this module reads of a graph cache (``GraphCache``'s public surface)."""

    label_prefix: str  # ``name#number``: how logs and ``describe()`` name it

    @property
    def identity(self) -> Identity: ...

    @property
    def table(self) -> EntryTable: ...

    @property
    def last_call(self) -> int:
        """The use clock at its last call."""
        ...

    @property
    def bucketed(self) -> bool:
        """Whether its keys are padded shapes (batch or length buckets): never routed."""
        ...

    def routed_call(self, args: tuple[Any, ...]) -> Sequence[Any]:
        """A call handed over by a newer compilation (its inputs already picked)."""
        ...


# Caches by the Dynamo frame they were compiled for, in compile order (see supersede).
_FRAMES: dict[Any, list[weakref.ref[Member]]] = {}
_FRAMES_LOCK = threading.Lock()


def compiling() -> tuple[Any, Any] | None:
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


def register(cache: Member, compiled: tuple[Any, Any] | None) -> None:
    """List ``cache`` under the Dynamo frame being compiled (``compiled``: what
    ``compiling()`` gave; None outside a compile: such a cache supersedes nothing)."""
    if compiled is None:
        return
    frame = compiled[0]
    with _FRAMES_LOCK:
        if compiled[1] == 0:
            # A frame's first compilation: caches listed under its number belong to
            # another function, compiled before a torch._dynamo.reset().
            _FRAMES[frame] = []
        siblings = _FRAMES.setdefault(frame, [])
        siblings[:] = [ref for ref in siblings if ref() is not None]
        siblings.append(weakref.ref(cache))


def _older(cache: Member) -> list[Member]:
    """The live caches of earlier compilations of ``cache``'s function, oldest first."""
    with _FRAMES_LOCK:
        refs = list(_FRAMES.get(cache.identity.frame, ()))
    older = []
    for ref in refs:
        other = ref()
        if other is cache:
            break
        if other is not None:
            older.append(other)
    return older


class Route:
    """A signature of a newer compilation served by an older one: ``picks`` takes the older
    graph's inputs from the newer graph's (an int: that input; a tuple: this value);
    ``key``: the signature in the older cache."""

    __slots__ = ("_cache", "_picks", "key")

    def __init__(self, cache: Member, picks: tuple[Any, ...], key: Key) -> None:
        self._cache = weakref.ref(cache)
        self._picks = picks
        self.key = key

    @property
    def cache(self) -> Member | None:
        """The older cache, None once it is gone."""
        return self._cache()

    def call(self, args: tuple[Any, ...]) -> Any:
        """The older cache's outputs for ``args``, or None when that cache is gone."""
        cache = self._cache()
        if cache is None:
            return None
        return cache.routed_call(_pick(args, self._picks))


def _pick(args: tuple[Any, ...], picks: tuple[Any, ...]) -> tuple[Any, ...]:
    """The older graph's inputs: ``args[p]`` for an int pick, the value of a tuple one."""
    return tuple(args[p] if isinstance(p, int) else p[0] for p in picks)


def route(cache: Member, key: Key, args: tuple[Any, ...]) -> Route | None:
    """An older compilation of ``cache``'s function that holds an entry for this call and
    computes the same function for it (``specialization``), newest first; or None.

    A second pass over a corpus after Dynamo's recompiles hands every shape to the newest
    graph; each shape an older graph had captured was run, captured and kept a second
    time there (``specialization``'s docstring gives the measurement). Routed, it replays
    the older graph's capture. Only caches without batch or length buckets (their keys
    are padded shapes) and on the same device take part."""
    own = cache.identity
    form = own.form
    if form is None or cache.bucketed:
        return None
    newer_values = None
    for other in reversed(_older(cache)):
        theirs = other.identity
        if theirs.form is None or other.bucketed or theirs.device != own.device:
            continue
        relation = own.relations.get(other)
        if relation is None:
            relation = spec.specialization(theirs.form, form) or False  # once per pair
            own.relations[other] = relation
        if relation is False:
            continue
        if newer_values is None:
            newer_values = spec.binding(own.symbols or {}, args)
        picks = _picks(theirs, relation, args)
        if picks is None:
            continue
        mapped = _pick(args, picks)
        older_values = spec.binding(theirs.symbols or {}, mapped)
        if not spec.holds(relation.checks, newer_values, older_values):
            continue
        older_key = theirs.signatures.key(mapped)
        if older_key in other.table:
            return Route(other, picks, older_key)
    return None


def _picks(
    other: Identity, relation: spec.Specialization, args: tuple[Any, ...]
) -> tuple[Any, ...] | None:
    """The older graph's inputs as picks (``Route``): the newer graph's input of the same
    name; for a scalar (a size the older graph takes as an input), its value in the older
    graph's own tensor sizes where they have it (the same-named input must agree), else
    the same-named input. None where a scalar has neither."""
    assert other.form is not None
    sizes = other.form.input_sizes
    tensors = tuple(args[j] if j is not None and sizes[i] is None else None
                    for i, j in enumerate(relation.inputs))  # fmt: skip
    values = spec.binding(other.symbols or {}, tensors)
    picks: list[Any] = []
    for j, size in zip(relation.inputs, sizes, strict=True):
        if size is None:
            picks.append(j)
            continue
        value = spec.evaluate(size, values)
        if isinstance(value, int):
            if j is not None and args[j] != value:
                return None
            picks.append((value,))
        elif j is not None:
            picks.append(j)
        else:
            return None
    return tuple(picks)


def supersede(cache: Member, key: Key) -> int:
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
    of the caller's own shapes (``GraphCache``'s padded calls).
    """
    created = cache.identity.created
    older = [other for other in _older(cache) if other.last_call < created]
    if not older:
        return 0
    signature = tensor_signature(key)
    seen = 0
    for other in older:
        # Never wait on another cache's lock while holding this one's (two caches
        # superseding each other would deadlock); a busy cache keeps its entry for now.
        table = other.table
        if not table.lock.acquire(blocking=False):
            continue
        try:
            for old in [k for k in table.keys() if tensor_signature(k) == signature]:
                seen = max(seen, table[old].hits + 1)
                table.evict(old, "superseded")
        finally:
            table.lock.release()
    return seen
