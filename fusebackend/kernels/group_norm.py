"""A GroupNorm with its activation as one Triton kernel (or two where the groups are few).

``act(F.group_norm(x, groups, weight, bias, eps))`` of a ``[N, C, *spatial]`` tensor: each of
the ``N x groups`` rows (``C / groups`` channels over every position) is normalised by its
own mean and biased variance, in fp32, then scaled and shifted per channel, rounded to the
input's dtype (as eager's ``group_norm`` gives it), and the activation (``kernels/epilogue.py``'s
function of a ``kernels.ir.ACTIVATIONS`` name, the row kernels' own math) runs on that value
and rounds again, as eager's separate activation does. ResNet-V2 (BiT) and the ResNet blocks
of diffusion UNets run a GroupNorm + ReLU or SiLU before each convolution; aten runs it as
three kernels (moments, per-channel constants, the normalise pass) and the activation as a
fourth, reading and writing the tensor twice. With its ReLU the kernel took 0.18-0.90x the
time of aten's GroupNorm and ReLU at BiT's and a UNet's shapes (H200, fp16, NCHW and
channels-last, 2026-12-01, ``benchmarks/diag/diag_group_norm.py``; docs/PERFORMANCE.md).

Launches: where a row has at most ``_WHOLE_ROW`` elements a program holds it in registers,
reads it once and writes it once. Wider rows are read twice, in ``_BLOCK`` chunks: once for
the sums of ``x - pivot`` and of its squares (the pivot, one of the row's elements, keeps the
variance from cancelling), once to normalise. Where the rows alone give fewer programs than
the GPU has room for (BiT's first stage at batch 1: 32 rows of 25088 elements), each row is
split into parts: a first launch writes each part's sums (fp32), and the second adds them
up and normalises its part.

Any layout whose positions form one strided dim is read in place (NCHW, channels-last, a
contiguous ``[N, C, L]``); channels-last rows are walked position by position, so that
consecutive elements are adjacent, and where a group's channels are under 32 bytes a
position (BiT's 8 fp16 channels) in an image of 256 KiB or more, a program reads several
adjacent groups as one ``[positions, groups, channels]`` tile (``_grouped_launches``), its
statistics per group.
The output has the strides asked for (the input's by default), its positions one strided
dim too. On a device Triton cannot use, or a layout it does not take, the value is computed
with aten's ops; on fake tensors (passes working out shapes and layouts) the call gives an
empty output.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from fusebackend.kernels.configs import ceil_div, split_into_parts, triton_next_power_of_2
from fusebackend.kernels.epilogue import activation_program, epilogue_function, evaluate
from fusebackend.kernels.family import concrete_cuda_tensor, family, launch_key
from fusebackend.kernels.launch import run_on_device, triton_usable
from fusebackend.kernels.triton_api import warmup_launch

__all__ = ["group_norm", "precompile_group_norm", "takes"]

_WHOLE_ROW = 4096  # elements of a row held in registers by one program
_BLOCK = 1024  # elements of a wider row's chunk
_MAX_PARTS = 64  # parts a row is split into at most (each two steps of a block at least)
_INT32_OFFSETS = 2**31 - 1  # an image's elements up to this many: int32 offsets within it
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A channels-last group of fewer bytes than this a position, in an image of this many bytes
# at least, is read several groups a program (``_grouped_launches``), a program reading this
# many bytes of each position at least (or every group's). One group a program reads a few
# bytes of each position's row: at BiT's channels-last norms at batch 8 (fp16, 32 groups) it
# took 25.88 us at 64 x 56 x 56 (4 bytes a group), 23.79 at 128 x 56 x 56 and 23.03 at
# 256 x 56 x 56, where several groups with 256-byte spans took 12.07, 12.94 and 19.45
# (Inductor's kernels 10.9, 12.71, 18.49); in images of up to 200 KB it was the faster
# (128 x 28 x 28: 6.19 against 7.13, 256 x 14 x 14: 3.47 against 5.06), and at 32 bytes a
# group the same or faster everywhere (H200, 2026-12-01, 35e7ee7, diag_group_norm.py
# --sweep). At batch 1 the rule costs up to 1.45 us (1 x 128 x 56 x 56: 8.81 against 7.36).
_GROUPED_BELOW_BYTES = 32
_GROUPED_FROM_IMAGE_BYTES = 256 << 10
_GROUPED_SPAN_BYTES = 256


def group_norm(
    x: torch.Tensor,
    groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    activation: str = "",
    strides: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``act(F.group_norm(x, groups, weight, bias, eps))``, ``activation`` one of
    ``kernels.ir.ACTIVATIONS`` or "" for none; ``weight`` and ``bias`` hold C contiguous
    elements (any floating dtype) or are None. The result has ``x``'s shape and dtype, and
    ``strides`` where given (the layout eager gives: aten's CUDA GroupNorm makes a
    channels-last input contiguous first), else ``x``'s."""
    _check(x, groups, weight, bias)
    activation_program(activation, x.dtype)  # (a clear error for an unknown name)
    out = _output(x, strides)
    if isinstance(x, FakeTensor) or not x.numel():  # (fakes: passes work out layouts)
        return out
    if not (triton_usable(x.device) and takes(x) and _spatial_stride(out) is not None):
        return out.copy_(_reference(x, groups, weight, bias, eps, activation))
    for kernel, grid, args, meta in _launches(x, groups, weight, bias, eps, activation, out):
        run_on_device(kernel, grid, args, meta, x.device)
    return out


