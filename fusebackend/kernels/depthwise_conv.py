"""A depthwise 2-d convolution on channels-last tensors, with its per-channel affine and
activation, as one Triton kernel.

A depthwise convolution (``groups`` = input channels = output channels: MobileNet's,
EfficientNet's and GhostNet's inverted residuals) reads each output's ``KH x KW`` window of
one channel. On an NHWC tensor the channels are contiguous, so a program computes a
``[positions, channels]`` tile: for each of the ``KH x KW`` taps it loads one
``[positions, channels]`` block of the input (coalesced along the channels, zero outside the
image) and one weight per channel, accumulating in fp32. Then, still in registers,
``(acc - center) * scale + shift`` (a BatchNorm's per-channel constants, or the bias) and the
activation (``kernels/epilogue.py``'s function of ``kernels.ir.ACTIVATIONS``' name, the row
kernels' own math), rounded once to the output's dtype; then a residual tensor may be added,
rounded again as eager's add of the two would be (GhostNet's second ghost module adds its
block's shortcut to the depthwise half of its output: ``passes/depthwise.py``).

Why not cuDNN: its channels-last half-precision depthwise convolutions build their plan at the
first call of each shape, which dominated a convnet's first call (see ``passes/depthwise.py``
for the measurements), and the BatchNorm and activation after them took a launch and a pass
over the output of their own.

The output may be any tensor of the result's shape (``out``): the kernel
writes through its strides, so a concatenation's part is written in place
(``passes/concat_writes.py``).

On a device Triton cannot use (the CPU without the interpreter) the same value is computed
with aten's ops, in fp32; on fake tensors (passes working out shapes and layouts) the call
gives an empty output of the kernel's shape, dtype and layout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from fusebackend.kernels.configs import ceil_div
from fusebackend.kernels.epilogue import activation_program, epilogue_function, evaluate
from fusebackend.kernels.family import concrete_cuda_tensor, family, launch_key
from fusebackend.kernels.launch import run_on_device, triton_usable
from fusebackend.kernels.triton_api import warmup_launch

__all__ = ["depthwise_conv2d", "precompile_depthwise_conv2d"]

# Offsets up to this many elements fit the kernel's int32 index math; past it, WIDE (int64).
_INT32_OFFSETS = 2**31 - 1


def depthwise_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    center: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    activation: str,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act((F.conv2d(x, weight, None, stride, padding, dilation, C) - center) * scale +
    shift)`` for ``x`` of shape ``[N, C, H, W]`` and ``weight`` ``[C, 1, KH, KW]``, computed
    in fp32 and rounded once to ``x``'s dtype; ``center``, ``scale`` and ``shift`` hold C
    contiguous elements each (any floating dtype) or are None (0, 1, 0); ``activation`` one
    of ``kernels.ir.ACTIVATIONS`` ("" for none); plus ``residual`` where given (of the
    result's shape, dtype and device, any strides), added in the result's dtype as eager's
    ``+`` would. Written into ``out`` where given (of the
    result's shape, dtype and device, any strides: a concatenation's part,
    ``passes/concat_writes.py``), else into a new tensor of ``x``'s layout (channels-last
    for a channels-last ``x``); returns it."""
    _check(x, weight, center, scale, shift)
    shape = _output_shape(x, weight, stride, padding, dilation)
    if out is None:
        out = _empty_output(x, shape)
    wanted = (x.dtype, shape, x.device)
    for name, tensor in (("out", out), ("residual", residual)):
        got = None if tensor is None else (tensor.dtype, tuple(tensor.shape), tensor.device)
        if got not in (None, wanted):
            raise ValueError(f"depthwise_conv2d: {name} is {got}, the result {wanted}")
    if isinstance(x, FakeTensor) or not out.numel():  # (fakes: passes work out layouts)
        return out
    if not triton_usable(x.device) or not _channels_contiguous(x) or x.dtype == torch.float64:
        reference = _reference(x, weight, (stride, padding, dilation), (center, scale, shift),
                               activation)  # fmt: skip
        return out.copy_(reference if residual is None else reference + residual)
    args, grid, meta = _launch(x, weight, stride, padding, dilation, center, scale, shift,
                               activation, residual, out)  # fmt: skip
    run_on_device(_kernel(), grid, args, meta, x.device)
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, *vectors: torch.Tensor | None) -> None:
    """A clear error for arguments the kernel would read wrongly (the pass never makes them:
    a channel multiplier, a per-channel vector that is strided or of another length)."""
    channels = x.shape[1] if x.dim() == 4 else None
    if channels is None or weight.dim() != 4 or tuple(weight.shape[:2]) != (channels, 1):
        raise ValueError(f"depthwise_conv2d: weight {tuple(weight.shape)} is not [C, 1, KH, KW] "
                         f"for an input [N, C, H, W] of shape {tuple(x.shape)}")  # fmt: skip
    for vector in vectors:
        if vector is not None and (vector.numel() != channels or not vector.is_contiguous()):
            raise ValueError(f"depthwise_conv2d: a per-channel vector must hold {channels} "
                             f"contiguous elements, got {tuple(vector.shape)}")  # fmt: skip


