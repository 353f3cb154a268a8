"""Copying a replay's outputs out of the captured graph's buffers.

A captured graph writes its outputs into the same memory at every replay, and the graphs of a
device share one memory pool, so a later call of any of them may overwrite what an earlier call
returned. Each replay's outputs are therefore copied before they are returned (unless the
option ``static_outputs`` says the caller is done with them before the next call).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["copy_out"]


def copy_out(result: list[Any], positions: list[int]) -> None:
    """Replace ``result[i]`` for each of ``positions``, a captured graph's output buffer, by a
    copy of it that the next replay cannot overwrite, with ``clone``'s strides (``empty_like``
    applies the same rule: a non-overlapping dense output's strides, else its suggested
    memory format). Several outputs are allocated one by one and copied by one
    ``_foreach_copy_``: on an H200 (2026-12-01) a clone of a small fp16 output took 11.06 us
    of host time and two 21.04, against 12.92 for two allocations and one copy
    (``probe_output_copies_h200_dabefa5.txt``, two dense outputs of one dtype). That is one
    kernel where every output is dense and the dtypes agree; otherwise ``_foreach_copy_``
    copies them one by one, as the clones did, its loop in C++."""
    if len(positions) == 1:
        (i,) = positions
        result[i] = result[i].clone()
        return
    sources = [result[i] for i in positions]
    copies = [torch.empty_like(t) for t in sources]
    torch._foreach_copy_(copies, sources)
    for i, t in zip(positions, copies, strict=True):
        result[i] = t
