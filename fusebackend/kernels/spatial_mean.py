"""The mean over a 4-d tensor's spatial dims (H x W) in one or two launches.

Squeeze-excite blocks (EfficientNet, MobileNetV3, GhostNet, RegNetY) take
``x.mean((2, 3), keepdim=True)`` of a channels-last activation after each block, and
classifier heads ``adaptive_avg_pool2d(x, 1)``. aten reduces such a tensor slowly: 17 launches
took 149 us of an EfficientNet-B0 batch-8 call and 9 took 82.5 us of a MobileNetV3-large one,
where reading the tensors once takes a few microseconds (H200, fp16, 2026-11-28, the
``kernel_kinds`` of ``benchmarks/vision.py``'s rows in ``vision_h200_11c362e.json`` and
``vision_h200_b7cc5c6.json``).

Here a program sums a ``[positions, channels]`` tile at a time in fp32, along the channels
first (contiguous in NHWC, so its loads coalesce), over its image's part of the H x W
positions. Where the images and channel blocks alone give too few programs to fill the GPU
(an early EfficientNet block: 8 images x 32 channels over 112 x 112 positions), the positions
are split among several programs, which write fp32 partial sums that a second launch adds
and scales. Any strides are read correctly; ``passes/spatial_means.py`` sends only
channels-last tensors here (aten's NCHW reduction runs along contiguous rows already).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fusebackend.kernels.configs import ceil_div, split_into_parts, triton_next_power_of_2
from fusebackend.kernels.family import concrete_cuda_tensor, family, launch_key
from fusebackend.kernels.launch import run_on_device, triton_usable
from fusebackend.kernels.triton_api import warmup_launch

__all__ = ["precompile_spatial_mean", "spatial_mean"]

_TILE = 4096  # elements of one program's tile: [positions, channels]
_MIN_POSITIONS = 256  # positions a program reads at least when the positions are split


def spatial_mean(x: torch.Tensor, keepdim: bool, channels_last: bool = False) -> torch.Tensor:
    """``x.mean((2, 3), keepdim=keepdim)`` of a 4-d floating tensor ``[B, C, H, W]``; with
    ``channels_last`` the ``[B, C, 1, 1]`` result has channels-last strides, as
    ``adaptive_avg_pool2d(x, 1)`` of a channels-last ``x`` gives (``mean`` gives contiguous
    ones: both hold the same elements in the same order)."""
    if not triton_usable(x.device) or x.numel() == 0:
        return x.mean((2, 3), keepdim=keepdim)
    out = _output(x, channels_last)
    for kernel, grid, args, meta in _launches(x, out):
        run_on_device(kernel, grid, args, meta, x.device)
    return out if keepdim else out.view(x.shape[0], x.shape[1])


def _output(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """The ``[B, C, 1, 1]`` result, as ``torch.empty`` lays it out in either format (made
    like ``x``: a fake tensor for a fake ``x``)."""
    channels = x.shape[1]
    strides = (channels, 1, channels, channels) if channels_last else (channels, 1, 1, 1)
    return x.new_empty_strided((x.shape[0], channels, 1, 1), strides)


def _launches(x: torch.Tensor, out: torch.Tensor) -> list[tuple[Any, tuple, list, dict]]:
    """The launches computing the mean of ``x`` into ``out``: ``(kernel, grid, args, meta)``
    each (one, or the partial sums and the launch finishing them)."""
    batch, channels, height, width = x.shape
    positions = height * width
    block_c = min(64, triton_next_power_of_2(channels))
    block_p = max(16, min(256, _TILE // block_c))
    channel_blocks = ceil_div(channels, block_c)
    parts, per_part = split_into_parts(positions, batch * channel_blocks, block_p, _MIN_POSITIONS)
    strides = (x.stride(0), x.stride(1), x.stride(2), x.stride(3))
    # Triton knows an integer's divisibility by 16 only: where every position's offset is a
    # multiple of 8 (72 channels, NHWC) saying so lets its loads along the channels be
    # 16-byte vectors
    align = 1
    while align < 16 and all(s % (2 * align) == 0 for s in (strides[0], strides[2], strides[3])):
        align *= 2
    meta = {"BLOCK_C": block_c, "BLOCK_P": block_p, "ALIGN": align, "num_warps": 4}
    if parts == 1:
        args = [x, out, channels, positions, width, *strides, per_part, 1.0 / positions,
                out.stride(0), out.stride(1)]  # fmt: skip
        return [(_sum_kernel(), (batch, channel_blocks, 1), args, {**meta, "PARTIAL": False})]
    partial = x.new_empty((parts, batch, channels), dtype=torch.float32)
    block = 256
    return [
        (_sum_kernel(), (batch, channel_blocks, parts),
         [x, partial, channels, positions, width, *strides, per_part, 1.0, batch * channels,
          channels], {**meta, "PARTIAL": True}),
        (_finish_kernel(), (ceil_div(batch * channels, block),),
         [partial, out, batch * channels, channels, parts, 1.0 / positions, out.stride(0),
          out.stride(1)], {"BLOCK": block, "num_warps": 2}),
    ]  # fmt: skip


def precompile_spatial_mean(x: torch.Tensor, channels_last: bool) -> None:
    """Compile the kernels ``spatial_mean(x, _, channels_last)`` launches (``x`` may be
    fake), without running them."""
    for kernel, grid, args, meta in _launches(x, _output(x, channels_last)):
        warmup_launch(kernel, grid, args, meta, x.device)


def _precompile_job(args: Any) -> Any:
    """The kernel family's precompile job (kernels/family.py) for a launch on ``args``
    (``spatial_mean``'s, ``x`` as its example value)."""
    x, _, channels_last = args
    if not concrete_cuda_tensor(x) or x.numel() == 0:
        return None
    job = functools.partial(precompile_spatial_mean, x, channels_last)
    return ("spatial_mean", channels_last, launch_key(x)), job


# Two kernels (sum, finish) to compile: 0.16-0.19 s for the sum alone on an H200 against a
# row kernel's 0.08-0.11 s (ResNet-50's and ResNeXt-50's cold first calls, 2026-12-01).
family("spatial_mean", _precompile_job, lambda args: 2.0)(spatial_mean)


@functools.cache
def _sum_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _spatial_sum(
        x,  # [B, C, H, W], any strides
        out,  # PARTIAL: [parts, B, C] fp32 (part stride, channel stride given); else [B, C]
        channels,
        positions,  # H * W
        width,
        stride_b,
        stride_c,
        stride_h,
        stride_w,
        per_part,  # positions of one program, a multiple of BLOCK_P
        scale,
        out_stride_0,  # PARTIAL: B * C (one part); else the image stride
        out_stride_1,  # PARTIAL: C (one image); else the channel stride
        PARTIAL: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_P: tl.constexpr,
        ALIGN: tl.constexpr,  # every position's offset is a multiple of this
    ):
        image = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        part = tl.program_id(2)
        keep = cols < channels
        base = x + image * stride_b + cols.to(tl.int64)[None, :] * stride_c
        acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
        offset = 0
        while offset < per_part:  # (range() over a runtime bound fails in the interpreter)
            p = (part * per_part + offset + tl.arange(0, BLOCK_P)).to(tl.int64)
            h, w = p // width, p % width
            mask = (p < positions)[:, None] & keep[None, :]
            rows = tl.multiple_of(h * stride_h + w * stride_w, ALIGN)
            ptrs = base + rows[:, None]
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            offset += BLOCK_P
        total = tl.sum(acc, axis=0) * scale
        if PARTIAL:
            target = out + part * out_stride_0 + image * out_stride_1 + cols
        else:
            target = out + image * out_stride_0 + cols * out_stride_1
        tl.store(target, total.to(out.dtype.element_ty), mask=keep)

    return _spatial_sum


@functools.cache
def _finish_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _spatial_finish(
        partial,  # [parts, B * C] fp32
        out,  # [B, C] (strided)
        count,  # B * C
        channels,
        parts,
        scale,
        out_stride_0,
        out_stride_1,
        BLOCK: tl.constexpr,
    ):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = index < count
        total = tl.zeros([BLOCK], dtype=tl.float32)
        part = 0
        while part < parts:
            total += tl.load(partial + part * count + index, mask=keep, other=0.0)
            part += 1
        image, channel = index // channels, index % channels
        target = out + image * out_stride_0 + channel * out_stride_1
        tl.store(target, (total * scale).to(out.dtype.element_ty), mask=keep)

    return _spatial_finish
