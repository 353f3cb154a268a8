"""Compile generated kernels once and launch them: the public ``embedding_chain`` launcher.

Triton's JIT reads a kernel's source from its file, so each generated module is written
to a per-user cache directory (named by a hash of its source) and imported from there.
Kernels are cached in-process by (GroupSpec, rank, KernelOptions); Triton caches the binaries per
argument specialisation (dtypes, 16-byte alignment, strides equal to 1).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import torch

from fusebackend.kernels.codegen import generate_source
from fusebackend.kernels.spec import GroupSpec, InputRef, KernelOptions, ValueRef

__all__ = ["embedding_chain", "kernel_source", "triton_usable", "value_shapes"]

log = logging.getLogger(__name__)

_KERNELS: dict[tuple[GroupSpec, int, KernelOptions], Any] = {}
_LOCK = threading.Lock()

# Launch configs, from benchmarks/diag/diag_index_assert.py (H200, fp16 chain, index checks
# on; device time in a CUDA graph). Programs cover ~1024 elements: one row up to 2048 wide,
# several rows of a narrow table. 16x2048x2048: 0.109 ms with 2 warps vs 0.141 ms for the
# earlier 4096-element tiles with 4 warps (0.117 ms with 4 warps); 16 x 512 x 768 0.017 vs
# 0.019 ms. Small groups (decode steps) are latency-bound and gain from more threads per
# row: 1 x 1 x 2048 2.4 us with 4 warps vs 3.0 us with 2, 64 x 4 x 4096 (1M elements)
# 3.6 vs 3.9 us; 4 x 2048 x 4096 (33M) 55.9 us with 2 warps vs 58.0 us with 4.
_TILE_ELEMENTS = 1024
_MAX_BLOCK_D = 2048
_SMALL_GROUP_ELEMENTS = 1 << 21  # up to here 4 warps per program, above it 2


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install must not break the unfused path
        log.info("Triton is not importable (%s); fused groups use the torch reference", exc)
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable(device: torch.device) -> bool:
    """Can generated kernels run for tensors on ``device``?"""
    if not _triton_importable():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and not interpreter_enabled()
    return device.type == "cpu" and interpreter_enabled()


def kernel_source(
    spec: GroupSpec, rank: int, options: KernelOptions | None = None
) -> tuple[str, str]:
    """(kernel name, generated source): what ``embedding_chain`` compiles."""
    return generate_source(spec, rank, options or KernelOptions())


def _compiled_kernel(spec: GroupSpec, rank: int, options: KernelOptions) -> Any:
    key = (spec, rank, options)
    kernel = _KERNELS.get(key)
    if kernel is not None:
        return kernel
    with _LOCK:
        if key not in _KERNELS:
            name, source = generate_source(spec, rank, options)
            _KERNELS[key] = getattr(_import_source(name, source), name)
        return _KERNELS[key]


def _import_source(name: str, source: str) -> Any:
    directory = os.path.join(tempfile.gettempdir(), f"fusebackend-{os.getuid()}")
    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    path = os.path.join(directory, f"{name}_{digest}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as handle:
            handle.write(source)
        os.replace(tmp, path)  # atomic: concurrent processes never see half a file
    module_spec = importlib.util.spec_from_file_location(f"fusebackend_generated.{name}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def value_shapes(spec: GroupSpec, inputs: Sequence[torch.Tensor]) -> list[torch.Size]:
    """Shape of every value in the group, from the input shapes (eager broadcasting)."""
    shapes: list[torch.Size] = []
    for lookup in spec.lookups:
        index, table = inputs[lookup.index_slot], inputs[lookup.table_slot]
        shapes.append(torch.Size((*index.shape, table.shape[1])))
    for instr in spec.instrs:
        operand_shapes = []
        for operand in instr.operands:
            if isinstance(operand, ValueRef):
                operand_shapes.append(shapes[operand.index])
            elif isinstance(operand, InputRef):
                operand_shapes.append(inputs[operand.slot].shape)
        shapes.append(broadcast_shapes(*operand_shapes))
    return shapes


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """Eager's broadcasting of concrete shapes, for the per-call path.

    ``torch.broadcast_shapes`` goes through the symbolic-shape reference implementation:
    24.5 us a call for three shapes on a CPU against 1.7 us for this loop, and the launcher
    broadcasts 6 times per call of a two-lookup chain (an uncaptured call of that chain
    with a no-op kernel went from 164 to 87 us).
    """
    rank = max((len(shape) for shape in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        for dim, size in enumerate(shape, rank - len(shape)):
            if size != 1:
                if out[dim] != 1 and out[dim] != size:
                    raise RuntimeError(
                        f"shapes {[tuple(s) for s in shapes]} cannot be broadcast together"
                    )
                out[dim] = size
    return torch.Size(out)


def check_indices(spec: GroupSpec, inputs: Sequence[torch.Tensor]) -> None:
    """Raise IndexError for an out-of-range index, as eager's CPU embedding does.

    Only for CPU tensors: on the GPU this would be a host sync, and the kernel's
    device-side assert does the job there.
    """
    for lookup in spec.lookups:
        index, table = inputs[lookup.index_slot], inputs[lookup.table_slot]
        if index.device.type != "cpu" or index.numel() == 0:
            continue
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= table.shape[0]:
            bad = low if low < 0 else high
            raise IndexError(
                f"index out of range in self: embedding index {bad} is outside "
                f"[0, {table.shape[0]}) for a table of shape {tuple(table.shape)}"
            )


def _broadcast_strides(t: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    return t.expand(shape).stride()


def embedding_chain(
    spec: GroupSpec,
    inputs: Sequence[torch.Tensor],
    *,
    index_checks: bool = True,
    options: KernelOptions | None = None,
) -> tuple[torch.Tensor, ...]:
    """Run a fused group: gather the lookups, apply the chain, return the outputs.

    ``inputs`` are the group's external tensors in slot order (indices, tables and
    elementwise operands). Outputs are new contiguous tensors, one per ``spec.outputs``.
    ``options`` (default: ``KernelOptions(index_checks=index_checks)``) says how the kernel
    is built.
    """
    if options is None:
        options = KernelOptions(index_checks=index_checks)
    shapes = value_shapes(spec, inputs)
    group_shape = broadcast_shapes(*shapes)
    rank = len(group_shape) - 1
    lead, width = group_shape[:-1], group_shape[-1]
    rows = lead.numel()
    device = inputs[spec.lookups[0].table_slot].device
    outputs = tuple(
        torch.empty(shapes[v], dtype=spec.value_dtype(v), device=device) for v in spec.outputs
    )
    if rows == 0 or width == 0:
        return outputs
    check_indices(spec, inputs)

    args: list[Any] = []
    table_width = {lk.table_slot: shapes[j][-1] for j, lk in enumerate(spec.lookups)}
    for slot, tensor in enumerate(inputs):
        if slot in spec.index_slots:
            args += [tensor, *_broadcast_strides(tensor, lead)]
        elif slot in spec.table_slots:
            col_stride = 0 if table_width[slot] == 1 else tensor.stride(1)
            args += [tensor, tensor.shape[0], tensor.stride(0), col_stride]
        else:
            args += [tensor, *_broadcast_strides(tensor, group_shape)]
    for out in outputs:
        args += [out, *_broadcast_strides(out, group_shape)]
    args += [*lead, rows, width]

    block_r, block_d, num_warps = launch_config(rows, width)
    grid = ((rows + block_r - 1) // block_r, (width + block_d - 1) // block_d)
    kernel = _compiled_kernel(spec, rank, options)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        # Debug mode (for the index assert) would also add overflow checks to every 32-bit
        # integer op; the index math that matters is 64-bit, so those are turned off.
        kernel[grid](*args, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps,
                     sanitize_overflow=False)  # fmt: skip
    return outputs


def launch_config(rows: int, width: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a group of ``rows`` x ``width`` elements."""
    block_d = min(triton_next_power_of_2(width), _MAX_BLOCK_D)
    block_r = min(triton_next_power_of_2(rows), max(1, _TILE_ELEMENTS // block_d))
    num_warps = 4 if rows * width <= _SMALL_GROUP_ELEMENTS else 2
    return block_r, block_d, num_warps


def triton_next_power_of_2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()
