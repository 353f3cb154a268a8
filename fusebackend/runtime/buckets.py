"""Batch buckets: pad the batch dim of the inputs up to a bucket, slice the outputs back."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from torch import Tensor

__all__ = ["pad", "slice_outputs"]


def pad(
    args: tuple[Any, ...],
    buckets: Sequence[int],
    static: frozenset[int],
    batch_ints: frozenset[int],
) -> tuple[tuple[Any, ...], int | None, int | None]:
    """Zero-pad the batch dim of non-static inputs to the next bucket.

    The batch is the leading dim of the first non-static tensor input with a dim. Returns
    (args, batch, bucket); batch and bucket are None when nothing was padded (no batch dim,
    the batch is a bucket, or it is above the largest). Integer inputs in ``batch_ints``
    equal to the batch (a dynamic-shape symbol) become the bucket.
    """
    batch = next(
        (
            a.shape[0]
            for i, a in enumerate(args)
            if i not in static and isinstance(a, Tensor) and a.dim() > 0
        ),
        None,
    )
    if batch is None:
        return args, None, None
    pos = bisect.bisect_left(buckets, batch)
    if pos == len(buckets) or buckets[pos] == batch:
        return args, None, None
    bucket = buckets[pos]
    padded = list(args)
    for i, a in enumerate(args):
        if i in static:
            continue
        if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == batch:
            p = a.new_zeros((bucket, *a.shape[1:]))
            p[:batch] = a
            padded[i] = p
        elif i in batch_ints and type(a) is int and a == batch:
            padded[i] = bucket
    return tuple(padded), batch, bucket


def slice_outputs(outputs: Sequence[Any], batch: int | None, bucket: int) -> Sequence[Any]:
    """Outputs with a leading dim of ``bucket`` cut back to ``batch`` rows (views)."""
    sliced = [
        o[:batch] if isinstance(o, Tensor) and o.dim() > 0 and o.shape[0] == bucket else o
        for o in outputs
    ]
    return tuple(sliced) if isinstance(outputs, tuple) else sliced
