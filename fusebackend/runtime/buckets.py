"""Buckets: pad the batch dim (``batch_buckets``) or the sequence dim (``length_buckets``) of
the inputs up to a bucket, slice the outputs back."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LengthInputs",
    "length_inputs",
    "next_bucket",
    "pad",
    "pad_length",
    "slice_length",
    "slice_outputs",
    "symbols_of",
]


def next_bucket(buckets: Sequence[int], size: int) -> int | None:
    """The bucket ``size`` is padded to, or None when it is one or above the largest."""
    pos = bisect.bisect_left(buckets, size)
    if pos == len(buckets) or buckets[pos] == size:
        return None
    return buckets[pos]


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


@dataclasses.dataclass(frozen=True)
class LengthInputs:
    """Which inputs carry the sequence length (``length_buckets``).

    ``ref`` is the input whose dim 1 is the length (``input_ids``: the first non-static
    integer tensor of rank 2); ``tensors`` are padded along dim 1 (``ref`` included);
    ``ints`` are integer inputs holding the length (a dynamic-shape symbol).
    """

    ref: int
    tensors: tuple[int, ...]
    ints: tuple[int, ...]


def length_inputs(
    args: Sequence[Any],
    static: frozenset[int],
    symbols: Mapping[int, Any] | None,
) -> LengthInputs | str:
    """The inputs to pad along the length, or why the graph cannot be padded.

    ``symbols``: input index -> the dynamic-shape symbol of each dim (None: a static dim)
    for tensors, of the value for integer inputs, as the backend traced them; None when
    unknown (a plain callable: every dim may vary, matched by size).
    """
    candidates = [
        i for i, a in enumerate(args) if i not in static and isinstance(a, Tensor) and a.dim() >= 2
    ]
    ref = next(
        (
            i
            for i in candidates
            if args[i].dim() == 2 and not args[i].dtype.is_floating_point
            and not args[i].dtype.is_complex and args[i].dtype != torch.bool
        ),
        None,
    )  # fmt: skip
    if ref is None:
        return "the graph has no integer tensor input of shape [batch, length] (input_ids)"
    if symbols is None or not isinstance(symbols.get(ref), tuple):  # untraced: match sizes
        length = args[ref].shape[1]
        tensors = tuple(i for i in candidates if args[i].shape[1] == length)
        return LengthInputs(ref, tensors, ())
    symbol = symbols.get(ref, (None, None))[1]
    if symbol is None:
        return (
            "the graph's length dim is static (Dynamo traced it for one length: a later "
            "length recompiles it with a dynamic one, where the buckets apply)"
        )
    tensors = tuple(
        i for i in candidates if isinstance(symbols.get(i), tuple) and symbols[i][1] == symbol
    )
    ints = tuple(
        i
        for i, a in enumerate(args)
        if i not in static and type(a) is int and symbols.get(i) == symbol
    )
    return LengthInputs(ref, tensors, ints)


def pad_length(
    args: tuple[Any, ...], plan: LengthInputs, buckets: Sequence[int]
) -> tuple[tuple[Any, ...], int, int] | None:
    """(args padded along dim 1 with zeros, length, bucket), or None when nothing is padded
    (the length is a bucket, above the largest, or the inputs disagree on it)."""
    length = args[plan.ref].shape[1]
    bucket = next_bucket(buckets, length)
    if bucket is None:
        return None
    padded = list(args)
    for i in plan.tensors:
        a = args[i]
        if not isinstance(a, Tensor) or a.dim() < 2 or a.shape[1] != length:
            return None
        p = a.new_zeros((a.shape[0], bucket, *a.shape[2:]))
        p[:, :length] = a
        padded[i] = p
    for i in plan.ints:
        if args[i] != length:
            return None
        padded[i] = bucket
    return tuple(padded), length, bucket


def slice_length(outputs: Sequence[Any], length: int, along: Sequence[bool]) -> Sequence[Any]:
    """Outputs ``j`` with ``along[j]`` cut back to ``length`` along dim 1 (views)."""
    sliced = [o[:, :length] if cut else o for o, cut in zip(outputs, along, strict=True)]
    return tuple(sliced) if isinstance(outputs, tuple) else sliced


def symbols_of(values: Sequence[Any]) -> dict[int, Any]:
    """Input index -> the dynamic-shape symbol of each dim of a tensor (None: static), or of
    an integer input; read once from the traced example values (nothing of them is kept).
    Buckets pad only dims that are dynamic in the traced graph."""

    def symbol(value: Any) -> str | None:
        if isinstance(value, torch.SymInt) and getattr(value.node.expr, "free_symbols", None):
            return str(value.node.expr)
        return None

    out: dict[int, Any] = {}
    for i, value in enumerate(values):
        if isinstance(value, Tensor):
            out[i] = tuple(symbol(size) for size in value.shape)
        elif isinstance(value, torch.SymInt):
            out[i] = symbol(value)
    return out