def _check(x: torch.Tensor, groups: int, *vectors: torch.Tensor | None) -> None:
    """A clear error for arguments the kernel would read wrongly (the pass never makes them)."""
    if x.dim() < 2 or groups < 1 or x.shape[1] % groups:
        raise ValueError(f"group_norm: {groups} groups do not divide the channels of an "
                         f"input of shape {tuple(x.shape)}")  # fmt: skip
    for vector in vectors:
        if vector is not None and (vector.numel() != x.shape[1] or not vector.is_contiguous()):
            raise ValueError(f"group_norm: a per-channel vector must hold {x.shape[1]} "
                             f"contiguous elements, got {tuple(vector.shape)}")  # fmt: skip


def _reference(x, groups, weight, bias, eps, activation) -> torch.Tensor:
    """The value in aten's ops, as eager computes it; the activation by
    ``kernels/epilogue.py``'s torch reference."""
    y = F.group_norm(x, groups, weight, bias, eps)
    return evaluate(activation_program(activation, x.dtype), y) if activation else y


def _spatial_stride(x: torch.Tensor) -> int | None:
    """The stride of ``x``'s positions as one dim (dims 2..), or None where they are not one
    strided dim (a sliced or permuted view)."""
    stride = None
    for size, step in reversed(list(zip(x.shape[2:], x.stride()[2:], strict=True))):
        if size == 1:
            continue
        if stride is None:
            stride, expected = step, step * size
        elif step != expected:
            return None
        else:
            expected = step * size
    return 1 if stride is None else stride


def _output(x: torch.Tensor, strides: tuple[int, ...] | None) -> torch.Tensor:
    """The result: ``x``'s shape and dtype, ``strides`` or ``x``'s (made like ``x``: a fake
    tensor for a fake ``x``)."""
    if strides is None:
        return torch.empty_like(x)
    if len(strides) != x.dim():
        raise ValueError(f"group_norm: strides {strides} for an input of shape {tuple(x.shape)}")
    return x.new_empty_strided(x.shape, strides)


def takes(x: torch.Tensor) -> bool:
    """Does the kernel read ``x`` in place (a floating dtype it computes, the positions one
    strided dim, offsets within an image in int32)?"""
    if x.dtype not in _DTYPES or _spatial_stride(x) is None:
        return False
    span = 1 + sum((size - 1) * step for size, step in zip(x.shape[1:], x.stride()[1:],
                                                            strict=True))  # fmt: skip
    return span <= _INT32_OFFSETS


def _launches(x, groups, weight, bias, eps, activation, out, parts=None):
    """The launches computing ``out``: ``(kernel, grid, args, meta)`` each. ``parts``: the
    number of parts a wide row is split into, instead of the launcher's choice (tests)."""
    batch, channels = x.shape[:2]
    positions = math.prod(x.shape[2:])
    per_group = channels // groups
    elements = per_group * positions
    channels_inner = x.stride(1) == 1 and per_group > 1 and positions > 1
    image_bytes = channels * positions * x.element_size()
    if (channels_inner and per_group * x.element_size() < _GROUPED_BELOW_BYTES
            and image_bytes >= _GROUPED_FROM_IMAGE_BYTES):  # fmt: skip
        return _grouped_launches(x, groups, weight, bias, eps, activation, out, parts)
    shape = {"CG": per_group, "HW": positions, "CHANNELS_INNER": channels_inner}
    whole = None
    if elements <= _WHOLE_ROW:
        block = triton_next_power_of_2(elements)
        whole = (block, 8 if block >= 4096 else 4 if block >= 512 else 2)
    return _planned(_kernels()[:2], x, groups, weight, bias, eps, activation, out, parts,
                    programs=batch * groups, extent=elements, second=elements, shape=shape,
                    block=("BLOCK", _BLOCK), whole=whole)  # fmt: skip


