"""The Triton kernels of ``kernels/group_norm.py`` (``group_norm``): the math is described
there. Imported by ``group_norm._kernels`` at its first call (a precompile or a launch): this
module imports Triton at its top, which importing ``fusebackend.kernels`` must not. Two
pairs of kernels (partial sums, normalise): a group a program, and, further down, several
adjacent groups a program for channels-last groups of few channels.

A group's elements are numbered ``e`` in ``[0, CG * HW)``: channel-major (``c = e // HW``)
for NCHW tensors, position-major (``c = e % CG``) where the channels are contiguous
(``CHANNELS_INNER``), so consecutive elements are adjacent in memory either way. The element
lies at ``(group's first channel + c) * sx_c + s * sx_s`` from its image's start: the H x W
positions are one dim of stride ``sx_s`` (the launcher checks that they are). ``CG`` (channels
a group) and ``HW`` (positions) are constants: the pass takes static shapes only, and each
shape compiles its own kernel already (its loops' trip counts are constants too), so the
division of ``e`` by them is a multiply and shift rather than a division routine.
"""

import triton
import triton.language as tl

# (named "_..." as every infinifuse kernel is: a profile tells them from library kernels)
__all__ = ["_group_norm_apply", "_group_norm_stats", "_grouped_apply", "_grouped_stats"]


@triton.jit
def _place(e, CG, HW, sx_c, sx_s, CHANNELS_INNER: tl.constexpr):
    """(channel within the group, offset from the group's first element) of elements ``e``."""
    if CHANNELS_INNER:
        c = e % CG
        s = e // CG
    else:
        c = e // HW
        s = e % HW
    return c, c * sx_c + s * sx_s


