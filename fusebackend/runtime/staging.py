"""Pinned host staging: CPU inputs copied to the device without a host sync."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MAX_STAGING_SLOTS", "PinnedRing"]

# Pinned staging buffers per host input. A slot is reused only once the copy that last read
# it has completed; the ring grows while every slot is busy and only past this size does the
# host wait, i.e. when it runs this many calls ahead of the device.
MAX_STAGING_SLOTS = 8


class PinnedRing:
    """Pinned staging buffers for one host input, each guarded by the event of its last copy.

    ``copy`` never syncs the host unless ``MAX_STAGING_SLOTS`` copies are still in flight.
    """

    __slots__ = ("_shape", "_dtype", "_slots", "_next")

    def __init__(self, like: Tensor) -> None:
        self._shape = like.shape
        self._dtype = like.dtype
        self._slots = [self._new_slot()]
        self._next = 0

    def _new_slot(self) -> tuple[Tensor, torch.cuda.Event]:
        return torch.empty(self._shape, dtype=self._dtype, pin_memory=True), torch.cuda.Event()

    def copy(self, dst: Tensor, src: Tensor) -> None:
        slots = self._slots
        i = self._next
        staging, done = slots[i]
        if not done.query():
            if len(slots) < MAX_STAGING_SLOTS:
                slots.insert(i, self._new_slot())
                staging, done = slots[i]
            else:
                done.synchronize()
        staging.copy_(src)
        dst.copy_(staging, non_blocking=True)
        # On dst's device: the copy is queued on that device's current stream, which is not
        # the current device's when the graph runs on another GPU; recorded on the current
        # device's stream, the event could pass while the copy still reads this slot.
        done.record(torch.cuda.current_stream(dst.device))
        self._next = (i + 1) % len(slots)