def _grouped_launches(x, groups, weight, bias, eps, activation, out, parts=None):
    """``_launches`` for a channels-last ``x`` whose groups are few channels: several
    adjacent groups a program, ``[positions, groups, channels]`` tiles
    (``kernels/group_norm_triton.py``'s second pair). The positions are what is split into
    parts."""
    batch, channels = x.shape[:2]
    positions = math.prod(x.shape[2:])
    per_group = channels // groups
    padded = triton_next_power_of_2(per_group)
    together = 1  # groups a program: a position's loads span this many groups' channels
    while together * per_group * x.element_size() < _GROUPED_SPAN_BYTES and together < groups:
        together *= 2
    block_groups = ceil_div(groups, together)
    shape = {"CG": per_group, "CGP": padded, "GPP": together, "HW": positions}
    tile = triton_next_power_of_2(positions) * together * padded
    whole = None
    if tile <= _WHOLE_ROW:
        whole = (triton_next_power_of_2(positions), 8 if tile >= 4096 else 4)
    return _planned(_kernels()[2:], x, groups, weight, bias, eps, activation, out, parts,
                    programs=batch * block_groups, extent=positions, second=block_groups,
                    shape=shape, block=("BLOCK_P", max(1, _BLOCK // (together * padded))),
                    whole=whole)  # fmt: skip


def _planned(kernels, x, groups, weight, bias, eps, activation, out, parts, *, programs,
             extent, second, shape, block, whole):  # fmt: skip
    """The launches of one pair of kernels (partial sums, normalise) over ``programs``
    programs, each normalising ``extent`` units (a row's elements, or its groups' positions):
    one launch where the units fit one program's registers (``whole``: the block size and
    warps, or None), else the units split into ``parts`` of whole steps of ``block``
    (``(meta name, units a step)``), a part two steps at least; one launch where there is
    one part (it reads its row twice), else the partial-sums launch and the normalising one.
    Both kernels take ``groups`` and ``second`` (the row's elements, or the blocks of groups
    an image) after their tensors, and ``shape``'s constants."""
    stats_kernel, apply_kernel = kernels
    block_name, step = block
    # (an absent tensor's pointer is x's: never read, HAS_* being False)
    vectors = [x if weight is None else weight, x if bias is None else bias]
    strides = [x.stride(0), x.stride(1), _spatial_stride(x)]
    out_strides = [out.stride(0), out.stride(1), _spatial_stride(out)]
    meta = {
        **shape, "HAS_WEIGHT": weight is not None, "HAS_BIAS": bias is not None,
        "HAS_ACT": bool(activation),
        "ACT": epilogue_function(activation_program(activation, x.dtype)),
    }  # fmt: skip
    if whole is not None and parts is None:
        size, warps = whole
        meta = {**meta, "WHOLE_ROW": True, "PARTS": 0, "STEPS": 1, "ROW_STEPS": 1,
                block_name: size, "num_warps": warps}  # fmt: skip
        args = [x, x, *vectors, out, groups, second, extent, eps, *strides, *out_strides]
        return [(apply_kernel, (programs, 1), args, meta)]
    parts, chunk = split_into_parts(extent, programs, step, 2 * step, _MAX_PARTS, parts)
    steps = chunk // step
    meta = {**meta, "WHOLE_ROW": False, block_name: step, "STEPS": steps, "num_warps": 4,
            "ROW_STEPS": steps if parts == 1 else 1}  # fmt: skip
    tail = [groups, second, chunk, eps, *strides, *out_strides]
    if parts == 1:
        return [(apply_kernel, (programs, 1), [x, x, *vectors, out, *tail], {**meta, "PARTS": 0})]
    partial = x.new_empty((x.shape[0] * groups, parts, 2), dtype=torch.float32)  # (fake, too)
    stats_meta = {**shape, "STEPS": steps, block_name: step, "num_warps": 4}
    return [
        (stats_kernel, (programs, parts), [x, partial, groups, second, chunk, *strides],
         stats_meta),
        (apply_kernel, (programs, parts), [x, partial, *vectors, out, *tail],
         {**meta, "PARTS": triton_next_power_of_2(parts)}),
    ]  # fmt: skip


def precompile_group_norm(x, groups, weight, bias, eps, activation="", strides=None) -> None:
    """Compile the kernels ``group_norm`` launches on such arguments (their tensors may be
    fake), without running them."""
    out = _output(x, strides)
    for kernel, grid, args, meta in _launches(x, groups, weight, bias, eps, activation, out):
        warmup_launch(kernel, grid, args, meta, x.device)


def _precompile_job(args: Any) -> Any:
    """The kernel family's precompile job (kernels/family.py) for a launch on ``args``
    (``group_norm``'s, the tensors as example values)."""
    x, groups, weight, bias, eps, *rest = args
    tensors = [t for t in (x, weight, bias) if t is not None]
    if not all(concrete_cuda_tensor(t) for t in tensors) or not x.numel() or not takes(x):
        return None
    if not isinstance(groups, int) or not isinstance(eps, (int, float)):
        return None
    key = ("group_norm", groups, eps, *rest, *map(launch_key, tensors))
    return key, functools.partial(precompile_group_norm, *args)


# Two small kernels where the rows are split: about two row kernels' compile
family("group_norm", _precompile_job, lambda args: 2.0)(group_norm)
group_norm.takes = takes  # type: ignore[attr-defined]  # (asked by passes/group_norms.py)


@functools.cache  # (each uncaptured launch asks: one lookup, not an import statement)
def _kernels() -> tuple[Any, Any, Any, Any]:
    """The Triton kernels (``kernels/group_norm_triton.py``, imported at the first call: it
    imports Triton, which importing this module must not): a group a program (stats,
    apply), then several groups a program (stats, apply)."""
    from fusebackend.kernels import group_norm_triton as k

    return k._group_norm_stats, k._group_norm_apply, k._grouped_stats, k._grouped_apply
