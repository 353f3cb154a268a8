"""Does capturing a signature pay? A timed trial for graphs with large outputs.

Per call as users call it (outputs kept), a replay is followed by a copy of every output
(the static output buffers are overwritten by the next replay). With large outputs that copy
can cost more than the replay saves: the embedding chain at B=16, T=2048, D=2048 fp16 on an
H200 replays in 0.109 ms, and with its 128 MB output copy costs 0.188 ms per call, against
0.114 ms for the same graph run uncaptured. So a captured signature whose outputs are large
times a few calls of each kind (alternating, one kind per call, so each call still runs the
graph once) and keeps the faster, as a loop of calls would see it (``CaptureTrial``).
Small outputs (every decode step) skip the trial and stay captured at no cost.
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


def time_call(
    fn: Callable[..., Any], device_index: int | None, marked: bool = False
) -> tuple[Any, float, float, float]:
    """Run ``fn`` once, the device idle before; return (its result, host seconds to issue
    it, device seconds before the mark, device seconds after it).

    ``marked``: ``fn`` takes ``after_replay``, a callable it calls once its graph replay is
    enqueued (the output copies come after); otherwise the whole call counts as "before".
    Device times come from CUDA events; on the CPU (``device_index`` None) the host clock
    stands for both. Used only during a trial; tests replace it to inject timings.
    """
    if device_index is None:
        start = time.perf_counter()
        result = fn(after_replay=lambda: None) if marked else fn()
        seconds = time.perf_counter() - start
        return result, seconds, seconds, 0.0
    torch.cuda.synchronize(device_index)
    begin, mark, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    begin.record()
    start = time.perf_counter()
    result = fn(after_replay=mark.record) if marked else fn()
    host = time.perf_counter() - start
    end.record()
    if not marked:
        mark.record()
    torch.cuda.synchronize(device_index)
    return result, host, begin.elapsed_time(mark) / 1e3, mark.elapsed_time(end) / 1e3


class CaptureTrial:
    """Timings of one signature's first calls after capture, replayed and run directly.

    Calls come back to back in a loop, so the host issues the next call while the device
    runs the last: a call costs about the larger of its host time and its device time. A
    replay's host time is small; its device time is the graph plus the output copies. A
    direct run issues the same kernels as the graph, one by one: it costs the larger of its
    host time and the graph's device time (measured on the replays: a direct run's own
    device time also counts the device waiting for the host between its launches). On an
    H100 (2026-11-23) the chain (B=16, T=2048) ran its kernel in 0.124 ms, a replay with its
    128 MB copy took 0.233 ms per call, and timing a direct run as host + device (a
    synchronize on both sides) made it look as slow as that, where back to back it takes
    about the kernel's time.
    """

    __slots__ = ("replayed", "graph", "direct")

    def __init__(self) -> None:
        self.replayed: list[float] = []  # per call: max(host, graph + copies)
        self.graph: list[float] = []  # device seconds of the graph alone
        self.direct: list[float] = []  # host seconds of a direct run

    def next_is_replay(self) -> bool:
        return len(self.replayed) <= len(self.direct)

    def add_replay(self, host: float, graph: float, copies: float) -> None:
        self.replayed.append(max(host, graph + copies))
        self.graph.append(graph)

    def add_direct(self, host: float) -> None:
        self.direct.append(host)

    def verdict(self) -> tuple[bool, str] | None:
        """(keep captured, why) once every call was timed, else None. The fastest call of
        each kind counts, so the first replay's one-off upload of the graph does not."""
        if len(self.replayed) < TRIAL_CALLS or len(self.direct) < TRIAL_CALLS:
            return None
        replay = min(self.replayed) * 1e3
        host, kernels = min(self.direct) * 1e3, min(self.graph) * 1e3
        direct = max(host, kernels)
        keep = replay <= direct
        compared = "<=" if keep else ">"
        why = (
            f"{'captured' if keep else 'uncaptured'}: replay + output copy {replay:.3f} ms "
            f"{compared} direct {direct:.3f} ms (host {host:.3f} ms, kernels {kernels:.3f} ms)"
        )
        return keep, why
