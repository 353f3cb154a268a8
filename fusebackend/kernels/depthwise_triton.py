"""The Triton kernel of ``kernels/depthwise_conv.py`` (``depthwise_conv2d``): its math is
described there. Imported by ``depthwise_conv._kernel`` at its first call (a precompile or a
launch): this module imports Triton at its top, which importing ``fusebackend.kernels`` must
not.
"""

import triton
import triton.language as tl

# (named "_..." as every infinifuse kernel is: a profile tells them from library kernels)
__all__ = ["_depthwise_conv2d"]


@triton.jit
def _window_row(acc, x, weight, c, c_in, p_in, n, oh, ow, kh, height, width,
                sx_n, sx_h, sx_w, sw_c, sw_h, sw_w, pad_h, pad_w, dilation_h, dilation_w,
                KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
                ALIGN: tl.constexpr):  # fmt: skip
    """``acc`` plus the products of the window's row ``kh``: its ``KW`` taps unrolled."""
    ih = oh * STRIDE_H - pad_h + kh * dilation_h
    h_in = p_in & (ih >= 0) & (ih < height)
    for kw in tl.static_range(KW):
        iw = ow * STRIDE_W - pad_w + kw * dilation_w
        inside = h_in & (iw >= 0) & (iw < width)
        row = tl.multiple_of(n * sx_n + ih * sx_h + iw * sx_w, ALIGN)
        mask = inside[:, None] & c_in[None, :]
        values = tl.load(x + row[:, None] + c[None, :], mask=mask, other=0.0)
        w = tl.load(weight + c * sw_c + kh * sw_h + kw * sw_w, mask=c_in, other=0.0)
        acc += values.to(tl.float32) * w.to(tl.float32)[None, :]
    return acc


@triton.jit
def _depthwise_conv2d(
    x, weight, out, center, scale, shift, residual,
    channels, height, width, out_height, out_width, positions,
    sx_n, sx_h, sx_w, sw_c, sw_h, sw_w, so_n, so_c, so_h, so_w, sr_n, sr_c, sr_h, sr_w,
    pad_h, pad_w, dilation_h, dilation_w,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    HAS_CENTER: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr,
    HAS_ACT: tl.constexpr, ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ALIGN: tl.constexpr, WIDE: tl.constexpr, ROW_LOOP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # x: channels contiguous (stride 1); out: any strides. WIDE: some offset (or the
    # positions' count) is past int32, so the index math runs in int64.
    if WIDE:
        p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    else:
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_in = p < positions
    c_in = c < channels
    ow = p % out_width
    oh = (p // out_width) % out_height
    n = p // (out_width * out_height)
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    # (``depthwise_conv._row_loop``: a wide window's rows in a loop, its columns unrolled)
    if ROW_LOOP:
        for kh in range(KH):
            acc = _window_row(acc, x, weight, c, c_in, p_in, n, oh, ow, kh, height, width,
                              sx_n, sx_h, sx_w, sw_c, sw_h, sw_w, pad_h, pad_w, dilation_h,
                              dilation_w, KW, STRIDE_H, STRIDE_W, ALIGN)  # fmt: skip
    else:
        for kh in tl.static_range(KH):
            acc = _window_row(acc, x, weight, c, c_in, p_in, n, oh, ow, kh, height, width,
                              sx_n, sx_h, sx_w, sw_c, sw_h, sw_w, pad_h, pad_w, dilation_h,
                              dilation_w, KW, STRIDE_H, STRIDE_W, ALIGN)  # fmt: skip
    if HAS_CENTER:
        acc = acc - tl.load(center + c, mask=c_in, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        acc = acc * tl.load(scale + c, mask=c_in, other=0.0).to(tl.float32)[None, :]
    if HAS_SHIFT:
        acc = acc + tl.load(shift + c, mask=c_in, other=0.0).to(tl.float32)[None, :]
    if HAS_ACT:
        acc = ACT(acc)
    value = acc.to(out.dtype.element_ty)
    mask = p_in[:, None] & c_in[None, :]
    if HAS_RESIDUAL:  # eager's add: of the rounded value, rounded again
        at = (n * sr_n + oh * sr_h + ow * sr_w)[:, None] + c[None, :] * sr_c
        added = tl.load(residual + at, mask=mask, other=0.0).to(tl.float32)
        value = (value.to(tl.float32) + added).to(out.dtype.element_ty)
    target = n * so_n + oh * so_h + ow * so_w
    tl.store(out + target[:, None] + c[None, :] * so_c, value, mask=mask)
