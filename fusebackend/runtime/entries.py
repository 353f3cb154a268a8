"""What a graph cache keeps per signature: the live ``Entry``, the remembered ``Verdict``, and
the ``Call`` a lookup hands to the code that runs it; ``StatsRow`` is an entry as ``stats()``
shows it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torch import Tensor

from fusebackend.runtime import payoff
from fusebackend.runtime.buckets import slice_outputs
from fusebackend.runtime.modes import Mode
from fusebackend.runtime.staging import PinnedRing

__all__ = ["Call", "Entry", "StatsRow", "Verdict"]


class Verdict(NamedTuple):
    """A key's remembered outcome: its mode and reason, whether it may be captured, and how
    many calls it has had (a key that returns after an eviction recurs: captured at once)."""

    mode: Mode
    reason: str | None
    capture: bool
    calls: int


@dataclasses.dataclass(slots=True)
class Call:
    """One call as the cache runs it: ``args`` as the graph takes them (batch-padded),
    ``user_args`` the caller's (where in-place effects and aliased outputs go), and the
    batch padding (``batch`` rows of ``bucket``; None: unpadded) to slice off the outputs."""

    args: tuple[Any, ...]
    user_args: tuple[Any, ...]
    batch: int | None = None
    bucket: int | None = None
    # Per-signature inputs (GraphCache's ``per_signature``) appended to ``args`` and
    # ``user_args``: the entry's own tensors, or computed for this call's new entry.
    derived: tuple[Any, ...] = ()

    def with_derived(self, derived: tuple[Any, ...]) -> Call:
        """This call with the per-signature inputs ``derived`` after its own."""
        return Call(self.args + derived, self.user_args + derived, self.batch, self.bucket,
                    derived)  # fmt: skip

    def unpad(self, outputs: Sequence[Any]) -> Sequence[Any]:
        """``outputs`` without the batch padding."""
        return outputs if self.bucket is None else slice_outputs(outputs, self.batch, self.bucket)


class StatsRow(NamedTuple):
    label: str
    shapes: tuple[tuple[int, ...], ...]
    mode: str
    reason: str | None


@dataclasses.dataclass(eq=False, slots=True)
class Entry:
    mode: Mode
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
    pending: bool = False  # uncaptured until it recurs (recurrence.CaptureCall.recurring)
    nbytes: int = 0  # device memory it holds alone (static input and output buffers)
    last_use: int = 0  # the process-wide use clock at its last call
    # Per-signature inputs (GraphCache's ``per_signature``), computed once for this entry:
    # a captured graph reads them in place.
    derived: tuple[Any, ...] = ()

    def resources(self) -> list[Any]:
        """What a queued replay may still read: held by ``capture.retire`` once dropped."""
        return [self.graph, self.copy_bufs, self.host_copies, self.outputs, self.derived]
