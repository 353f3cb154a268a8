"""2-d max and average pooling of channels-last tensors in one Triton launch.

Inception-v3 pools its channels-last activations with ``F.avg_pool2d(x, 3, 1, 1)`` in every
InceptionA/C/E block and ``F.max_pool2d(x, 3, 2)`` in its stem and reduction blocks. aten's
NHWC pooling kernels are slow: at batch 8 (fp16, H200, 2026-12-02, 5d417ac,
``kernel_census_inception_b8_h200_5d417ac.json``) 9 average pools took 189.8 us and 4
max pools 109.9 us of infinifuse's 1051 us of kernel time a call, where reading those
tensors once takes a few microseconds each; Inductor computes them in its own Triton
kernels, which is most of why its call was 993 us.

A program computes a ``[positions, channels]`` tile of the output: for each of the window's
``KH x KW`` taps (unrolled) it loads one ``[positions, channels]`` block of the input,
coalesced along the channels (contiguous in NHWC), masked outside the image. Max pooling
keeps the largest value and lets a NaN through, as aten's does; average pooling sums in fp32
and divides by aten's divisor (``divisor_override``, else the window's size clipped to the
padded image with ``count_include_pad``, else to the image itself). Any strides are read and
written correctly; ``passes/pooling.py`` sends only channels-last tensors here (aten's NCHW
kernels read along contiguous rows already).

On a device Triton cannot use (the CPU without the interpreter), and for what the kernel does
not take (float64, a window of more than ``MAX_TAPS`` taps, more output positions than int32
indexes, a ``divisor_override`` of 0), aten's own pooling runs; on fake tensors (passes
working out shapes and layouts) the call gives an empty output of the kernel's shape, dtype
and layout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from fusebackend.kernels.configs import ceil_div, triton_next_power_of_2
from fusebackend.kernels.family import concrete_cuda_tensor, family, launch_key
from fusebackend.kernels.launch import run_on_device, triton_usable
from fusebackend.kernels.triton_api import warmup_launch

__all__ = ["MAX_TAPS", "POOLS", "pool2d", "pool2d_output_size", "precompile_pool2d"]

POOLS = ("max", "avg")
_TILE = 2048  # elements of one program's tile: [positions, channels]
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # (computed in fp32: not float64)
# The window's taps are unrolled, and compiling for sm_90 grew with them (2-core CPU,
# 2026-12-02, benchmarks/diag/compile_sm90.py's compile_launch): 3 x 3 0.8-2 s, 8 x 8 14 s,
# 16 x 16 279 s, 32 x 32 not done in 10 minutes. Larger windows (a global pool spelled
# F.avg_pool2d(x, 8)) are left to aten, as Inductor leaves pools of more than 25 taps.
MAX_TAPS = 25
# The kernel's output positions are int32 (B * OH * OW): more are left to aten.
_INT32_POSITIONS = 2**31 - 1 - 4096


def pool2d_output_size(
    size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool
) -> int:
    """One spatial dim of a pooling's output, as aten sizes it (a window that would start in
    the right padding alone is dropped in ceil mode)."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def pool2d(
    x: torch.Tensor,
    kind: str,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    """``F.max_pool2d`` (``kind`` "max") or ``F.avg_pool2d`` ("avg", ``dilation`` (1, 1)) of a
    4-d floating ``x`` with these arguments, every one given as a pair; the result has
    ``x``'s dtype and a channels-last layout for a channels-last ``x``."""
    if kind not in POOLS:
        raise ValueError(f"pool2d: kind must be one of {POOLS}, got {kind!r}")
    if kind == "avg" and tuple(dilation) != (1, 1):
        raise ValueError(f"pool2d: average pooling has no dilation, got {tuple(dilation)}")
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"pool2d: x must be a 4-d floating tensor, got {x.dim()}-d {x.dtype}")
    shape = _output_shape(x, kernel_size, stride, padding, dilation, ceil_mode)
    takes = _kernel_takes(x, kernel_size, shape, divisor_override)
    if isinstance(x, FakeTensor) and takes:
        return _empty_output(x, shape)
    if not takes or not triton_usable(x.device):
        return _aten(x, kind, kernel_size, stride, padding, dilation, ceil_mode,
                     count_include_pad, divisor_override)  # fmt: skip
    out = _empty_output(x, shape)
    kernel, grid, args, meta = _launch(x, out, kind, kernel_size, stride, padding, dilation,
                                       count_include_pad, divisor_override)  # fmt: skip
    run_on_device(kernel, grid, args, meta, x.device)
    return out


