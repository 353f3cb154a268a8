"""GenerateReport: what one generate() call through infinifuse's loop did.

``last_report()`` returns the newest one. A fallback to transformers' own loop is a report
too (``path="transformers"`` and its ``reason``), so no fallback is silent; it is also logged
once per reason.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

log = logging.getLogger(__name__)

__all__ = ["GenerateReport", "last_report", "record"]


@dataclasses.dataclass
class GenerateReport:
    """One generate() call.

    Attributes:
        path: ``"device loop"`` or ``"transformers"`` (the fallback).
        reason: Why the call fell back to transformers' loop (None on the device loop).
        k: Decode steps per chunk (per CUDA-graph replay where captured).
        captured: Whether the k-step chunks ran as CUDA-graph replays.
        new_tokens: Tokens generated per row (the output's length minus the prompt's).
        chunks: Chunks run after the first token (replays plus uncaptured chunks); the host
            read one flag per chunk.
        replays: Chunks that were CUDA-graph replays.
        steps: Decode steps run, including those after a stop that were discarded.
        captures: CUDA graphs captured during this call (0 when an earlier call's graph was
            reused).
        time_to_first_token_s: From the call to the first token on the host's clock, the
            prefill included (the device synchronized there).
        total_s: The whole call.
        batch: Rows.
    """

    path: str
    reason: str | None = None
    k: int = 0
    captured: bool = False
    new_tokens: int = 0
    chunks: int = 0
    replays: int = 0
    steps: int = 0
    captures: int = 0
    time_to_first_token_s: float | None = None
    total_s: float | None = None
    batch: int = 0

    def __str__(self) -> str:
        if self.path != "device loop":
            return f"generate: transformers' loop ({self.reason})"
        ttft = f"{self.time_to_first_token_s * 1e3:.1f} ms" if self.time_to_first_token_s else "-"
        how = f"{self.replays} CUDA-graph replays" if self.captured else "uncaptured"
        return (
            f"generate: device loop, k={self.k}, {self.new_tokens} new tokens x {self.batch} "
            f"rows in {self.chunks} chunks ({how}), {self.steps} steps, first token {ttft}"
        )


_lock = threading.Lock()
_last: GenerateReport | None = None
_logged: set[str] = set()


def record(report: GenerateReport) -> GenerateReport:
    """Keep ``report`` as the newest; a fallback is logged (WARNING once per reason)."""
    global _last
    with _lock:
        _last = report
        first = report.reason is not None and report.reason not in _logged
        if first:
            _logged.add(report.reason)
    if report.reason is not None:
        level = logging.WARNING if first else logging.INFO
        log.log(level, "generate falls back to transformers' loop: %s", report.reason)
    return report


def last_report() -> GenerateReport | None:
    """The newest generate() call's report (None before any)."""
    return _last