@triton.jit
def _shifted_sums(base, pivot, start, stop, CG, HW, sx_c, sx_s, CHANNELS_INNER: tl.constexpr,
                  STEPS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Sums of ``x - pivot`` and of its squares over ``STEPS`` blocks of the group's elements
    from ``start``, none from ``stop`` on, in fp32. Shifting by one of the group's own
    elements keeps ``E[d^2] - E[d]^2`` accurate where the mean is large against the spread
    (the plain sum of squares would cancel)."""
    sums = tl.zeros([BLOCK], dtype=tl.float32)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    # (a constexpr trip count: Triton 3.6's interpreter cannot loop to a runtime bound,
    # and the pass takes static shapes only)
    for step in range(0, STEPS):
        e = start + step * BLOCK + tl.arange(0, BLOCK)
        inside = e < stop
        _, offset = _place(e, CG, HW, sx_c, sx_s, CHANNELS_INNER)
        v = tl.load(base + offset, mask=inside, other=0.0).to(tl.float32)
        d = tl.where(inside, v - pivot, 0.0)
        sums += d
        squares += d * d
    return tl.sum(sums, 0), tl.sum(squares, 0)


@triton.jit
def _finish(centred, rstd, channel, weight, bias, inside, dtype: tl.constexpr,
            HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACT: tl.constexpr,
            ACT: tl.constexpr):  # fmt: skip
    """``act(round((x - mean) * rstd * weight + bias))``: the norm rounded to the output's
    dtype as eager's ``group_norm`` gives it, then the activation eager runs on that value."""
    y = centred * rstd
    if HAS_WEIGHT:
        y = y * tl.load(weight + channel, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias + channel, mask=inside, other=0.0).to(tl.float32)
    y = y.to(dtype)
    if HAS_ACT:
        y = ACT(y.to(tl.float32)).to(dtype)
    return y


@triton.jit
def _group_norm_stats(x, partial, groups, elements, chunk, sx_n, sx_c, sx_s,
                      CG: tl.constexpr, HW: tl.constexpr, CHANNELS_INNER: tl.constexpr,
                      STEPS: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    """Program (group row, part): the shifted sums over its part of the row's elements, into
    ``partial[row, part, 0:2]`` (fp32); the pivot is the row's first element."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    n = row // groups
    g = row % groups
    base = x + n.to(tl.int64) * sx_n + (g * CG).to(tl.int64) * sx_c
    pivot = tl.load(base).to(tl.float32)
    start = part * chunk
    stop = tl.minimum(start + chunk, elements)
    sums, squares = _shifted_sums(base, pivot, start, stop, CG, HW, sx_c, sx_s,
                                  CHANNELS_INNER, STEPS, BLOCK)  # fmt: skip
    slot = partial + (row * parts + part) * 2
    tl.store(slot, sums)
    tl.store(slot + 1, squares)


@triton.jit
def _group_norm_apply(
    x, partial, weight, bias, out, groups, elements, chunk, eps,
    sx_n, sx_c, sx_s, so_n, so_c, so_s,
    CG: tl.constexpr, HW: tl.constexpr, CHANNELS_INNER: tl.constexpr, WHOLE_ROW: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACT: tl.constexpr, ACT: tl.constexpr,
    STEPS: tl.constexpr, ROW_STEPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (group row, part): normalise the part's elements. ``WHOLE_ROW``: the row fits
    one ``BLOCK`` (one part), loaded once, its variance from the centred values; else the
    mean and variance come from ``PARTS`` partial sums (``_group_norm_stats``: ``PARTS`` a
    power of two at least their count), or, with ``PARTS == 0``, from this program's own
    pass over the row (``ROW_STEPS`` blocks). A part is ``STEPS`` blocks. ``out`` is written
    through its own strides (``so_*``, its positions one strided dim too)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    n = row // groups
    g = row % groups
    base = x + n.to(tl.int64) * sx_n + (g * CG).to(tl.int64) * sx_c
    target = out + n.to(tl.int64) * so_n + (g * CG).to(tl.int64) * so_c
    dtype = out.dtype.element_ty
    if WHOLE_ROW:
        e = tl.arange(0, BLOCK)
        inside = e < elements
        c, offset = _place(e, CG, HW, sx_c, sx_s, CHANNELS_INNER)
        v = tl.load(base + offset, mask=inside, other=0.0).to(tl.float32)
        mean = tl.sum(v, 0) / elements
        centred = tl.where(inside, v - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, 0) / elements + eps)
        y = _finish(centred, rstd, g * CG + c, weight, bias, inside, dtype, HAS_WEIGHT,
                    HAS_BIAS, HAS_ACT, ACT)  # fmt: skip
        _, place = _place(e, CG, HW, so_c, so_s, CHANNELS_INNER)
        tl.store(target + place, y, mask=inside)
    else:
        pivot = tl.load(base).to(tl.float32)
        if PARTS == 0:
            sums, squares = _shifted_sums(base, pivot, 0, elements, CG, HW, sx_c, sx_s,
                                          CHANNELS_INNER, ROW_STEPS, BLOCK)  # fmt: skip
        else:
            parts = tl.num_programs(1)
            k = tl.arange(0, PARTS)
            slots = partial + (row * parts + k) * 2
            sums = tl.sum(tl.load(slots, mask=k < parts, other=0.0), 0)
            squares = tl.sum(tl.load(slots + 1, mask=k < parts, other=0.0), 0)
        shift = sums / elements
        variance = tl.maximum(squares / elements - shift * shift, 0.0)
        mean = pivot + shift
        rstd = tl.rsqrt(variance + eps)
        first = part * chunk
        stop = tl.minimum(first + chunk, elements)
        for step in range(0, STEPS):
            e = first + step * BLOCK + tl.arange(0, BLOCK)
            inside = e < stop
            c, offset = _place(e, CG, HW, sx_c, sx_s, CHANNELS_INNER)
            v = tl.load(base + offset, mask=inside, other=0.0).to(tl.float32)
            y = _finish(v - mean, rstd, g * CG + c, weight, bias, inside, dtype, HAS_WEIGHT,
                        HAS_BIAS, HAS_ACT, ACT)  # fmt: skip
            _, place = _place(e, CG, HW, so_c, so_s, CHANNELS_INNER)
            tl.store(target + place, y, mask=inside)


# --- several groups a program, for channels-last tensors with few channels a group ---------
#
# A program of the kernels above reads one group: on a channels-last tensor, its CG channels
# at each position, 16 bytes for BiT's 8 fp16 channels, the next position a whole pixel
# away. Those took two to three times their NCHW time (H200, 2026-12-01; 32 bytes, 16
# channels, took about the NCHW time). These read GPP adjacent groups a program as one
# [BLOCK_P positions, GPP groups, CGP channels] tile (CGP: CG rounded up to a power of two,
# the channels past CG masked), so each position's loads span GPP x CG channels (256 bytes
# or every group's: the launcher's _GROUPED_SPAN_BYTES).


@triton.jit
def _tile(first, g0, groups, sx_c, sx_s, CG: tl.constexpr, CGP: tl.constexpr,
          GPP: tl.constexpr, HW: tl.constexpr, BLOCK_P: tl.constexpr):  # fmt: skip
    """(channels [GPP, CGP], offsets and mask [BLOCK_P, GPP, CGP]) of the tile at positions
    ``first ...`` of groups ``g0 ... g0 + GPP - 1``."""
    p = first + tl.arange(0, BLOCK_P)
    g = g0 + tl.arange(0, GPP)
    j = tl.arange(0, CGP)
    channel = g[:, None] * CG + j[None, :]
    real = (g[:, None] < groups) & (j[None, :] < CG)
    offset = p[:, None, None] * sx_s + channel[None, :, :] * sx_c
    inside = (p < HW)[:, None, None] & real[None, :, :]
    return channel, offset, inside


@triton.jit
def _tile_sums(base, pivot, first, g0, groups, sx_c, sx_s, CG: tl.constexpr,
               CGP: tl.constexpr, GPP: tl.constexpr, HW: tl.constexpr, STEPS: tl.constexpr,
               BLOCK_P: tl.constexpr):  # fmt: skip
    """Per group ([GPP]) sums of ``x - pivot`` and of its squares over ``STEPS`` tiles of
    positions from ``first``, in fp32."""
    sums = tl.zeros([BLOCK_P, GPP, CGP], dtype=tl.float32)
    squares = tl.zeros([BLOCK_P, GPP, CGP], dtype=tl.float32)
    for step in range(0, STEPS):
        _, offset, inside = _tile(first + step * BLOCK_P, g0, groups, sx_c, sx_s, CG, CGP,
                                  GPP, HW, BLOCK_P)  # fmt: skip
        v = tl.load(base + offset, mask=inside, other=0.0).to(tl.float32)
        d = tl.where(inside, v - pivot[None, :, None], 0.0)
        sums += d
        squares += d * d
    return tl.sum(tl.sum(sums, 2), 0), tl.sum(tl.sum(squares, 2), 0)


@triton.jit
def _pivots(base, g0, groups, sx_c, CG: tl.constexpr, GPP: tl.constexpr):
    """Each group's first element (its first channel at the first position), in fp32."""
    g = g0 + tl.arange(0, GPP)
    return tl.load(base + (g * CG).to(tl.int64) * sx_c, mask=g < groups, other=0.0).to(tl.float32)


@triton.jit
def _grouped_stats(x, partial, groups, block_groups, chunk, sx_n, sx_c, sx_s,
                   CG: tl.constexpr, CGP: tl.constexpr, GPP: tl.constexpr, HW: tl.constexpr,
                   STEPS: tl.constexpr, BLOCK_P: tl.constexpr):  # fmt: skip
    """Program (image x block of GPP groups, part): each group's shifted sums over the part's
    positions (``chunk`` of them, ``STEPS`` tiles), into ``partial[row, part, 0:2]``."""
    block = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    n = block // block_groups
    g0 = (block % block_groups) * GPP
    base = x + n.to(tl.int64) * sx_n
    pivot = _pivots(base, g0, groups, sx_c, CG, GPP)
    sums, squares = _tile_sums(base, pivot, part * chunk, g0, groups, sx_c, sx_s, CG, CGP, GPP,
                               HW, STEPS, BLOCK_P)  # fmt: skip
    g = g0 + tl.arange(0, GPP)
    slot = partial + ((n * groups + g) * parts + part) * 2
    tl.store(slot, sums, mask=g < groups)
    tl.store(slot + 1, squares, mask=g < groups)


@triton.jit
def _grouped_apply(
    x, partial, weight, bias, out, groups, block_groups, chunk, eps,
    sx_n, sx_c, sx_s, so_n, so_c, so_s,
    CG: tl.constexpr, CGP: tl.constexpr, GPP: tl.constexpr, HW: tl.constexpr,
    WHOLE_ROW: tl.constexpr, PARTS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ACT: tl.constexpr, ACT: tl.constexpr, STEPS: tl.constexpr,
    ROW_STEPS: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Program (image x block of GPP groups, part): normalise the part's positions of its
    groups, as ``_group_norm_apply`` does a row's: ``WHOLE_ROW``, every position in one tile;
    else the statistics from ``PARTS`` partial sums or (``PARTS == 0``) its own pass
    (``ROW_STEPS`` tiles)."""
    block = tl.program_id(0)
    part = tl.program_id(1)
    n = block // block_groups
    g0 = (block % block_groups) * GPP
    base = x + n.to(tl.int64) * sx_n
    target = out + n.to(tl.int64) * so_n
    dtype = out.dtype.element_ty
    elements = CG * HW
    if WHOLE_ROW:
        channel, offset, inside = _tile(0, g0, groups, sx_c, sx_s, CG, CGP, GPP, HW, BLOCK_P)
        v = tl.load(base + offset, mask=inside, other=0.0).to(tl.float32)
        mean = tl.sum(tl.sum(v, 2), 0) / elements
        centred = tl.where(inside, v - mean[None, :, None], 0.0)
        variance = tl.sum(tl.sum(centred * centred, 2), 0) / elements
        rstd = tl.rsqrt(variance + eps)[None, :, None]
        y = _finish(centred, rstd, channel[None, :, :], weight, bias, inside, dtype, HAS_WEIGHT,
                    HAS_BIAS, HAS_ACT, ACT)  # fmt: skip
        _, place, _ = _tile(0, g0, groups, so_c, so_s, CG, CGP, GPP, HW, BLOCK_P)
        tl.store(target + place, y, mask=inside)
    else:
        pivot = _pivots(base, g0, groups, sx_c, CG, GPP)
        if PARTS == 0:
            sums, squares = _tile_sums(base, pivot, 0, g0, groups, sx_c, sx_s, CG, CGP, GPP, HW,
                                       ROW_STEPS, BLOCK_P)  # fmt: skip
        else:
            parts = tl.num_programs(1)
            g = g0 + tl.arange(0, GPP)
            k = tl.arange(0, PARTS)
            slots = partial + ((n * groups + g)[:, None] * parts + k[None, :]) * 2
            read = (g < groups)[:, None] & (k < parts)[None, :]
            sums = tl.sum(tl.load(slots, mask=read, other=0.0), 1)
            squares = tl.sum(tl.load(slots + 1, mask=read, other=0.0), 1)
        shift = sums / elements
        variance = tl.maximum(squares / elements - shift * shift, 0.0)
        mean = (pivot + shift)[None, :, None]
        rstd = tl.rsqrt(variance + eps)[None, :, None]
        for step in range(0, STEPS):
            first = part * chunk + step * BLOCK_P
            channel, offset, inside = _tile(first, g0, groups, sx_c, sx_s, CG, CGP, GPP, HW,
                                            BLOCK_P)  # fmt: skip
            v = tl.load(base + offset, mask=inside, other=0.0).to(tl.float32)
            y = _finish(v - mean, rstd, channel[None, :, :], weight, bias, inside, dtype,
                        HAS_WEIGHT, HAS_BIAS, HAS_ACT, ACT)  # fmt: skip
            _, place, _ = _tile(first, g0, groups, so_c, so_s, CG, CGP, GPP, HW, BLOCK_P)
            tl.store(target + place, y, mask=inside)
