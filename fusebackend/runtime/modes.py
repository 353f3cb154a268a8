"""How a signature runs (``Mode``), why it leaves that way (``Cause``), and the one rule for
where it goes (``demote``): the fallback chain, written once.

    fusion        the fused graph; captured in a CUDA graph when capture is on
      | the fused graph raises / mismatches / cannot be captured
    graph_replay  the unfused graph, captured
      | capture fails, must not or does not pay to capture
    eager         the unfused graph, run directly

A mode says which callable runs (``fused``) and whether capture is possible at all
(``capturable``); whether an entry is captured is the entry's own state (``Entry.graph``): a
fused entry may run uncaptured and stay in ``fusion``. A pure module: the graph cache counts
and logs each demotion (``logbook.Logbook.demote``).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["Cause", "Demotion", "Mode", "demote", "first_mode"]


class Mode(str, enum.Enum):
    """A signature's mode; a ``str`` whose value is the name users see in ``stats()``,
    ``describe()`` and the reasons (``str()`` and formatting give the value)."""

    FUSION = "fusion"
    GRAPH_REPLAY = "graph_replay"
    EAGER = "eager"

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def fused(self) -> bool:
        """Whether the fused callable runs (else the unfused one)."""
        return self is Mode.FUSION

    @property
    def capturable(self) -> bool:
        """Whether an entry in this mode may be captured (``eager`` never is)."""
        return self is not Mode.EAGER


class Cause(enum.Enum):
    """Why a signature leaves its mode or its capture: picks the next mode and the wording."""

    FUSED_FAILED = "fused_failed"  # the fused graph raised or mismatched: the unfused graph
    CAPTURE_FAILED = "capture_failed"  # capture (warm-up included) raised: one step down
    NOT_CAPTURABLE = "not_capturable"  # a CUDA graph would run it wrong: run directly
    OVER_BUDGET = "over_budget"  # its buffers exceed graph_memory: run directly
    NO_PAYOFF = "no_payoff"  # replay + output copy is slower than a direct run: run directly

    @property
    def logged(self) -> bool:
        """Whether the demotion itself is logged (the capture trial logs its decision)."""
        return self is not Cause.NO_PAYOFF


class Demotion(NamedTuple):
    mode: Mode
    reason: str  # the entry's reason: the earlier steps, then this one
    why: str  # this step's text after "old -> new: " (when the mode changes)
    step: str  # this step as the reason shows it


def first_mode(fused: bool, captures: bool) -> Mode:
    """Where a new signature starts: ``fusion`` when the fused graph is selected, else the
    first unfused mode (``graph_replay`` when the graph is captured)."""
    if fused:
        return Mode.FUSION
    return Mode.GRAPH_REPLAY if captures else Mode.EAGER


def demote(
    mode: Mode, cause: Cause, why: str, previous: str | None, *, captures: bool = True
) -> Demotion:
    """The mode a signature in ``mode`` takes for ``cause``, and its reason (``previous``, then
    this step).

    ``captures`` (``FUSED_FAILED`` only): whether the unfused graph may be captured (the
    cache captures and no capture trial left the signature uncaptured).

    ``fusion`` leaves for the unfused graph when the fused graph fails, and for
    ``graph_replay`` when its capture fails; a fused graph that must not, or does not pay to,
    be captured stays in ``fusion``, run directly (its kernels need no capture), and says so
    in its reason. An unfused mode goes to ``eager``.
    """
    if cause is Cause.FUSED_FAILED:
        new = first_mode(False, captures)
    elif cause is Cause.CAPTURE_FAILED:
        new = Mode.GRAPH_REPLAY if mode is Mode.FUSION else Mode.EAGER
    else:
        new = Mode.FUSION if mode is Mode.FUSION else Mode.EAGER
    if cause is Cause.OVER_BUDGET:
        why = f"not captured: {why}"
    if new is not mode:
        step = f"{mode} -> {new}: {why}"
    elif cause is Cause.NOT_CAPTURABLE:
        step = f"not captured: {why}"
    else:
        step = why
    return Demotion(new, step if previous is None else f"{previous}; {step}", why, step)
