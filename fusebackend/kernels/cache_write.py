"""One launch for a layer's two KV-cache writes: ``k_cache.index_copy_(2, index, k)`` and
``v_cache.index_copy_(2, index, v)``.

transformers' StaticCache writes each layer's new keys and values with two ``index_copy_``
calls: 44 launches of a 22-layer Llama decode step, about 85 us of its 1.8 ms of kernels on
an H100 (profile of 2026-11-23; each copies a few hundred bytes). This kernel writes both
in one launch: one program per (batch, head, new row) copies that row of K and of V into
slot ``index[row]`` of the caches.

A graph calls ``write_cache_pair`` itself: it declares the arguments it writes
(``writes_arguments``, read by passes/mutations.py), where a torch custom operator's schema
would say the same at ~26 us of dispatch per call (measured on a CPU against 4 us for the
two ``index_copy_``), paid in every layer of a step that runs uncaptured. Where Triton
cannot run (a CPU without the interpreter) it runs the two ``index_copy_`` calls instead.

An index outside ``[0, slots)`` never writes: with ``checks`` the kernel is built with
Triton's debug mode and its device-side assert stops the program, as eager CUDA's
``index_copy_`` does; a CPU index is checked on the host first, with eager's IndexError.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fusebackend.kernels.family import concrete_cuda_tensor, family, launch_key
from fusebackend.kernels.launch import triton_usable
from fusebackend.kernels.triton_api import warmup_launch

__all__ = ["check_cache_index", "precompile_pair", "write_cache_pair"]


def write_cache_pair(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    checks: bool,
) -> None:
    """``k_cache.index_copy_(2, index, k); v_cache.index_copy_(2, index, v)`` in one launch.

    Caches ``[B, H, S, D]``, new rows ``[B, H, T, D]`` of the caches' dtypes, ``index``
    an int64 tensor of ``T`` slots.
    """
    if not triton_usable(k_cache.device) or k_cache.numel() == 0 or k.numel() == 0:
        k_cache.index_copy_(2, index, k)
        v_cache.index_copy_(2, index, v)
        return
    if index.device.type == "cpu":  # on the GPU this would be a host sync
        check_cache_index(index, k_cache)
    args, grid, meta = _launch(k_cache, v_cache, index, k, v)
    _kernel(checks)[grid](*args, **meta)


def check_cache_index(index: torch.Tensor, cache: torch.Tensor) -> None:
    """Eager's IndexError for an index (on the CPU) outside the slots of a cache
    ``[B, H, slots, D]``."""
    slots = cache.shape[2]
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= slots:
        bad = low if low < 0 else high
        raise IndexError(f"index_copy_(): index {bad} is out of bounds for a cache of "
                         f"{slots} slots (shape {tuple(cache.shape)})")  # fmt: skip


write_cache_pair.writes_arguments = (0, 1)  # type: ignore[attr-defined]  # the two caches


def precompile_pair(k_cache, v_cache, index, k, v, checks: bool) -> None:
    """Compile the kernel that ``write_cache_pair`` on tensors like these (fake tensors
    suffice: shapes, strides, offsets, dtypes) would launch, without running it, so that it
    compiles beside the row kernels (``launch.precompile_all``) instead of at the first call."""
    args, grid, meta = _launch(k_cache, v_cache, index, k, v)
    warmup_launch(_kernel(checks), grid, args, meta, k_cache.device)


def _precompile_job(args: Any) -> Any:
    """The kernel family's precompile job (kernels/family.py) for a launch on ``args``:
    (k_cache, v_cache, index, k, v, checks), the tensors as example values."""
    *values, checks = args
    if not all(concrete_cuda_tensor(v) for v in values):
        return None
    key = ("pair", checks, *map(launch_key, values))
    return key, functools.partial(precompile_pair, *values, checks)


family("write_cache_pair", _precompile_job)(write_cache_pair)


def _launch(k_cache, v_cache, index, k, v) -> tuple[list[Any], tuple[int], dict[str, int]]:
    """(arguments, grid, meta-parameters) of the kernel's launch on these tensors."""
    batch, heads, rows, width = k.shape
    block = 1 << max(0, (width - 1).bit_length())
    args = [
        k_cache, v_cache, index, k, v,
        heads, rows, k_cache.shape[2], width, index.stride(0),
        *k_cache.stride(), *v_cache.stride(), *k.stride(), *v.stride(),
    ]  # fmt: skip
    return args, (batch * heads * rows,), {"BLOCK_D": block, "num_warps": 1 if block <= 256 else 4}


@functools.cache
def _kernel(checks: bool) -> Any:
    import triton
    import triton.language as tl

    @triton.jit(debug=checks)
    def _write_cache_pair(
        k_cache, v_cache, index, k, v,
        heads, rows, slots, width, index_stride,
        kc_b, kc_h, kc_s, kc_d, vc_b, vc_h, vc_s, vc_d,
        k_b, k_h, k_t, k_d, v_b, v_h, v_t, v_d,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        program = tl.program_id(0)
        row = program % rows
        head = (program // rows) % heads
        batch = (program // rows // heads).to(tl.int64)  # caches may pass 2**31 elements
        slot = tl.load(index + row * index_stride).to(tl.int64)
        inside = (slot >= 0) & (slot < slots)
        tl.device_assert(inside, "index_copy_: cache index out of range")
        cols = tl.arange(0, BLOCK_D)
        keep = (cols < width) & inside
        new_k = tl.load(k + batch * k_b + head * k_h + row * k_t + cols * k_d, mask=keep)
        new_v = tl.load(v + batch * v_b + head * v_h + row * v_t + cols * v_d, mask=keep)
        tl.store(k_cache + batch * kc_b + head * kc_h + slot * kc_s + cols * kc_d, new_k,
                 mask=keep)  # fmt: skip
        tl.store(v_cache + batch * vc_b + head * vc_h + slot * vc_s + cols * vc_d, new_v,
                 mask=keep)  # fmt: skip

    return _write_cache_pair