def _kernel_takes(x: torch.Tensor, kernel_size, shape: tuple, divisor_override) -> bool:
    """Does the kernel compute this pool? Not an empty one, one in float64, one of more than
    ``MAX_TAPS`` taps, one of more output positions than int32 indexes, or one whose
    ``divisor_override`` is 0 (aten's error)."""
    positions = shape[0] * shape[2] * shape[3]
    if x.numel() == 0 or positions == 0 or x.dtype not in _DTYPES or divisor_override == 0:
        return False
    return kernel_size[0] * kernel_size[1] <= MAX_TAPS and positions <= _INT32_POSITIONS


def _aten(x: torch.Tensor, kind: str, *args: Any) -> torch.Tensor:
    kernel_size, stride, padding, dilation, ceil_mode, count_include_pad, divisor = args
    if kind == "max":
        return F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)
    return F.avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor)


def _output_shape(x: torch.Tensor, kernel_size, stride, padding, dilation, ceil_mode) -> tuple:
    sizes = [
        pool2d_output_size(
            x.shape[2 + d], kernel_size[d], stride[d], padding[d], dilation[d], ceil_mode
        )  # fmt: skip
        for d in range(2)
    ]
    return (x.shape[0], x.shape[1], *sizes)


def _empty_output(x: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A new output of ``shape``, channels-last where ``x`` is (made like ``x``: fake for a
    fake ``x``)."""
    batch, channels, height, width = shape
    if x.stride(1) == 1 and x.shape[1] > 1:
        strides = (height * width * channels, 1, width * channels, channels)
    else:
        strides = (channels * height * width, height * width, width, 1)
    return x.new_empty_strided(shape, strides)


def _launch(x: torch.Tensor, out: torch.Tensor, kind: str, kernel_size, stride, padding,
            dilation, count_include_pad: bool, divisor_override: int | None
            ) -> tuple[Any, tuple, list, dict]:  # fmt: skip
    """``(kernel, grid, args, meta)`` of the launch pooling ``x`` into ``out``."""
    batch, channels, height, width = x.shape
    out_h, out_w = out.shape[2], out.shape[3]
    positions = batch * out_h * out_w
    block_c = min(64, triton_next_power_of_2(channels))
    block_p = max(16, min(128, _TILE // block_c))
    grid = (ceil_div(positions, block_p), ceil_div(channels, block_c), 1)
    args = [x, out, positions, channels, height, width, out_h, out_w, *x.stride(),
            *out.stride(), float(divisor_override or 0)]  # fmt: skip
    meta = {
        "MAX": kind == "max",
        "KH": kernel_size[0], "KW": kernel_size[1], "SH": stride[0], "SW": stride[1],
        "PH": padding[0], "PW": padding[1], "DH": dilation[0], "DW": dilation[1],
        "COUNT_PAD": bool(count_include_pad), "OVERRIDE": bool(divisor_override),
        "BLOCK_P": block_p, "BLOCK_C": block_c, "num_warps": 4,
    }  # fmt: skip
    return _pool_kernel(), grid, args, meta


def precompile_pool2d(x: torch.Tensor, *args: Any) -> None:
    """Compile the kernel ``pool2d(x, *args)`` launches (``x`` may be fake), without
    running it."""
    kind, kernel_size, stride, padding, dilation, ceil_mode, count_include_pad, divisor = args
    out = _empty_output(x, _output_shape(x, kernel_size, stride, padding, dilation, ceil_mode))
    warmup_launch(*_launch(x, out, kind, kernel_size, stride, padding, dilation,
                           count_include_pad, divisor), x.device)  # fmt: skip


def _precompile_job(args: Any) -> Any:
    """The kernel family's precompile job (kernels/family.py) for a launch on ``args``
    (``pool2d``'s, ``x`` as its example value)."""
    x, _kind, kernel_size, stride, padding, dilation, ceil_mode, _, divisor = args
    shape = _output_shape(x, kernel_size, stride, padding, dilation, ceil_mode)
    if not concrete_cuda_tensor(x) or not _kernel_takes(x, kernel_size, shape, divisor):
        return None
    rest = args[1:]
    key = ("pool2d", *(tuple(a) if isinstance(a, list) else a for a in rest), launch_key(x))
    return key, functools.partial(precompile_pool2d, x, *rest)


family("pool2d", _precompile_job, lambda args: 1.0)(pool2d)


@functools.cache
def _pool_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _pool2d(
        x,  # [B, C, H, W], any strides
        out,  # [B, C, OH, OW], any strides
        positions,  # B * OH * OW
        channels,
        height,
        width,
        out_h,
        out_w,
        stride_b,
        stride_c,
        stride_h,
        stride_w,
        out_stride_b,
        out_stride_c,
        out_stride_h,
        out_stride_w,
        divisor_override,
        MAX: tl.constexpr,
        KH: tl.constexpr,
        KW: tl.constexpr,
        SH: tl.constexpr,
        SW: tl.constexpr,
        PH: tl.constexpr,
        PW: tl.constexpr,
        DH: tl.constexpr,
        DW: tl.constexpr,
        COUNT_PAD: tl.constexpr,
        OVERRIDE: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        keep_p, keep_c = p < positions, cols < channels
        ow = p % out_w
        oh = (p // out_w) % out_h
        image = (p // (out_w * out_h)).to(tl.int64)
        top, left = oh * SH - PH, ow * SW - PW
        base = x + image * stride_b
        channel_offsets = cols.to(tl.int64)[None, :] * stride_c
        if MAX:
            acc = tl.full([BLOCK_P, BLOCK_C], float("-inf"), tl.float32)
        else:
            acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
        for kh in tl.static_range(KH):
            ih = top + kh * DH
            inside_h = (ih >= 0) & (ih < height)
            for kw in tl.static_range(KW):
                iw = left + kw * DW
                inside = keep_p & inside_h & (iw >= 0) & (iw < width)
                rows = ih.to(tl.int64) * stride_h + iw.to(tl.int64) * stride_w
                mask = inside[:, None] & keep_c[None, :]
                ptrs = base[:, None] + rows[:, None] + channel_offsets
                if MAX:
                    value = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
                    # (a NaN wins, as in aten's max pooling)
                    acc = tl.where((value > acc) | (value != value), value, acc)
                else:
                    acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if not MAX:
            if OVERRIDE:
                acc = acc / divisor_override
            else:
                bottom = tl.minimum(top + KH, height + PH)
                right = tl.minimum(left + KW, width + PW)
                if not COUNT_PAD:
                    bottom = tl.minimum(bottom, height)
                    right = tl.minimum(right, width)
                    top = tl.maximum(top, 0)
                    left = tl.maximum(left, 0)
                count = ((bottom - top) * (right - left)).to(tl.float32)
                acc = acc / count[:, None]
        target = (
            out
            + image[:, None] * out_stride_b
            + oh.to(tl.int64)[:, None] * out_stride_h
            + ow.to(tl.int64)[:, None] * out_stride_w
            + cols.to(tl.int64)[None, :] * out_stride_c
        )
        tl.store(target, acc.to(out.dtype.element_ty), mask=keep_p[:, None] & keep_c[None, :])

    return _pool2d