def _reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    geometry: tuple[tuple[int, int], ...],
    vectors: tuple[torch.Tensor | None, ...],
    activation: str,
) -> torch.Tensor:
    """The value in aten's ops, in fp32 (fp64 stays fp64, which the kernel would compute in
    fp32), rounded once: ``geometry`` is (stride, padding, dilation), ``vectors`` (center,
    scale, shift); the activation by ``kernels/epilogue.py``'s torch reference."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.conv2d(x.to(compute), weight.to(compute), None, *geometry, x.shape[1])
    for vector, op in zip(vectors, (torch.sub, torch.mul, torch.add), strict=True):
        if vector is not None:
            y = op(y, vector.to(compute).reshape(-1, 1, 1))
    if activation:
        y = evaluate(activation_program(activation, compute), y)
    return y.to(x.dtype)


def _layout(x: torch.Tensor) -> torch.memory_format:
    channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
    if channels_last and not x.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _output_shape(x, weight, stride, padding, dilation) -> tuple[int, int, int, int]:
    batch, channels, height, width = x.shape
    kh, kw = weight.shape[2], weight.shape[3]
    oh = output_size(height, kh, stride[0], padding[0], dilation[0])
    ow = output_size(width, kw, stride[1], padding[1], dilation[1])
    return batch, channels, oh, ow


def _empty_output(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An output of ``shape`` in ``x``'s layout, made like ``x`` (fake for a fake ``x``)."""
    strides = torch.empty(shape, device="meta", memory_format=_layout(x)).stride()
    return x.new_empty_strided(shape, strides)


def _launch(x, weight, stride, padding, dilation, center, scale, shift, activation, residual,
            out, config=None):  # fmt: skip
    """The kernel's arguments, grid and meta-parameters for a launch writing ``out``
    (``config``: ``(BLOCK_P, BLOCK_C, num_warps)`` instead of ``_config``'s, for a sweep)."""
    batch, channels, height, width = x.shape
    _, _, oh, ow = out.shape
    positions = batch * oh * ow
    block_p, block_c, warps = config or _config(positions, channels)
    grid = (ceil_div(positions, block_p), ceil_div(channels, block_c))
    act = epilogue_function(activation_program(activation, out.dtype))
    # Every position's first channel is a multiple of ALIGN elements from the base: saying
    # so lets Triton load 16-byte vectors along the channels.
    align = 1
    while align < 8 and all(s % (2 * align) == 0 for s in (*x.stride()[::2], x.stride(3))):
        align *= 2
    # (an absent tensor's slot gets x: a pointer the kernel never reads, HAS_* being False;
    # an absent residual's strides are out's)
    args = [
        x, weight, out, *(x if v is None else v for v in (center, scale, shift, residual)),
        channels, height, width, oh, ow, positions,
        x.stride(0), x.stride(2), x.stride(3), weight.stride(0), weight.stride(2),
        weight.stride(3), *out.stride(), *(out if residual is None else residual).stride(),
        padding[0], padding[1], dilation[0], dilation[1],
    ]  # fmt: skip
    spans = (_span(x), _span(out), 0 if residual is None else _span(residual))
    wide = max(spans) > _INT32_OFFSETS
    meta = {
        "KH": weight.shape[2], "KW": weight.shape[3], "STRIDE_H": stride[0],
        "STRIDE_W": stride[1], "HAS_CENTER": center is not None,
        "HAS_SCALE": scale is not None, "HAS_SHIFT": shift is not None,
        "HAS_ACT": bool(activation), "ACT": act, "HAS_RESIDUAL": residual is not None,
        "ALIGN": align, "WIDE": wide, "ROW_LOOP": _row_loop(weight.shape[2], weight.shape[3]),
        "BLOCK_P": block_p, "BLOCK_C": block_c, "num_warps": warps,
    }  # fmt: skip
    return args, grid, meta


