"""Signature keys: which entry of a graph cache a call uses, and readable labels for them.

A key is a tuple built without string work, with a named head: ``fused`` (whether the fused
graph is selected), then ``inputs``: (shape, stride, dtype, device) of every non-static
tensor input and (type, value) of every other input; a CPU 0-d tensor a captured graph
bakes in is (dtype, value): its shape, strides and device are those of every such tensor.
Static inputs (parameters, buffers) are not in the key: their addresses are checked instead
(``static_ptrs_equal``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for

from fusebackend.runtime.counters import fusion_enabled

__all__ = [
    "Key",
    "Signatures",
    "label",
    "plan_class",
    "shapes",
    "static_ptrs_equal",
    "tensor_signature",
]


class Key(NamedTuple):
    """One signature of a graph cache (hashable, compared as a plain tuple)."""

    fused: bool  # the fused graph is selected (the fusion switch, for a cache with one)
    inputs: tuple[Any, ...]  # per input: (shape, stride, dtype, device) or (type, value)


# C++ check used by torch's own cudagraph trees on the hot path (CUDA builds only):
# all(tensors[i].data_ptr() == ptrs[i] for i in indices).
_data_ptrs_equal: Callable[[Sequence[Any], list[int | None], list[int]], bool] | None = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None
)


class Signatures:
    """Builds the keys of one graph cache.

    Args:
        static: Indices of static inputs (not in the key).
        has_fused: Whether the cache has a fused graph (the key's ``fused`` is then the
            global fusion switch, else always False).
        bakes_cpu_scalars: Whether the graph is captured: CPU 0-d tensors (a Python float
            under dynamic shapes becomes one) are then read on the host at capture and kept
            by value, so their values are part of the key.
        staged: Indices of host inputs: copied to the device before each replay, so a CPU
            0-d one (a position counter computed on the host) is not baked in and its value
            stays out of the key (keyed by value, every decode step was a new capture).
    """

    def __init__(
        self,
        static: frozenset[int],
        has_fused: bool,
        bakes_cpu_scalars: bool,
        staged: frozenset[int] = frozenset(),
    ) -> None:
        self._static = static
        self._staged = staged
        self._has_fused = has_fused
        self._bakes = bakes_cpu_scalars
        # (number of args, indices of the non-static ones, of the baked CPU scalars), swapped
        # as one object so that a concurrent call never pairs one arity with the other's
        # indices. Dynamo guards device and rank, so the sets are fixed per arity.
        self._layout: tuple[int, tuple[int, ...], frozenset[int]] = (-1, (), frozenset())

    def key(self, args: tuple[Any, ...]) -> Key:
        nargs, dynamic, scalars = self._layout
        if nargs != len(args):
            dynamic = tuple(i for i in range(len(args)) if i not in self._static)
            scalars = frozenset(
                i
                for i in dynamic
                if self._bakes
                and i not in self._staged
                and isinstance(args[i], Tensor)
                and args[i].dim() == 0
                and args[i].device.type == "cpu"
            )
            self._layout = (len(args), dynamic, scalars)
        if scalars:
            # Keyed by dtype and value alone: under dynamic shapes Dynamo passes every module
            # float (a norm's eps, a dropout's p) as a new 0-d tensor per call, 35 of them in
            # MiniLM-L6. With their shapes, strides and devices read as well, a key of 35 such
            # tensors and 3 others took 62-75 us on a loaded 2-core CPU against 33-53 us
            # without (three alternating rounds in one process, 2026-11-29).
            inputs = tuple(
                (args[i].dtype, args[i].item()) if i in scalars else _item(args[i]) for i in dynamic
            )
        else:
            items = args if len(dynamic) == len(args) else [args[i] for i in dynamic]
            inputs = tuple(map(_item, items))
        # tuple.__new__: Key(...) without the NamedTuple's Python-level __new__ (every call).
        return tuple.__new__(Key, (self._has_fused and fusion_enabled(), inputs))


def _item(a: Any) -> tuple[Any, ...]:
    """One input's part of a key: (shape, stride, dtype, device) or (type, value)."""
    return (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, Tensor) else (type(a), a)


def static_ptrs_equal(args: tuple[Any, ...], ptrs: list[int | None], idx: list[int]) -> bool:
    """Whether every static input ``args[i]`` (i in ``idx``) is still at ``ptrs[i]``."""
    if _data_ptrs_equal is not None:
        return _data_ptrs_equal(list(args), ptrs, idx)  # the binding takes lists, not tuples
    return all(args[i].data_ptr() == ptrs[i] for i in idx)


def label(prefix: str, own: torch.device | None, key: Key) -> str:
    """``"embed#0 fused (int64[4, 7], float16[7, 64]@cpu, 3)"``: strides shown when not
    contiguous, the device when not the graph's own (``own``; None: the CPU)."""
    own = own if own is not None else torch.device("cpu")
    parts = []
    for item in key.inputs:
        if len(item) == 4:
            shape, stride, dtype, device = item
            text = f"{str(dtype).removeprefix('torch.')}{list(shape)}"
            if tuple(stride) != make_contiguous_strides_for(shape):
                text += f"/strides{tuple(stride)}"
            if device.type != own.type or (own.index is not None and device != own):
                text += f"@{device}"
        else:
            text = repr(item[1])
        parts.append(text)
    return f"{prefix} {'fused' if key.fused else 'unfused'} ({', '.join(parts)})"


def shapes(key: Key) -> tuple[tuple[int, ...], ...]:
    """Shapes of the key's tensor inputs."""
    return tuple(tuple(item[0]) for item in key.inputs if len(item) == 4)


def plan_class(key: Key) -> Key:
    """The key without its sizes: what a signature shares with every other shape of one
    compiled graph (fusion switch, then dtype, device, rank and contiguity of each tensor
    input, the type of every other input: integers under dynamic shapes are sizes; CPU
    scalars baked in by value count by type). Validation runs once per class: a graph that
    matched the unfused graph at one shape runs its other shapes unchecked."""
    items: list[Any] = []
    for item in key.inputs:
        if len(item) == 4:
            shape, stride, dtype, device = item
            contiguous = tuple(stride) == make_contiguous_strides_for(shape)
            items.append((dtype, device, len(shape), contiguous))
        else:
            items.append(item[0])
    return Key(key.fused, tuple(items))


def tensor_signature(key: Key) -> Key:
    """Fusion switch, then (shape, dtype) of each tensor input: what two compilations of one
    function (Dynamo's recompiles) see alike for one call, whatever their other inputs."""
    return Key(key.fused, tuple((tuple(item[0]), item[2]) for item in key.inputs if len(item) == 4))
