"""Does capturing a signature pay? A timed trial for graphs with large outputs.

Per call as users call it (outputs kept), a replay is followed by a copy of every output
(the static output buffers are overwritten by the next replay). With large outputs that copy
can cost more than the replay saves: the embedding chain at B=16, T=2048, D=2048 fp16 on an
H200 replays in 0.109 ms, and with its 128 MB output copy costs 0.188 ms per call, against
0.114 ms for the same graph run uncaptured. So a captured signature whose outputs are large
times a few calls of each kind (alternating, one kind per call, so each call still runs the
graph once) and keeps the faster. Small outputs (every decode step) skip the trial and stay
captured at no cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["LARGE_OUTPUT_BYTES", "TRIAL_CALLS", "CaptureTrial", "output_bytes", "time_call"]

# Outputs below this (non-aliased tensor outputs, summed) are not worth a trial: at copy
# bandwidth (~3-4 TB/s on an H100/H200) 8 MiB costs ~2-3 us, below the launch overhead that a
# replay saves for any graph of more than a couple of kernels.
LARGE_OUTPUT_BYTES = 8 << 20

# Timed calls of each kind (replay + copy, direct) before deciding; the fastest of each is
# compared, so the first replay's one-off upload of the graph does not count against it.
TRIAL_CALLS = 3


def output_bytes(outputs: Sequence[Any], aliases: Sequence[int | None]) -> int:
    """Bytes a replay copies out: tensor outputs that are not inputs returned as such."""
    return sum(
        out.numel() * out.element_size()
        for out, alias in zip(outputs, aliases, strict=True)
        if isinstance(out, Tensor) and alias is None
    )


def time_call(fn: Callable[[], Any], device_index: int | None) -> tuple[Any, float]:
    """Run ``fn`` once; return (its result, seconds from its start until the device is done).

    Host clock around a synchronize on both sides: the host-side cost (launches, the
    per-call Python work of an uncaptured graph) counts as well as the device time. Used only
    during a trial; tests replace it to inject timings.
    """
    if device_index is not None:
        torch.cuda.synchronize(device_index)
    start = time.perf_counter()
    result = fn()
    if device_index is not None:
        torch.cuda.synchronize(device_index)
    return result, time.perf_counter() - start


class CaptureTrial:
    """Timings of one signature's first calls after capture, replayed and run directly."""

    __slots__ = ("replayed", "direct")

    def __init__(self) -> None:
        self.replayed: list[float] = []
        self.direct: list[float] = []

    def next_is_replay(self) -> bool:
        return len(self.replayed) <= len(self.direct)

    def add(self, replayed: bool, seconds: float) -> None:
        (self.replayed if replayed else self.direct).append(seconds)

    def verdict(self) -> tuple[bool, str] | None:
        """(keep captured, why) once every call was timed, else None."""
        if len(self.replayed) < TRIAL_CALLS or len(self.direct) < TRIAL_CALLS:
            return None
        replay, direct = min(self.replayed) * 1e3, min(self.direct) * 1e3
        if replay <= direct:
            return True, f"captured: replay + output copy {replay:.3f} ms <= direct {direct:.3f} ms"
        return False, f"uncaptured: replay + output copy {replay:.3f} ms > direct {direct:.3f} ms"
