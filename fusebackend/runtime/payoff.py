"""Does capturing a signature pay? A timed trial for graphs with large outputs.

Per call as users call it (outputs kept), a replay is followed by a copy of every output
(the static output buffers are overwritten by the next replay). With large outputs that copy
can cost more than the replay saves: the embedding chain at B=16, T=2048, D=2048 fp16 on an
H200 replays in 0.109 ms, and with its 128 MB output copy costs 0.188 ms per call, against
0.114 ms for the same graph run uncaptured. So a captured signature whose outputs are large
times a few calls of each kind (alternating, one kind per call, so each call still runs the
graph once) and keeps the cheaper per call, counting each kind's host and device time as
back-to-back calls overlap them (``CaptureTrial``). Small outputs (every decode step) skip
the trial and stay captured at no cost.
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
# compared, so one-off costs do not count: the first replay uploads the graph (14 ms host),
# and the first two direct calls of the B=16, T=2048 chain on an H100 took 0.19-0.26 ms of
# host time against 0.10-0.13 ms for the third (diag_capture_trial.py, 2026-11-25). With 3
# calls one steady direct sample decided, and once a disturbed one kept that chain captured
# at 0.252 ms per call (the full suite's chain-prefill row) where direct costs 0.13 ms; 5
# calls leave three steady samples, for ~5 ms more of trial once per signature.
TRIAL_CALLS = 5


def output_bytes(outputs: Sequence[Any], aliases: Sequence[int | None]) -> int:
    """Bytes a replay copies out: tensor outputs that are not inputs returned as such."""
    return sum(
        out.numel() * out.element_size()
        for out, alias in zip(outputs, aliases, strict=True)
        if isinstance(out, Tensor) and alias is None
    )


def time_call(
    fn: Callable[[], Any], device_index: int | None, prime_s: float = 0.0
) -> tuple[Any, float, float]:
    """Run ``fn`` once; return (its result, host seconds, device seconds).

    Host seconds: until ``fn`` returns, after a synchronize. Device seconds: between CUDA
    events around ``fn`` on the current stream, behind a ``prime_s`` sleep kernel that keeps
    the device busy while the host launches, so that (when the prime outlasts the host's
    launches) the figure is the device's own work and not the host's gaps between launches.
    Called back to back, a caller's steady state costs the larger of the two per call.
    Used only during a trial; tests replace it to inject timings.
    """
    if device_index is None:
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start, 0.0
    with torch.cuda.device(device_index):
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        if prime_s > 0:
            torch.cuda._sleep(int(prime_s * _sleep_cycles_per_second(device_index)))
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        start = time.perf_counter()
        result = fn()
        host = time.perf_counter() - start
        end.record(stream)
        end.synchronize()
        return result, host, begin.elapsed_time(end) / 1e3


_SLEEP_RATE: dict[int, float] = {}


def _sleep_cycles_per_second(device_index: int) -> float:
    """``torch.cuda._sleep`` counts clock cycles: measured once per device, over ~5 ms
    after a warm-up sleep that loads the kernel and lets the clocks rise from idle (an H100
    idles at 345 MHz and boosts to 1980 MHz). A later slower clock only shortens primes,
    which lets host gaps back into the device figure: the serial timing's error, no worse."""
    rate = _SLEEP_RATE.get(device_index)
    if rate is None:
        cycles = 10_000_000  # ~5 ms at 2 GHz
        with torch.cuda.device(device_index):
            torch.cuda._sleep(cycles)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rate = _SLEEP_RATE[device_index] = cycles / (begin.elapsed_time(end) / 1e3)
    return rate


# The prime of a timed call: a little over the shortest host time of the kind's earlier
# calls (the first replay's includes the graph's upload; a call that waits on the stream
# has the prime in its host time), capped (a call whose host part is longer is host-bound:
# its device figure then carries at most the host's excess over the cap, while its host
# figure decides).
PRIME_FACTOR = 1.5
MAX_PRIME_S = 0.02


class CaptureTrial:
    """Timings of one signature's first calls after capture, replayed and run directly.

    Each kind's cost per call is the larger of its fastest host time and its fastest
    device time: what back-to-back calls cost, the host launching ahead of the device.
    Timed serially (host, then device) the chain of benchmarks/embedding_chain.py at
    B=16, T=2048, D=2048 on an H100 looked slower run directly (0.27-0.32 ms, of which
    ~0.1 ms host before the kernel's launch) than replayed with its 128 MB output copy
    (0.29-0.31 ms), a coin toss; called back to back the direct run costs 0.131 ms and the
    replay 0.227 ms.
    """

    __slots__ = ("host", "device")

    def __init__(self) -> None:
        # per kind (replayed: True, direct: False): the timed calls' seconds
        self.host: dict[bool, list[float]] = {True: [], False: []}
        self.device: dict[bool, list[float]] = {True: [], False: []}

    def next_is_replay(self) -> bool:
        return len(self.host[True]) <= len(self.host[False])

    def prime_for(self, replayed: bool) -> float:
        """The sleep to put ahead of the next call of this kind (none for its first)."""
        seen = self.host[replayed]
        return min(MAX_PRIME_S, PRIME_FACTOR * min(seen)) if seen else 0.0

    def add(self, replayed: bool, host_s: float, device_s: float) -> None:
        self.host[replayed].append(host_s)
        self.device[replayed].append(device_s)

    def cost(self, replayed: bool) -> float:
        return max(min(self.host[replayed]), min(self.device[replayed]))

    def verdict(self) -> tuple[bool, str] | None:
        """(keep captured, why) once every call was timed, else None."""
        if min(len(self.host[True]), len(self.host[False])) < TRIAL_CALLS:
            return None
        replay, direct = self.cost(True) * 1e3, self.cost(False) * 1e3
        if replay <= direct:
            return True, f"captured: replay + output copy {replay:.3f} ms <= direct {direct:.3f} ms"
        return False, f"uncaptured: replay + output copy {replay:.3f} ms > direct {direct:.3f} ms"
