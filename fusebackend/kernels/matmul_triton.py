"""The Triton kernel of ``kernels/matmul.py`` (``matmul_group``): its math is described
there. Imported at the first launch: this module imports Triton at its top, which importing
``fusebackend.kernels`` must not.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["matmul_group_kernel", "matmul_group_kernel_checked"]


@triton.jit
def _row_stats(
    x, x_row, x_col, rows, M, K: tl.constexpr, eps, NORM: tl.constexpr, BLOCK_K: tl.constexpr
):
    """(mean, 1/std) of each row for the prologue: RMS (mean 0) or LayerNorm's."""
    total = tl.zeros([rows.shape[0]], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        keep = (rows[:, None] < M) & (ks[None, :] < K)
        a = tl.load(x + rows[:, None] * x_row + ks[None, :] * x_col, mask=keep, other=0.0)
        a = a.to(tl.float32)
        if NORM != 2:  # RMS: the mean square
            total += tl.sum(a * a, axis=1)
        else:
            total += tl.sum(a, axis=1)
    # zeros made anew, not ``total * 0.0``: a value derived from the first loop's result
    # stopped Triton 3.6's sm_90 pipeline (TritonGPUOptimizeThreadLocality asserts that a
    # loop result has one use) for fp32 LayerNorm groups (benchmarks/diag/compile_sm90.py)
    mean = tl.zeros([rows.shape[0]], tl.float32)
    if NORM != 2:
        rstd = tl.rsqrt(total / K + eps)
    else:
        mean = total / K
        squares = tl.zeros([rows.shape[0]], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            keep = (rows[:, None] < M) & (ks[None, :] < K)
            a = tl.load(x + rows[:, None] * x_row + ks[None, :] * x_col, mask=keep,
                        other=0.0)  # fmt: skip
            d = tl.where(keep, a.to(tl.float32) - mean[:, None], 0.0)
            squares += tl.sum(d * d, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
    return mean, rstd


@triton.jit
def _input_block(x, x_row, x_col, norm_w, norm_b, mean, rstd, rows, ks, M, K: tl.constexpr,
                 NORM: tl.constexpr, NORM_BIAS: tl.constexpr):  # fmt: skip
    """Rows ``rows`` x columns ``ks`` of the matmul's input: x after the prologue."""
    keep = (rows[:, None] < M) & (ks[None, :] < K)
    a = tl.load(x + rows[:, None] * x_row + ks[None, :] * x_col, mask=keep, other=0.0)
    if NORM == 1:  # transformers' RMSNorm: weight * (x.float() * rstd).to(dtype)
        g = tl.load(norm_w + ks, mask=ks < K, other=0.0).to(tl.float32)
        h = (a.to(tl.float32) * rstd[:, None]).to(a.dtype)
        a = (h.to(tl.float32) * g[None, :]).to(a.dtype)
    if NORM == 3:  # Gemma's RMSNorm: (x.float() * rstd * (1 + weight.float())).to(dtype)
        g = tl.load(norm_w + ks, mask=ks < K, other=0.0).to(tl.float32)
        a = (a.to(tl.float32) * rstd[:, None] * (1.0 + g[None, :])).to(a.dtype)
    if NORM == 2:  # F.layer_norm: one rounding at the end
        g = tl.load(norm_w + ks, mask=ks < K, other=0.0).to(tl.float32)
        h = (a.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :]
        if NORM_BIAS:
            h += tl.load(norm_b + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
        a = h.to(a.dtype)
    return a


@triton.jit
def _tile(x, x_row, x_col, norm_w, norm_b, eps, w, w_n, w_k, v, v_n, v_k,
          rows, cols, M, K: tl.constexpr, N, NORM: tl.constexpr, NORM_BIAS: tl.constexpr,
          TWO: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
          work, counters, SPLIT_K: tl.constexpr, K_SPAN: tl.constexpr, PDL: tl.constexpr,
          PREFETCH: tl.constexpr, W_KN: tl.constexpr):  # fmt: skip
    """The fp32 products of the rows with weight ``w``'s columns ``cols`` (and, with
    ``TWO``, with weight ``v``'s: a gated pair shares the input block), and whether this
    program goes on to the epilogue: with ``SPLIT_K`` each program sums a ``K_SPAN`` slice
    of K (its index along grid axis 1) and the last of a tile's programs to finish adds
    every slice's sums (``_sum_slices``)."""
    if SPLIT_K == 1:
        k_first = 0
    else:
        k_first = tl.program_id(1) * K_SPAN
    if PREFETCH > 0:  # weights never depend on the previous kernel: ask for them first
        _prefetch_l2(w, w_n, w_k, cols, N, K, k_first, PREFETCH)
        if TWO:
            _prefetch_l2(v, v_n, v_k, cols, N, K, k_first, PREFETCH)
    if PDL:  # every read below may depend on the previous kernel: wait for its end
        gdc_wait()
    mean = tl.zeros([rows.shape[0]], tl.float32)
    rstd = mean
    if NORM != 0:
        mean, rstd = _row_stats(x, x_row, x_col, rows, M, K, eps, NORM, BLOCK_K)
    if rows.shape[0] == 1:  # one row: a GEMV launch (LaunchConfig.gemv)
        acc, acc2 = _row_products(x, x_row, x_col, norm_w, norm_b, mean, rstd, w, w_n, w_k,
                                  v, v_n, v_k, rows, cols, M, K, N, NORM, NORM_BIAS, TWO,
                                  BLOCK_K, k_first, K_SPAN, W_KN)  # fmt: skip
    else:
        acc, acc2 = _dot_products(x, x_row, x_col, norm_w, norm_b, mean, rstd, w, w_n, w_k,
                                  v, v_n, v_k, rows, cols, M, K, N, NORM, NORM_BIAS, TWO,
                                  BLOCK_K, PRECISION, k_first, K_SPAN)  # fmt: skip
    if PDL:
        # Let the next kernel launch once every program is past its K loop: its programs
        # then prefetch their weights while this kernel's last programs finish. Called at
        # each program's start instead, the next kernel's waiting programs slowed the chain
        # of diag_matmul_pdl.py by 10% (904 against 825 us;
        # matmul_pdl_early_release_h100.json; see kernels/dependent_launch.py).
        gdc_launch_dependents()
    if SPLIT_K == 1:
        last = True
    else:
        acc, acc2, last = _sum_slices(acc, acc2, TWO, work, counters, SPLIT_K)
    return acc, acc2, last


@triton.jit
def _dot_products(x, x_row, x_col, norm_w, norm_b, mean, rstd, w, w_n, w_k, v, v_n, v_k,
                  rows, cols, M, K: tl.constexpr, N, NORM: tl.constexpr,
                  NORM_BIAS: tl.constexpr, TWO: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr, k_first, K_SPAN: tl.constexpr):  # fmt: skip
    """``_tile``'s K loop on tensor cores: the fp32 [rows, columns] sums of the rows'
    products with weight ``w`` (and ``v`` with ``TWO``) over K ``k_first .. + K_SPAN``."""
    acc = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    acc2 = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    for step in range(0, K_SPAN, BLOCK_K):
        ks = k_first + step + tl.arange(0, BLOCK_K)
        a = _input_block(x, x_row, x_col, norm_w, norm_b, mean, rstd, rows, ks, M, K,
                         NORM, NORM_BIAS)  # fmt: skip
        keep = (cols[None, :] < N) & (ks[:, None] < K)
        b = tl.load(w + cols[None, :] * w_n + ks[:, None] * w_k, mask=keep, other=0.0)
        if PRECISION == "upcast":  # see matmul._precision
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if TWO:
            b2 = tl.load(v + cols[None, :] * v_n + ks[:, None] * v_k, mask=keep, other=0.0)
            if PRECISION == "upcast":
                acc2 = tl.dot(a.to(tl.float32), b2.to(tl.float32), acc2, input_precision="ieee")
            else:
                acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
    return acc, acc2


@triton.jit
def _row_products(x, x_row, x_col, norm_w, norm_b, mean, rstd, w, w_n, w_k, v, v_n, v_k,
                  rows, cols, M, K: tl.constexpr, N, NORM: tl.constexpr,
                  NORM_BIAS: tl.constexpr, TWO: tl.constexpr, BLOCK_K: tl.constexpr, k_first,
                  K_SPAN: tl.constexpr, W_KN: tl.constexpr):  # fmt: skip
    """``_tile``'s K loop for one row without tensor cores: each K step's weight tile is read
    as stored (``_weight_tile``) straight into registers, multiplied by the row in fp32, and
    summed along K once at the end; returns the [1, columns] sums (and the second weight's
    with ``TWO``). A ``tl.dot`` pads the row to 16 and stages the tile through shared memory;
    here a tile can be 2 columns wide, so even a 2048-column output has 1024 programs. H100,
    one fp16 row, launch_config's GEMV tile against the tl.dot launch (both launched as
    programmatic dependents; matmul_kernels_h100_gemv.json and matmul_gemv_h100.json):
    TinyLlama's down projection 10.0 against 11.0 us, gate/up 18.4 against 19.2, o 4.8
    against 5.8 (the timings of matmul.launch_config's docstring).

    With ``W_KN`` (weights stored [K, N], N contiguous: GPT-2's Conv1D, ``x @ W``) the tiles
    are [K step, columns] and the row a [K step, 1] column, so a warp's loads run along N;
    launch_config gives them 32 columns (64 bytes of fp16 per K row: two whole 32-byte
    sectors) instead of 2, which along N would use 4 bytes of each sector read."""
    if W_KN:
        acc = tl.zeros([BLOCK_K, cols.shape[0]], tl.float32)
    else:
        acc = tl.zeros([cols.shape[0], BLOCK_K], tl.float32)
    acc2 = tl.zeros(acc.shape, tl.float32)
    for step in range(0, K_SPAN, BLOCK_K):
        ks = k_first + step + tl.arange(0, BLOCK_K)
        a = _input_block(x, x_row, x_col, norm_w, norm_b, mean, rstd, rows, ks, M, K,
                         NORM, NORM_BIAS).to(tl.float32)  # fmt: skip
        if W_KN:
            a = tl.trans(a)  # [1, K step] -> [K step, 1]
        acc += _weight_tile(w, w_n, w_k, cols, ks, N, K, W_KN) * a
        if TWO:
            acc2 += _weight_tile(v, v_n, v_k, cols, ks, N, K, W_KN) * a
    # One return after a static if/else: Triton 3.6 type-checks a return after a static if
    # that returned too, and the two orientations' sums differ ([1, 32] against [1, 128]:
    # CompilationError "Inconsistent return types" on an H200; the interpreter never checks)
    if W_KN:
        sums, sums2 = tl.sum(acc, axis=0), tl.sum(acc2, axis=0)
    else:
        sums, sums2 = tl.sum(acc, axis=1), tl.sum(acc2, axis=1)
    return sums[None, :], sums2[None, :]


@triton.jit
def _weight_tile(w, w_n, w_k, cols, ks, N, K: tl.constexpr, W_KN: tl.constexpr):
    """Weight ``w``'s columns ``cols`` x K step ``ks`` (strides ``w_n``, ``w_k``) in fp32,
    zero outside [N, K], in the orientation of its storage: [K step, columns] with ``W_KN``
    (N contiguous), else [columns, K step] (K contiguous), so consecutive threads read
    consecutive addresses either way. Read after the wait on the previous kernel: a one-step
    tile along N read before it made GPT-2's one-token forward slower (its replay's kernels
    spanned 433-487 us against 381-415; H200, 2026-12-01, 8dd2a69, diag_suite_call.py)."""
    if W_KN:
        keep = (ks[:, None] < K) & (cols[None, :] < N)
        b = tl.load(w + ks[:, None] * w_k + cols[None, :] * w_n, mask=keep, other=0.0)
    else:
        keep = (cols[:, None] < N) & (ks[None, :] < K)
        b = tl.load(w + cols[:, None] * w_n + ks[None, :] * w_k, mask=keep, other=0.0)
    return b.to(tl.float32)


@triton.jit
def _prefetch_l2(w, w_n, w_k, cols, N, K: tl.constexpr, k_first, PREFETCH: tl.constexpr):
    """Ask L2 for the first ``PREFETCH`` elements along K of weight ``w``'s columns ``cols``
    from ``k_first`` (one request per 128-byte line; nothing comes back to registers, and L2
    is coherent, so it may run before the previous kernel ends). Rows along K only: a
    weight stored [K, N] (GPT-2's Conv1D) is not prefetched. Asking for a [K, N] GEMV tile's
    first 64, 256 or 1024 K rows instead moved 12 GPT-2 layers of one-row launches in one
    CUDA graph from 210-224 us to 213-231 (H200, 2026-12-01, two rounds; not kept)."""
    if w_k == 1:
        LINE: tl.constexpr = 1024 // w.dtype.element_ty.primitive_bitwidth
        LINES: tl.constexpr = PREFETCH // LINE  # tl.arange: a power of two of them
        tl.static_assert(LINES * LINE == PREFETCH, "PREFETCH_K: whole 128-byte lines")
        ks = k_first + tl.arange(0, LINES) * LINE
        keep = (cols[:, None] < N) & (ks[None, :] < K)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; "
            "mov.u32 $0, 0; }",
            "=r,l,r",
            [w + cols[:, None] * w_n + ks[None, :], keep.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _sum_slices(acc, acc2, TWO: tl.constexpr, work, counters, SPLIT_K: tl.constexpr):
    """Split-K: store this program's sums of its K slice (``work``: fp32 [tiles, SPLIT_K,
    BLOCK_M, BLOCK_N], and after it a second such block for the second sums of a pair's
    programs); the program that counts the last arrival of its tile (a zeroed int32 counter
    per tile) adds the slices in slice order (the same bits on every run), zeroes the counter
    for the next launch and returns (sums, sums2, True); the others return (.., False) and
    store nothing more."""
    tile = tl.program_id(0)
    size: tl.constexpr = acc.shape[0] * acc.shape[1]
    at = tl.arange(0, acc.shape[0])[:, None] * acc.shape[1] + tl.arange(0, acc.shape[1])[None, :]
    second = tl.num_programs(0) * SPLIT_K * size  # where the second sums begin
    mine = work + (tile * SPLIT_K + tl.program_id(1)) * size
    tl.store(mine + at, acc)
    if TWO:
        tl.store(mine + second + at, acc2)
    # Every thread's stores above come before the one atomic (one thread issues it, acq_rel
    # at GPU scope); the last program reads the slices from L2 (".cg"): L1 is not kept
    # coherent across SMs, and the workspace reuses addresses of earlier launches.
    tl.debug_barrier()
    last = tl.atomic_add(counters + tile, 1) == SPLIT_K - 1
    if last:
        acc = tl.zeros(acc.shape, tl.float32)
        acc2 = tl.zeros(acc.shape, tl.float32)
        for part in tl.static_range(SPLIT_K):
            theirs = work + (tile * SPLIT_K + part) * size
            acc += tl.load(theirs + at, cache_modifier=".cg")
            if TWO:
                acc2 += tl.load(theirs + second + at, cache_modifier=".cg")
        tl.atomic_xchg(counters + tile, 0)
    return acc, acc2, last


@triton.jit
def _add_bias(acc, bias, cols, N):
    """The fp32 products plus the bias of their columns (added before the output's one
    rounding, as cuBLAS adds it in its epilogue)."""
    return acc + tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _store(y, out, res, res_row, res_col, rows, cols, M, N, HAS_RESIDUAL: tl.constexpr,
           HAS_TAIL: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
    """Store a tile of the output ``[M, N]`` (contiguous), with the residual added in fp32
    and rounded once when there is one, then the residual sum's tail ``TAIL`` (a
    kernels/epilogue.py function) where ``HAS_TAIL``."""
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_RESIDUAL:
        r = tl.load(res + rows[:, None] * res_row + cols[None, :] * res_col, mask=keep,
                    other=0.0)  # fmt: skip
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y.dtype)
    if HAS_TAIL:
        y = TAIL(y.to(tl.float32)).to(y.dtype)
    tl.store(out + rows[:, None] * N + cols[None, :], y, mask=keep)


@triton.jit
def _linear_tile(x, x_row, x_col, norm_w, norm_b, eps, w, w_n, w_k, bias, out, res,
                 res_row, res_col,
                 tile, M, K: tl.constexpr, N, NORM: tl.constexpr, NORM_BIAS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ACT: tl.constexpr,
                 ACT: tl.constexpr, HAS_TAIL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, work, counters, SPLIT_K: tl.constexpr,
                 K_SPAN: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr, W_KN: tl.constexpr):  # fmt: skip
    """One tile of one sibling's output: products, bias, cast, activation, residual, the
    residual sum's tail (``ACT`` again: a group has one or the other), store."""
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc, _, last = _tile(x, x_row, x_col, norm_w, norm_b, eps, w, w_n, w_k, w, w_n,
                         w_k, rows, cols, M, K, N, NORM, NORM_BIAS, False, BLOCK_K, PRECISION,
                         work, counters, SPLIT_K, K_SPAN, PDL, PREFETCH, W_KN)  # fmt: skip
    if last:
        if HAS_BIAS:
            acc = _add_bias(acc, bias, cols, N)
        y = acc.to(out.dtype.element_ty)
        if HAS_ACT:
            y = ACT(y.to(tl.float32)).to(out.dtype.element_ty)
        _store(y, out, res, res_row, res_col, rows, cols, M, N, HAS_RESIDUAL, HAS_TAIL, ACT)


@triton.jit
def _store_heads(y, dst, d_b, d_h, d_t, d_d, index, index_stride, slots, rows, cols, M, N,
                 SEQ, HEAD_DIM: tl.constexpr, TO_CACHE: tl.constexpr):  # fmt: skip
    """Store a tile of rows ``b * SEQ + t`` x columns ``h * HEAD_DIM + j`` at ``dst[b, h, t,
    j]`` (strides ``d_*``), or with ``TO_CACHE`` at ``dst[b, h, index[t], j]``: a KV cache
    written as ``index_copy_(2, index, new)`` does, never outside its ``slots``."""
    batch = (rows // SEQ).to(tl.int64)  # caches may pass 2**31 elements
    t = rows % SEQ
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    if TO_CACHE:
        slot = tl.load(index + t * index_stride, mask=rows < M, other=0).to(tl.int64)
        inside = (slot >= 0) & (slot < slots)
        tl.device_assert(inside | (rows >= M), "index_copy_: cache index out of range")
        keep = keep & inside[:, None]
    else:
        slot = t.to(tl.int64)
    head, j = (cols // HEAD_DIM).to(tl.int64), cols % HEAD_DIM  # heads x slots x D: > 2**31
    at = batch[:, None] * d_b + slot[:, None] * d_t + head[None, :] * d_h + j[None, :] * d_d
    tl.store(dst + at, y, mask=keep)


@triton.jit
def _rotary_tile(x, x_row, x_col, norm_w, norm_b, eps, w, w_n, w_k, bias,
                 cos, cos_b, cos_t, cos_d, sin, sin_b, sin_t, sin_d,
                 head_w, head_eps, HEAD_NORM: tl.constexpr,
                 dst, d_b, d_h, d_t, d_d, index, index_stride, slots,
                 tile, M, K: tl.constexpr, N, SEQ, NORM: tl.constexpr, NORM_BIAS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, TO_CACHE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, work, counters, SPLIT_K: tl.constexpr,
                 K_SPAN: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr):  # fmt: skip
    """One tile of q or k with its rotary embedding: ``BLOCK_N`` columns ``j`` of the first
    halves of heads and their partners ``j + HEAD_DIM / 2``, which rotate_half pairs
    (``out_j = y_j cos_j - y_p sin_j``, ``out_p = y_p cos_p + y_j sin_p``), each product
    and the sum rounded to the dtype as eager rounds them. With ``HEAD_NORM`` (an index of
    ``kernels.ir.NORMS``) each head is first RMS-normalised with weight ``head_w``: 1,
    transformers' RMSNorm ``w * (y.float() * rstd).to(dtype)`` (Qwen3's q_norm, k_norm); 3,
    Gemma3's ``(y.float() * rstd * (1 + w.float())).to(dtype)``. A program then holds one
    whole head (``BLOCK_N`` is ``HEAD_DIM / 2``), so its sum of squares is the head's."""
    HALF: tl.constexpr = HEAD_DIM // 2
    rows = tl.arange(0, BLOCK_M)
    halves = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # among the first-half columns
    cols = (halves // HALF) * HEAD_DIM + halves % HALF
    lo, hi, last = _tile(x, x_row, x_col, norm_w, norm_b, eps, w, w_n, w_k,
                         w + HALF * w_n, w_n, w_k, rows, cols, M, K, N, NORM, NORM_BIAS, True,
                         BLOCK_K, PRECISION, work, counters, SPLIT_K, K_SPAN, PDL,
                         PREFETCH, False)  # fmt: skip
    if last:
        if HAS_BIAS:
            lo = _add_bias(lo, bias, cols, N)
            hi = _add_bias(hi, bias + HALF, cols, N)
        dtype = dst.dtype.element_ty
        lo = lo.to(dtype).to(tl.float32)
        hi = hi.to(dtype).to(tl.float32)
        keep = (rows[:, None] < M) & (cols[None, :] < N)
        batch, t, j = rows // SEQ, rows % SEQ, cols % HEAD_DIM
        if HEAD_NORM != 0:
            squares = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)
            scale = tl.rsqrt(squares / HEAD_DIM + head_eps)[:, None]
            g_lo = tl.load(head_w + j, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            g_hi = tl.load(head_w + j + HALF, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            if HEAD_NORM == 1:
                lo = (g_lo * (lo * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                hi = (g_hi * (hi * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            else:
                lo = (lo * scale * (1.0 + g_lo)).to(dtype).to(tl.float32)
                hi = (hi * scale * (1.0 + g_hi)).to(dtype).to(tl.float32)
        c_at = batch[:, None] * cos_b + t[:, None] * cos_t + j[None, :] * cos_d
        s_at = batch[:, None] * sin_b + t[:, None] * sin_t + j[None, :] * sin_d
        c_lo = tl.load(cos + c_at, mask=keep, other=0.0).to(tl.float32)
        c_hi = tl.load(cos + c_at + HALF * cos_d, mask=keep, other=0.0).to(tl.float32)
        s_lo = tl.load(sin + s_at, mask=keep, other=0.0).to(tl.float32)
        s_hi = tl.load(sin + s_at + HALF * sin_d, mask=keep, other=0.0).to(tl.float32)
        out_lo = (lo * c_lo).to(dtype).to(tl.float32) - (hi * s_lo).to(dtype).to(tl.float32)
        out_hi = (hi * c_hi).to(dtype).to(tl.float32) + (lo * s_hi).to(dtype).to(tl.float32)
        _store_heads(out_lo.to(dtype), dst, d_b, d_h, d_t, d_d, index, index_stride, slots, rows,
                     cols, M, N, SEQ, HEAD_DIM, TO_CACHE)  # fmt: skip
        _store_heads(out_hi.to(dtype), dst, d_b, d_h, d_t, d_d, index, index_stride, slots, rows,
                     cols + HALF, M, N, SEQ, HEAD_DIM, TO_CACHE)  # fmt: skip


@triton.jit
def _value_tile(x, x_row, x_col, norm_w, norm_b, eps, w, w_n, w_k, bias,
                dst, d_b, d_h, d_t, d_d, index, index_stride, slots,
                tile, M, K: tl.constexpr, N, SEQ, NORM: tl.constexpr, NORM_BIAS: tl.constexpr,
                HAS_BIAS: tl.constexpr, TO_CACHE: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr, work, counters, SPLIT_K: tl.constexpr,
                K_SPAN: tl.constexpr, PDL: tl.constexpr,
                PREFETCH: tl.constexpr):  # fmt: skip
    """One tile of v beside a rotary q and k: products, bias, cast, stored by heads."""
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc, _, last = _tile(x, x_row, x_col, norm_w, norm_b, eps, w, w_n, w_k, w, w_n,
                         w_k, rows, cols, M, K, N, NORM, NORM_BIAS, False, BLOCK_K, PRECISION,
                         work, counters, SPLIT_K, K_SPAN, PDL, PREFETCH, False)  # fmt: skip
    if last:
        if HAS_BIAS:
            acc = _add_bias(acc, bias, cols, N)
        _store_heads(acc.to(dst.dtype.element_ty), dst, d_b, d_h, d_t, d_d, index,
                     index_stride, slots, rows, cols, M, N, SEQ, HEAD_DIM, TO_CACHE)  # fmt: skip


def _matmul_group(
    x, x_row, x_col,            # the rows [M, K] and their strides
    norm_w, norm_b, eps,        # the prologue's weight, bias and epsilon
    w0, w1, w2,                 # sibling weights as [N_i, K] views (absent ones: w0)
    w0_n, w0_k, w1_n, w1_k, w2_n, w2_k,
    b0, b1, b2,                 # their biases [N_i]
    out0, out1, out2,           # outputs [M, N_i], contiguous
    res, res_row, res_col,      # the residual [M, N_0] and its strides
    M, K: tl.constexpr, N0, N1, N2, TILES0, TILES1,  # sizes; column tiles of siblings 0 and 1
    # With HEAD_DIM (q, k, v): cos and sin as [B, SEQ, HEAD_DIM] (rows are b * SEQ + t), and
    # with CACHE the K and V caches [B, H, slots, HEAD_DIM] written at index[t]
    cos, cos_b, cos_t, cos_d, sin, sin_b, sin_t, sin_d, SEQ,
    qn_w, kn_w, head_eps,       # with HEAD_NORM: q's and k's head norm weights [HEAD_DIM]
    k_cache, kc_b, kc_h, kc_s, kc_d, v_cache, vc_b, vc_h, vc_s, vc_d,
    index, index_stride, slots,
    # split-K: grid axis 1 is SPLIT_K slices of K_SPAN columns of K; ``work`` holds their
    # fp32 sums, ``counters`` (int32, zero) one per tile of axis 0 (see _sum_slices)
    work, counters,
    NORM: tl.constexpr, NORM_BIAS: tl.constexpr,
    GATED: tl.constexpr,        # the output is ACT(y_0) * y_1 (gate and up)
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SIBLINGS: tl.constexpr,
    HEAD_DIM: tl.constexpr, CACHE: tl.constexpr, HEAD_NORM: tl.constexpr,
    HAS_ACT: tl.constexpr,      # a single linear's output goes through ACT
    ACT: tl.constexpr,          # the gate's or that activation: a kernels/epilogue.py function
    HAS_TAIL: tl.constexpr,     # ACT runs on the residual sum instead (MatmulGroup.residual_tail)
    SPLIT_K: tl.constexpr, K_SPAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,          # launched as a programmatic dependent (kernels/dependent_launch.py)
    PREFETCH: tl.constexpr,     # weight elements per row asked of L2 first (matmul.PREFETCH_K)
    W_KN: tl.constexpr,         # weights stored [K, N], N contiguous: GEMV tiles along N
):  # fmt: skip
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    if HEAD_DIM != 0:
        # q, k, v: q's tiles, then k's (both of first-half columns, see _rotary_tile), then
        # v's. Returned outputs are [M, N_i] (strides given as [B, H, SEQ, HEAD_DIM]).
        if pid < TILES0:
            _rotary_tile(x, x_row, x_col, norm_w, norm_b, eps, w0, w0_n, w0_k, b0,
                         cos, cos_b, cos_t, cos_d, sin, sin_b, sin_t, sin_d,
                         qn_w, head_eps, HEAD_NORM,
                         out0, SEQ * N0, HEAD_DIM, N0, 1, index, index_stride, slots,
                         pid, M, K, N0, SEQ, NORM, NORM_BIAS, HAS_BIAS, False, HEAD_DIM,
                         BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, work, counters, SPLIT_K,
                         K_SPAN, PDL, PREFETCH)  # fmt: skip
        elif pid < TILES0 + TILES1:
            if CACHE:
                k_dst, k_b, k_h, k_t, k_d = k_cache, kc_b, kc_h, kc_s, kc_d
            else:
                k_dst, k_b, k_h, k_t, k_d = out1, SEQ * N1, HEAD_DIM, N1, 1
            _rotary_tile(x, x_row, x_col, norm_w, norm_b, eps, w1, w1_n, w1_k, b1,
                         cos, cos_b, cos_t, cos_d, sin, sin_b, sin_t, sin_d,
                         kn_w, head_eps, HEAD_NORM,
                         k_dst, k_b, k_h, k_t, k_d, index, index_stride, slots,
                         pid - TILES0, M, K, N1, SEQ, NORM, NORM_BIAS, HAS_BIAS, CACHE,
                         HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, work, counters,
                         SPLIT_K, K_SPAN, PDL, PREFETCH)  # fmt: skip
        else:
            if CACHE:
                v_dst, v_b, v_h, v_t, v_d = v_cache, vc_b, vc_h, vc_s, vc_d
            else:
                v_dst, v_b, v_h, v_t, v_d = out2, SEQ * N2, HEAD_DIM, N2, 1
            _value_tile(x, x_row, x_col, norm_w, norm_b, eps, w2, w2_n, w2_k, b2,
                        v_dst, v_b, v_h, v_t, v_d, index, index_stride, slots,
                        pid - TILES0 - TILES1, M, K, N2, SEQ, NORM, NORM_BIAS, HAS_BIAS,
                        CACHE, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, work,
                        counters, SPLIT_K, K_SPAN, PDL, PREFETCH)  # fmt: skip
    elif GATED:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        gate, up, last = _tile(x, x_row, x_col, norm_w, norm_b, eps, w0, w0_n, w0_k,
                               w1, w1_n, w1_k, rows, cols, M, K, N0, NORM, NORM_BIAS, True,
                               BLOCK_K, PRECISION, work, counters, SPLIT_K,
                               K_SPAN, PDL, PREFETCH, W_KN)  # fmt: skip
        if last:
            if HAS_BIAS:
                gate = _add_bias(gate, b0, cols, N0)
                up = _add_bias(up, b1, cols, N0)
            dtype = out0.dtype.element_ty
            act = ACT(gate.to(dtype).to(tl.float32)).to(dtype)
            y = (act.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
            _store(y, out0, res, res_row, res_col, rows, cols, M, N0, HAS_RESIDUAL, False, ACT)
    else:
        if pid < TILES0:
            _linear_tile(x, x_row, x_col, norm_w, norm_b, eps, w0, w0_n, w0_k, b0,
                         out0, res, res_row, res_col, pid, M, K, N0, NORM, NORM_BIAS,
                         HAS_BIAS, HAS_RESIDUAL, HAS_ACT, ACT, HAS_TAIL, BLOCK_M, BLOCK_N,
                         BLOCK_K, PRECISION, work, counters, SPLIT_K, K_SPAN, PDL, PREFETCH,
                         W_KN)  # fmt: skip
        else:
            if SIBLINGS >= 2:
                if pid < TILES0 + TILES1:
                    _linear_tile(x, x_row, x_col, norm_w, norm_b, eps, w1, w1_n,
                                 w1_k, b1, out1, res, res_row, res_col, pid - TILES0, M,
                                 K, N1, NORM, NORM_BIAS, HAS_BIAS, False, False, ACT, False,
                                 BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, work, counters, SPLIT_K,
                                 K_SPAN, PDL, PREFETCH, W_KN)  # fmt: skip
                else:
                    if SIBLINGS == 3:
                        _linear_tile(x, x_row, x_col, norm_w, norm_b, eps, w2, w2_n,
                                     w2_k, b2, out2, res, res_row, res_col,
                                     pid - TILES0 - TILES1, M, K, N2, NORM, NORM_BIAS,
                                     HAS_BIAS, False, False, ACT, False, BLOCK_M, BLOCK_N,
                                     BLOCK_K,
                                     PRECISION, work, counters, SPLIT_K, K_SPAN, PDL,
                                     PREFETCH, W_KN)  # fmt: skip


# The kernel as built for launches (``matmul_group_kernel``), and built in Triton's debug
# mode (its ``tl.device_assert`` on a KV-cache index is compiled in only then) for groups
# that write a cache with index checks on.
matmul_group_kernel = triton.jit(_matmul_group)
matmul_group_kernel_checked = triton.jit(_matmul_group, debug=True)
