"""Batch and length buckets of a graph cache: the one-time checks of which inputs carry the
batch and the length, a call padded to a length bucket (checked against the unpadded run on
the bucket's first call), and the key a padded call uses. The padding itself is
``buckets.py``'s; a ``GraphCache`` owns one ``Padding``, which holds no reference to it (the
cache's calls it needs are passed in).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from fusebackend.config import FusionConfig
from fusebackend.runtime.buckets import LengthInputs, length_inputs, pad, pad_length, slice_length
from fusebackend.runtime.entries import Call
from fusebackend.runtime.keys import Key, Signatures
from fusebackend.runtime.logbook import Logbook
from fusebackend.runtime.table import EntryTable
from fusebackend.runtime.validation import mismatch, one_line

# GraphCache's logger: the cache's parts log under one name.
log = logging.getLogger("fusebackend.runtime.graph_cache")

__all__ = ["Padding"]


class Padding:
    """A graph cache's batch and length buckets.

    Args:
        config: Reads ``batch_buckets`` and ``length_buckets``.
        static: Inputs used in place (never padded).
        mutated: Inputs the graph writes (no length buckets then).
        batch_ints: Integer inputs that carry the batch size (replaced by the bucket).
        symbols: Input index -> dynamic-shape symbols (``buckets.symbols_of``), or None.
        signatures: The cache's key builder (``key_for``).
        unfused: The unfused graph (a length bucket's reference run).
        table: The cache's entries (a rejected bucket's entry is let go).
        logbook: The cache's logs and ignored options.

    ``buckets`` (None once the first call found a static batch dim) and ``lengths`` are the
    buckets in use; ``lengths_checked`` and ``length_plan`` say whether the first call has
    found which inputs carry the length, and which.
    """

    def __init__(
        self,
        config: FusionConfig,
        *,
        static: frozenset[int],
        mutated: tuple[int, ...],
        batch_ints: frozenset[int],
        symbols: dict[int, Any] | None,
        signatures: Signatures,
        unfused: Callable[..., Sequence[Any]],
        table: EntryTable,
        logbook: Logbook,
    ) -> None:
        self.buckets = config.batch_buckets
        self.buckets_checked = self.buckets is None
        self.lengths = config.length_buckets
        # length_buckets: which inputs carry the length (found at the first call), and each
        # bucket's check against the unpadded run: bucket -> outputs to slice, or the reason
        # it is not used.
        self.length_plan: LengthInputs | None = None
        self.lengths_checked = self.lengths is None
        self._length_state: dict[int, tuple[bool, ...] | str] = {}
        self._static = static
        self._mutated = mutated
        self.batch_ints = batch_ints
        self._symbols = symbols
        self._signatures = signatures
        self._unfused = unfused
        self._table = table
        self._logbook = logbook

    @property
    def bucketed(self) -> bool:
        """Whether keys are padded shapes (batch or length buckets in use)."""
        return self.buckets is not None or self.lengths is not None

    def clear(self) -> None:
        """Forget each length bucket's check (``GraphCache.clear``)."""
        self._length_state.clear()

    def check_buckets(self, args: tuple[Any, ...]) -> None:
        """Once, at the first call: batch_buckets needs a non-static tensor input with a
        leading (batch) dim; a graph without one (only parameters and scalars) pads nothing."""
        self.buckets_checked = True
        first = next(
            (
                i
                for i, a in enumerate(args)
                if i not in self._static and isinstance(a, Tensor) and a.dim() > 0
            ),
            None,
        )
        if first is None:
            self._logbook.ignore(
                f"batch_buckets={list(self.buckets or ())} has no effect: the graph has no "
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
                self._logbook.name,
                args[first].shape[0],
            )
            self.buckets = None

    def check_lengths(self, args: tuple[Any, ...]) -> None:
        """Once, at the first call: which inputs carry the length (``buckets.length_inputs``)."""
        self.lengths_checked = True
        given = f"length_buckets={list(self.lengths or ())}"
        if self._mutated:
            self._logbook.ignore(
                f"{given} has no effect: the graph writes its inputs in place (a cache or "
                "state padded along the length would not be the caller's)"
            )
            return
        plan = length_inputs(args, self._static, self._symbols)
        if isinstance(plan, LengthInputs):
            self.length_plan = plan
        elif "static" in plan:
            log.info("%s: %s: %s; it runs unpadded", self._logbook.name, given, plan)
        else:
            self._logbook.ignore(f"{given} has no effect: {plan}")

    def length_call(
        self,
        args: tuple[Any, ...],
        padded: tuple[Any, ...],
        length: int,
        bucket: int,
        call: Callable[..., Sequence[Any]],
        direct: Callable[[Callable[..., Sequence[Any]], Call], Sequence[Any]],
    ) -> Sequence[Any]:
        """A call padded to a length bucket (``call``: the cache's call with the graph's args
        and the caller's; ``direct``: its direct run of a callable). The bucket's first call
        also runs the unpadded graph and compares: a model whose padded positions are not
        masked out (no attention mask passed, a position-dependent output) leaves the bucket
        unpadded, with the reason in ``ignored_options``."""
        state = self._length_state.get(bucket)
        if isinstance(state, str):
            return call(args)
        if state is not None:
            return slice_length(call(padded, args), length, state)
        reference = direct(self._unfused, Call(args, args))
        why = None
        try:
            outputs = call(padded, args)
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
        with self._table.lock:
            self._table.remove(padded_key)
        self._logbook.ignore(
            f"length_buckets: bucket {bucket} is not used (length {length} and the others "
            f"padded to it run unpadded): {why}"
        )
        return reference

    def key_for(self, *args: Any) -> Key:
        """The cache key a call with ``args`` uses (after length- and batch-bucket padding)."""
        if self.length_plan is not None:
            padded = pad_length(args, self.length_plan, self.lengths or ())
            if padded is not None and not isinstance(self._length_state.get(padded[2]), str):
                args = padded[0]
        if self.buckets is not None:
            args = pad(args, self.buckets, self._static, self.batch_ints)[0]
        return self._signatures.key(args)