def _row_loop(kh: int, kw: int) -> bool:
    """Does the kernel loop over the window's rows at run time (its columns unrolled) rather
    than unroll all ``kh x kw`` taps? For windows over 3 x 3: each unrolled tap lengthens the
    compile. Compiled for sm_90 on the CPU machine (2026-12-01), a 5 x 5 window took 0.62 s
    unrolled and 0.19 s with the loop, a 3 x 3 0.23 and 0.16 s; in cold first calls on an
    H200, 16 compiles at once, the 5 x 5 kernels were the longest compiles, 0.85-1.26 s
    (GhostNet-100, MobileNetV3-large). Per call the loop is no faster where the window is
    small: over the 110 depthwise shapes of EfficientNet-B0, GhostNet-100, MobileNetV3-large
    and MixNet-S at batch 1 and 8 (H200, fp16, channels-last), 554.2 us against 557.2
    unrolled, but EfficientNet-B0's 3 x 3 shapes at batch 1 took 17.4 against 16.3 us, and
    the 5 x 5 ones 22.6 against 20.4 (MixNet-S's 23.1 against 19.5): about 2-4 us of a
    0.3-0.8 ms call, for 0.6-0.9 s less compile of each 5 x 5 kernel."""
    return kh * kw > 9


def _span(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last (a strided view spans more than its numel)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def _config(positions: int, channels: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_C, num_warps) for a launch over ``positions`` x ``channels``: 16
    channels a program, and more positions as the [16 x 16] tiles grow in number. In a sweep
    of 24 configurations over the 42 depthwise shapes of EfficientNet-B0, GhostNet-100 and
    MobileNetV3-large (H200, fp16, batch 1 and 8, 2026-11-30,
    ``benchmarks/diag/diag_depthwise_conv.py --sweep``) the fastest took 16 channels in 56
    of 84 shapes, and 16 positions up to about a thousand tiles, 64-128 at ten thousand."""
    tiles = ceil_div(positions, 16) * ceil_div(channels, 16)
    block_p = 16 if tiles < 1000 else 32 if tiles < 4000 else 64
    return block_p, 16, 4


def _channels_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t``'s channels are contiguous (stride 1), as the kernel reads them."""
    return t.stride(1) == 1 or t.shape[1] == 1


def precompile_depthwise_conv2d(*args: Any) -> None:
    """Compile the kernel ``depthwise_conv2d(*args)`` launches (its tensors may be fake),
    without running it."""
    x, weight, stride, padding, dilation = args[:5]
    residual = args[9] if len(args) > 9 else None
    out = args[10] if len(args) > 10 else None
    if out is None:
        out = _empty_output(x, _output_shape(x, weight, stride, padding, dilation))
    launch_args, grid, meta = _launch(*args[:9], residual, out)
    warmup_launch(_kernel(), grid, launch_args, meta, x.device)


def _precompile_job(args: Any) -> Any:
    """The kernel family's precompile job (kernels/family.py) for a launch on ``args``
    (``depthwise_conv2d``'s, ``residual`` and ``out`` perhaps among them, the tensors as
    example values)."""
    x, weight, stride, padding, dilation, center, scale, shift, activation, *rest = args
    optional = (center, scale, shift, *rest)
    tensors = [t for t in (x, weight, *optional) if t is not None]
    if not all(concrete_cuda_tensor(t) for t in tensors) or x.numel() == 0:
        return None
    key = ("depthwise", stride, padding, dilation, activation, len(rest),
           *(v is None for v in optional), *map(launch_key, tensors))  # fmt: skip
    return key, functools.partial(precompile_depthwise_conv2d, *args)


def _compile_weight(args: Any) -> float:
    """A compile's time against a row kernel's (kernels/family.py), from the taps it unrolls
    (a window over 3 x 3 unrolls one row: ``_row_loop``). Compiled for sm_90 on the CPU
    machine (``benchmarks/diag/compile_sm90.py``, Triton's cache empty, 2026-12-01): a 3 x 3
    window 0.3 s, a 5 x 5 in its row loop 0.2 s, the paired cache write (a kernel as small
    as a row kernel) 0.1 s. Before the row loop, in cold first calls on an H200, a 5 x 5
    window took 0.85-1.26 s and a 3 x 3 0.30-0.59 s."""
    kh, kw = args[1].shape[2:]
    return 1 + (kw if _row_loop(kh, kw) else kh * kw) / 3


family("depthwise_conv2d", _precompile_job, _compile_weight)(depthwise_conv2d)
# Where the launcher takes a tensor to add to its value (passes/depthwise.py), and the tensor
# to write its value into (passes/concat_writes.py)
depthwise_conv2d.residual_position = 9  # type: ignore[attr-defined]
depthwise_conv2d.out_position = 10  # type: ignore[attr-defined]


@functools.cache  # (each uncaptured launch asks: one lookup, not an import statement)
def _kernel() -> Any:
    """The Triton kernel (``kernels/depthwise_triton.py``, imported at the first call: it
    imports Triton, which importing this module must not)."""
    from fusebackend.kernels.depthwise_triton import _depthwise_conv2d

    return _depthwise_conv2d
