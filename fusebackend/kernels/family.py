"""The kernel-family protocol: what the backend asks of every kernel a fused graph calls.

A fused graph calls a kernel family's launcher as a node's target: a row group's
``FusedGroupOp`` or ``FusedPairOp`` (row_ops.py), ``write_cache_pair``, ``decode_attention``,
``vocab_parallel_lookup``, ``spatial_mean``. Each also answers two questions, so the backend
never switches on which one it holds:

- ``describe()``: the name of the kernel it launches, for ``explain`` (a row group's
  generated kernel, ``write_cache_pair``, ...);
- ``precompile_job(args)``: given the node's arguments with every graph value replaced by
  its example value (a fake tensor, a symbolic or plain number), ``(key, job)``: ``job()``
  compiles the kernels a launch on such values runs without running them
  (``launch.precompile_all`` runs the jobs concurrently), and launches of equal ``key``
  share one job; or None where nothing is compiled ahead (a CPU tensor, a symbolic shape
  the family does not compile at its hint).

A family may also answer ``launch_path(args)`` (same arguments): how a launch on them runs,
where a family has several ways (a matmul group: one row as GEMV or tensor cores, split-K),
for ``explain``; ``launch_path`` below asks it of any family and gets None where it has none.
A family may answer ``compile_weight(args)`` too: how long its kernel takes to compile,
relative to a row kernel's 1.0 (``compile_weight`` below: 1.0 where it has no answer). The
precompile hands the heaviest compiles out first (``fusion.precompile``).

A function launcher takes its answers as attributes (``family(...)``), as it takes
``writes_arguments``: a class with ``__call__`` would add a bound call to every launch.
``hinted_examples`` gives a node's example values as a precompile takes them (symbolic sizes
at their hints). Importing this module imports neither Triton nor FX.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "KernelFamily",
    "TensorExample",
    "compile_weight",
    "concrete_cuda_tensor",
    "family",
    "family_of",
    "hinted_examples",
    "launch_key",
    "launch_path",
]

log = logging.getLogger(__name__)

PrecompileJob = tuple[Hashable, Callable[[], None]]


@runtime_checkable
class KernelFamily(Protocol):
    """A launcher a fused graph calls, with what the backend asks of it."""

    def __call__(self, *args: Any) -> Any: ...

    def describe(self) -> str: ...

    def precompile_job(self, args: Sequence[Any]) -> PrecompileJob | None: ...


def family(
    describe: str,
    precompile_job: Callable[[Sequence[Any]], PrecompileJob | None],
    weight: Callable[[Sequence[Any]], float] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the function launcher ``fn`` as a ``KernelFamily`` (named ``describe``;
    ``weight``: its optional ``compile_weight``, see the module docstring)."""

    def attach(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.describe = lambda: describe  # type: ignore[attr-defined]
        fn.precompile_job = precompile_job  # type: ignore[attr-defined]
        if weight is not None:
            fn.compile_weight = weight  # type: ignore[attr-defined]
        return fn

    return attach


def family_of(target: Any) -> KernelFamily | None:
    """``target`` when it is a kernel family's launcher (a node's target), else None."""
    return target if callable(getattr(target, "precompile_job", None)) else None


def launch_path(family: KernelFamily, args: Sequence[Any]) -> str | None:
    """How a launch of ``family`` on ``args`` (example values) runs, where the family says
    (its optional ``launch_path``), else None."""
    answer = getattr(family, "launch_path", None)
    return answer(args) if callable(answer) else None


def compile_weight(family: KernelFamily, args: Sequence[Any]) -> float:
    """How long a compile of ``family``'s kernel for ``args`` takes against a row kernel's
    (its optional ``compile_weight``), else 1.0. Only an order rests on it: an answer that
    raises, or that is no plain number (read off symbolic sizes, ``float()`` of it would add
    a guard), counts as 1.0."""
    answer = getattr(family, "compile_weight", None)
    if not callable(answer):
        return 1.0
    try:
        weight = answer(args)
    except Exception as exc:  # noqa: BLE001  (an ordering hint never fails a compile)
        log.debug("compile_weight of %s raised %r: weighed 1.0", family.describe(), exc)
        return 1.0
    return float(weight) if isinstance(weight, (int, float)) else 1.0


def launch_key(value: Any) -> Any:
    """What a launch's warm-up depends on of one argument: a tensor's dtype, device, sizes,
    strides and 16-byte alignment (its byte offset: fresh bases count as aligned), or the
    value itself."""
    if not isinstance(value, torch.Tensor):
        return value
    offset = value.storage_offset() * value.element_size()
    return (value.dtype, value.device, tuple(value.shape), value.stride(), offset % 16 == 0)


def concrete_cuda_tensor(value: Any) -> bool:
    """A CUDA tensor of plain-int sizes and strides: one a warm-up can compile for."""
    return (
        isinstance(value, torch.Tensor)
        and all(isinstance(n, int) for n in value.shape)
        and value.device.type == "cuda"
        and all(isinstance(n, int) for n in value.stride())
    )


@dataclasses.dataclass(frozen=True)
class TensorExample:
    """What a precompile reads of a tensor (``precompile``, ``launch_rank``): sizes,
    strides, byte offset, dtype and device, with plain ints where a graph's example value
    had symbolic ones (``hinted_examples``). Hashable: it keys a precompile job as is."""

    shape: torch.Size
    strides: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def storage_offset(self) -> int:
        return self.offset

    def element_size(self) -> int:
        return self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)


def _hint(n: Any) -> int | None:
    """A size as an int: a SymInt's hint (the size Dynamo traced with), or None."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def hinted_examples(values: Sequence[Any], device_type: str | None = "cuda") -> list[Any] | None:
    """A fused node's example values (fake tensors, numbers) as ``precompile`` takes them,
    symbolic sizes, strides and offsets replaced by their hints: the sizes of the call that
    Dynamo traced, so the kernel compiled is the one that call launches; later lengths of
    the same launch config share its binary (row counts and sizes are runtime arguments,
    ``codegen.Writer._unspecialized``). Numbers (a norm's eps) become a float: a float
    argument compiles the same whatever its value. None where a size has no hint or a
    tensor is not on a device of ``device_type`` (None: any)."""
    examples: list[Any] = []
    for value in values:
        if isinstance(value, (int, float, torch.SymInt, torch.SymFloat)):  # a number
            examples.append(1.0)
            continue
        if not isinstance(value, torch.Tensor):
            return None
        if device_type is not None and value.device.type != device_type:
            return None
        sizes = [_hint(n) for n in (*value.shape, *value.stride(), value.storage_offset())]
        if any(n is None for n in sizes):
            return None
        rank = value.dim()
        shape, strides, offset = sizes[:rank], sizes[rank:-1], sizes[-1]
        examples.append(TensorExample(torch.Size(shape), tuple(strides), offset, value.dtype,
                                      value.device))  # fmt: skip
    return examples
