"""Batch and length buckets of a graph cache: the one-time checks of which inputs carry the
batch and the length, a call padded to a length bucket (checked against the unpadded run on
the bucket's first call), and the key a padded call uses. The padding itself is
``buckets.py``'s; ``GraphCache`` takes these methods from ``Padding``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from fusebackend.runtime.buckets import LengthInputs, length_inputs, pad, pad_length, slice_length
from fusebackend.runtime.entries import Call, Entry
from fusebackend.runtime.keys import Key, Signatures
from fusebackend.runtime.validation import mismatch, one_line

# GraphCache's logger: these are the cache's methods, and its records keep one name.
log = logging.getLogger("fusebackend.runtime.graph_cache")

__all__ = ["Padding"]


class Padding:
    """The bucket part of ``GraphCache`` (a mixin: the state below is set by its __init__)."""

    name: str
    _static: frozenset[int]
    _mutated: tuple[int, ...]
    _batch_ints: frozenset[int]
    _buckets: tuple[int, ...] | None
    _buckets_checked: bool
    _symbols: dict[int, Any] | None
    _lengths: tuple[int, ...] | None
    _length_plan: LengthInputs | None
    _lengths_checked: bool
    _length_state: dict[int, tuple[bool, ...] | str]
    _signatures: Signatures
    _unfused: Callable[..., Sequence[Any]]
    _lock: threading.RLock
    _entries: OrderedDict[Key, Entry]
    _call: Callable[..., Sequence[Any]]
    _direct: Callable[[Callable[..., Sequence[Any]], Call], Sequence[Any]]
    _drop: Callable[[Entry], None]
    _ignore: Callable[[str], None]

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
        reference = self._direct(self._unfused, Call(args, args))
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

    def key_for(self, *args: Any) -> Key:
        """The cache key a call with ``args`` uses (after length- and batch-bucket padding)."""
        if self._length_plan is not None:
            padded = pad_length(args, self._length_plan, self._lengths or ())
            if padded is not None and not isinstance(self._length_state.get(padded[2]), str):
                args = padded[0]
        if self._buckets is not None:
            args = pad(args, self._buckets, self._static, self._batch_ints)[0]
        return self._signatures.key(args)
