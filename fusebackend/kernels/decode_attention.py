"""Attention of one query token against a KV cache, reading grouped K/V heads once.

A decode step of transformers' Llama, Qwen2 or Mistral calls SDPA with one query row per
head, after ``repeat_kv`` has copied each K/V head once per query head of its group: per
layer two copy kernels and cuDNN's attention kernel. On an H100 (2026-11-25, TinyLlama
shape, 176-slot StaticCache) these took 136 + 142 us of a 1745 us decode step
(``benchmarks/results/suite_decode_h100_no_packing.json``), and the copies grow with the
cache. ``decode_attention`` computes the same softmax(q k^T * scale + mask) v from the
unrepeated K/V, in two launches (one for a cache of at most 32 keys).

Math, per batch b and query head h of K/V head g = h // groups, keys s < S:

    score[s] = scale * <q[b, h], k[b, g, s]> (+ mask[b, h, s] when additive; -inf where a
               boolean mask is False)
    out[b, h] = sum_s exp(score[s] - m) v[b, g, s] / sum_s exp(score[s] - m),  m = max score

in fp32: fp16 and bf16 values are exact in tf32, so ``tl.dot``'s tf32 products of them are
exact, as in cuDNN's and flash attention's kernels; the weights are rounded to tf32 (fp16's
10-bit mantissa) before the second product, where those kernels round them to fp16; fp32
inputs take exact fp32 products. A row whose mask allows no key gets 0, as SDPA's math path does
(its safe softmax).

**Layout of the work.** One program takes the ``groups`` query heads of one K/V head (a
``[BLOCK_R, BLOCK_D]`` tile, ``tl.dot`` with rows padded to 16) and a range of keys, in
blocks of ``BLOCK_S``, with an online softmax. The cache is split along the keys (about
``_SPLITS`` ways): each program writes its running max, sum and unnormalized output
(fp32), and a second kernel combines the splits. A cache of one block is one program per
(batch, K/V head) that writes the output itself.

Where Triton cannot run (a CPU without the interpreter) the launcher repeats K/V and calls
SDPA, the traced graph's own computation.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

from fusebackend.kernels.arrivals import arrival_counters
from fusebackend.kernels.configs import ceil_div
from fusebackend.kernels.dependent_launch import pdl_launch
from fusebackend.kernels.family import concrete_cuda_tensor, family, launch_key
from fusebackend.kernels.launch import triton_usable, warmup_pointer, warmup_pointer_of

__all__ = ["decode_attention", "precompile_decode_attention"]

# Launch parameters, from benchmarks/diag/diag_decode_attention.py (H100, 2026-11-25, fp16,
# batch 1, 22 calls in a CUDA graph; results/decode_attention_sweep_h100.json). A program's
# blocks of keys run one after another at ~0.8 us each, so the cache is split about 16 ways
# with one block per program, keys per block between 32 and 128: TinyLlama's shape took
# 4.1-4.2 us at 128-176 slots and 6.4 us at 4096 (one program per K/V head: 5.2 and 61 us),
# against 9.5, 11.2 and 50.6 us for repeat_kv + SDPA.
_SPLITS = 16
_MIN_BLOCK_S, _MAX_BLOCK_S = 32, 128
# More programs than this (large batches, many K/V heads) take several blocks each.
_MAX_PROGRAMS = 1024

# Fold the combine into the attention launch: the program of a (batch, K/V head) that
# finishes its split last (a per-program counter, acq_rel atomics) merges every split of its
# rows and resets the counter, so a split cache costs one launch, not two (22 of a
# TinyLlama step's launches, 31 us of kernels beside their gaps: profile of 2026-11-26).
# Off: measured slower on an H100 (benchmarks/diag/diag_decode_attention.py, each variant
# in a CUDA graph; decode_attention_fold_h100.json): a TinyLlama-shape step's attention over
# 176 slots 4.21 against 3.51 us for the two launches, Llama-3-8B's over 4096 slots 18.7
# against 10.0 us, as the last program merges the splits alone. Run by the GPU tests there:
# the interpreter runs programs one after another, so it checks the merge and the reset but
# not the ordering between concurrent programs. Read at each call. The counters:
# kernels/arrivals.py.
FOLD_COMBINE = False


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    groups: int,
    out_stride: tuple[int, ...],
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, repeat(key), repeat(value), mask, scale=scale)``
    for one query row per head, where ``repeat`` gives each of ``key``'s heads to ``groups``
    query heads in a row (transformers' ``repeat_kv``). The result has ``out_stride``
    (the layout SDPA's result had in the traced graph)."""
    batch, heads, _, width = query.shape
    out = torch.empty_strided((batch, heads, 1, width), out_stride, dtype=query.dtype,
                              device=query.device)  # fmt: skip
    if not triton_usable(query.device) or out.numel() == 0 or key.shape[2] == 0:
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        out.copy_(F.scaled_dot_product_attention(query, key, value, mask, scale=scale))
        return out
    plan = _Plan(query, key, value, mask, scale, groups, out)
    scratch = []
    if plan.splits > 1:
        rows = batch * heads
        scratch = [
            torch.empty((rows, plan.splits, plan.block_d), dtype=torch.float32, device=out.device),
            torch.empty((rows, plan.splits), dtype=torch.float32, device=out.device),
            torch.empty((rows, plan.splits), dtype=torch.float32, device=out.device),
        ]
    mask_arg = mask if mask is not None else query  # never read: HAS_MASK is off
    parts = scratch or [out, out, out]  # never written: SPLIT is off
    counters = arrival_counters(out.device, plan.grid[0]) if plan.fold else out  # FOLD off
    _attend_kernel()[plan.grid](query, key, value, mask_arg, out, *parts, counters,
                                *plan.args, **plan.meta)  # fmt: skip
    if plan.splits > 1 and not plan.fold:
        _combine_kernel()[(batch * heads,)](*scratch, out, *plan.combine_args,
                                            **plan.combine_meta)  # fmt: skip
    return out


def precompile_decode_attention(query, key, value, mask, scale, groups, out_stride) -> None:
    """Compile the kernels ``decode_attention`` would launch on tensors like these (fake
    ones suffice), without running them, beside the row kernels (``launch.precompile_all``)."""
    batch, heads, _, width = query.shape
    if key.shape[2] == 0 or batch * heads * width == 0:
        return
    out = torch.empty_strided((batch, heads, 1, width), out_stride, dtype=query.dtype,
                              device="meta")  # fmt: skip
    plan = _Plan(query, key, value, mask, scale, groups, out)

    scratch = [warmup_pointer(torch.float32, 0)] * 3  # fresh allocations: aligned
    q, k, v, o = (warmup_pointer_of(t) for t in (query, key, value, out))
    mask_arg = warmup_pointer_of(mask) if mask is not None else q
    parts = scratch if plan.splits > 1 else [o] * 3
    counters = warmup_pointer(torch.int32, 0) if plan.fold else o
    device = query.device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _attend_kernel().warmup(q, k, v, mask_arg, o, *parts, counters, *plan.args,
                                grid=plan.grid, **plan.meta)  # fmt: skip
        if plan.splits > 1 and not plan.fold:
            _combine_kernel().warmup(*scratch, o, *plan.combine_args, grid=(batch * heads,),
                                     **plan.combine_meta)  # fmt: skip


def _precompile_job(args: Any) -> Any:
    """The kernel family's precompile job (kernels/family.py) for a launch on ``args``:
    (query, key, value, mask or None, scale, groups, out_stride), tensors as example values."""
    query, key_states, value, mask, *rest = args
    values = [query, key_states, value, mask]
    if not all(concrete_cuda_tensor(v) for v in values if v is not None):
        return None
    key = ("attention", *rest, *map(launch_key, values))
    return key, functools.partial(precompile_decode_attention, *values, *rest)


# Its compile against a row kernel's (kernels/family.py): 0.2-0.5 s for sm_90 on the CPU
# machine (benchmarks/diag/compile_sm90.py, Triton's cache empty, 2026-12-01), a kernel as
# small as a row kernel (the paired cache write) 0.1 s.
family("decode_attention", _precompile_job, lambda args: 3.0)(decode_attention)


class _Plan:
    """Arguments, grid and meta-parameters of the two launches on given tensors."""

    def __init__(self, query, key, value, mask, scale, groups, out) -> None:
        batch, heads, _, width = query.shape
        kv_heads, seq_len = key.shape[1], key.shape[2]
        wanted = ceil_div(seq_len, _SPLITS)
        self.block_s = min(_MAX_BLOCK_S, max(_MIN_BLOCK_S, 1 << (wanted - 1).bit_length()))
        blocks = ceil_div(seq_len, self.block_s)
        blocks_per_split = max(1, ceil_div(blocks * batch * kv_heads, _MAX_PROGRAMS))
        self.splits = ceil_div(blocks, blocks_per_split)  # 1: the program writes the output
        self.fold = FOLD_COMBINE and self.splits > 1
        pdl = pdl_launch(query.device)
        self.block_d = max(16, 1 << (width - 1).bit_length())
        if mask is not None:  # strides of the mask as seen from [batch, heads, keys]
            m_b, m_h, _, m_s = mask.expand(batch, heads, 1, seq_len).stride()
        else:
            m_b = m_h = m_s = 0
        self.grid = (batch * kv_heads, self.splits)
        self.args = [
            kv_heads, groups, seq_len, width,
            float(scale) if scale is not None else 1.0 / math.sqrt(width),
            query.stride(0), query.stride(1), query.stride(3),
            key.stride(0), key.stride(1), key.stride(2), key.stride(3),
            value.stride(0), value.stride(1), value.stride(2), value.stride(3),
            m_b, m_h, m_s, out.stride(0), out.stride(1), out.stride(3),
        ]  # fmt: skip
        self.meta = {
            "HAS_MASK": mask is not None,
            "BOOL_MASK": mask is not None and mask.dtype == torch.bool,
            "SPLIT": self.splits > 1,
            "IEEE": query.dtype == torch.float32,
            "BLOCK_R": max(16, 1 << (groups - 1).bit_length()),
            "BLOCK_S": self.block_s,
            "BLOCK_D": self.block_d,
            "BLOCKS": blocks_per_split,
            "FOLD": self.fold,
            "BLOCK_SPLITS": max(2, 1 << (self.splits - 1).bit_length()),
            "PDL": pdl,
            "num_warps": 4,
        }
        self.combine_args = [heads, self.splits, width, out.stride(0), out.stride(1),
                             out.stride(3)]  # fmt: skip
        self.combine_meta = {
            "BLOCK_SPLITS": max(2, 1 << (self.splits - 1).bit_length()),
            "BLOCK_D": self.block_d,
            "PDL": pdl,
            "num_warps": 4,
        }
        if pdl:  # see kernels/dependent_launch.py
            self.meta["launch_pdl"] = self.combine_meta["launch_pdl"] = True


@functools.cache
def _attend_kernel() -> Any:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _decode_attention(
        q, k, v, mask, out,  # tensors; mask unread without HAS_MASK, out unwritten with SPLIT
        part_acc, part_max, part_sum,  # fp32 [batch*heads, splits(, BLOCK_D)] with SPLIT
        counters,  # int32 [programs along axis 0], zero, with FOLD
        kv_heads, groups, seq_len, width, scale,
        q_b, q_h, q_d, k_b, k_h, k_s, k_d, v_b, v_h, v_s, v_d, m_b, m_h, m_s, o_b, o_h, o_d,
        HAS_MASK: tl.constexpr, BOOL_MASK: tl.constexpr, SPLIT: tl.constexpr,
        IEEE: tl.constexpr,  # fp32 inputs: exact fp32 products (tl.dot would use tf32)
        BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCKS: tl.constexpr,  # blocks of keys per program
        FOLD: tl.constexpr,  # the last split's program merges the splits (FOLD_COMBINE)
        BLOCK_SPLITS: tl.constexpr,
        PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/dependent_launch.py)
    ):  # fmt: skip
        if PDL:  # q, k and v come from the launch before: wait for its end
            gdc_wait()
        program = tl.program_id(0)
        split = tl.program_id(1)
        batch = (program // kv_heads).to(tl.int64)  # caches may pass 2**31 elements
        group = program % kv_heads
        rows = tl.arange(0, BLOCK_R)
        head = group * groups + rows  # the query heads of this K/V head
        row_ok = rows < groups
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < width
        query = tl.load(
            q + batch * q_b + head[:, None] * q_h + cols[None, :] * q_d,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        k_base = k + batch * k_b + group * k_h
        v_base = v + batch * v_b + group * v_h
        best = tl.full([BLOCK_R], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        start = split * (BLOCKS * BLOCK_S)
        # A constexpr trip count: Triton's interpreter (numpy 2) cannot loop to a runtime
        # bound. The last split may run past the keys.
        for block in range(0, BLOCKS):
            keys = start + block * BLOCK_S + tl.arange(0, BLOCK_S)
            key_ok = keys < seq_len
            k_t = tl.load(
                k_base + keys[None, :] * k_s + cols[:, None] * k_d,
                mask=col_ok[:, None] & key_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            if IEEE:
                score = tl.dot(query, k_t, input_precision="ieee")
            else:  # fp16 and bf16 values are exact in tf32: exact products
                score = tl.dot(query, k_t, input_precision="tf32")
            score = score * scale
            if HAS_MASK:
                allowed = tl.load(
                    mask + batch * m_b + head[:, None] * m_h + keys[None, :] * m_s,
                    mask=row_ok[:, None] & key_ok[None, :],
                    other=0,
                )
                if BOOL_MASK:
                    score = tl.where(allowed != 0, score, float("-inf"))
                else:
                    score = score + allowed.to(tl.float32)
            score = tl.where(key_ok[None, :], score, float("-inf"))
            new_best = tl.maximum(best, tl.max(score, axis=1))
            # A row that has allowed no key yet keeps max -inf: subtract 0 instead, so that
            # its weights are exp(-inf) = 0, not exp(-inf - -inf) = NaN.
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)
            weight = tl.exp(score - shift[:, None])
            rescale = tl.exp(best - shift)
            total = total * rescale + tl.sum(weight, axis=1)
            values = tl.load(
                v_base + keys[:, None] * v_s + cols[None, :] * v_d,
                mask=key_ok[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(weight, values, input_precision="ieee")
            else:  # the weights rounded to tf32's 10-bit mantissa, as fp16's
                acc = acc * rescale[:, None] + tl.dot(weight, values, input_precision="tf32")
            best = new_best
        if PDL:  # the next launch (the combine, or the o projection) may begin
            gdc_launch_dependents()
        row = batch * kv_heads * groups + head  # index of (batch, head) among all rows
        if SPLIT:
            splits = tl.num_programs(1)
            tl.store(part_max + row * splits + split, best, mask=row_ok)
            tl.store(part_sum + row * splits + split, total, mask=row_ok)
            tl.store(
                part_acc + (row[:, None] * splits + split) * BLOCK_D + cols[None, :],
                acc,
                mask=row_ok[:, None],
            )
            if FOLD:
                # Every thread's stores above come before the one atomic (issued by one
                # thread, acq_rel at GPU scope): the program that counts the last arrival
                # sees every split's partials. It reads them from L2 (".cg"): L1 is not
                # kept coherent across SMs, and the scratch reuses addresses of earlier
                # launches.
                tl.debug_barrier()
                arrived = tl.atomic_add(counters + program, 1)
                if arrived == splits - 1:
                    parts = tl.arange(0, BLOCK_SPLITS)
                    at = row[:, None] * splits + parts[None, :]
                    keep = row_ok[:, None] & (parts[None, :] < splits)
                    bests = tl.load(part_max + at, mask=keep, other=float("-inf"),
                                    cache_modifier=".cg")  # fmt: skip
                    sums = tl.load(part_sum + at, mask=keep, other=0.0, cache_modifier=".cg")
                    top = tl.max(bests, axis=1)
                    shift = tl.where(top == float("-inf"), 0.0, top)
                    weight = tl.exp(bests - shift[:, None])  # 0 for a split of no key
                    total = tl.sum(sums * weight, axis=1)
                    merged = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
                    for part in range(0, BLOCK_SPLITS):
                        share = tl.sum(tl.where(parts[None, :] == part, weight, 0.0), axis=1)
                        partial = tl.load(
                            part_acc + (row[:, None] * splits + part) * BLOCK_D + cols[None, :],
                            mask=row_ok[:, None] & (part < splits),
                            other=0.0,
                            cache_modifier=".cg",
                        )
                        merged += partial * share[:, None]
                    result = merged / tl.where(total > 0, total, 1.0)[:, None]
                    tl.store(
                        out + batch * o_b + head[:, None] * o_h + cols[None, :] * o_d,
                        result.to(out.dtype.element_ty),
                        mask=row_ok[:, None] & col_ok[None, :],
                    )
                    tl.atomic_xchg(counters + program, 0)  # zero for the next launch
        else:
            # 0 for a row that allowed no key (its sum is 0; no division by it)
            result = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(
                out + batch * o_b + head[:, None] * o_h + cols[None, :] * o_d,
                result.to(out.dtype.element_ty),
                mask=row_ok[:, None] & col_ok[None, :],
            )

    return _decode_attention


@functools.cache
def _combine_kernel() -> Any:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _decode_attention_combine(
        part_acc, part_max, part_sum,  # fp32 [rows, splits, BLOCK_D], [rows, splits] x 2
        out,
        heads, splits, width, o_b, o_h, o_d,
        BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/dependent_launch.py)
    ):  # fmt: skip
        if PDL:  # wait for the splits' partials, then let the o projection begin
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        batch = row // heads
        head = row % heads
        parts = tl.arange(0, BLOCK_SPLITS)
        part_ok = parts < splits
        cols = tl.arange(0, BLOCK_D)
        best = tl.load(part_max + row * splits + parts, mask=part_ok, other=float("-inf"))
        sums = tl.load(part_sum + row * splits + parts, mask=part_ok, other=0.0)
        top = tl.max(best, axis=0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        weight = tl.exp(best - shift)  # 0 for a split that allowed no key
        total = tl.sum(sums * weight, axis=0)
        acc = tl.load(
            part_acc + (row * splits + parts[:, None]) * BLOCK_D + cols[None, :],
            mask=part_ok[:, None],
            other=0.0,
        )
        merged = tl.sum(acc * weight[:, None], axis=0)
        result = merged / tl.where(total > 0, total, 1.0)  # merged is 0 where total is
        tl.store(
            out + batch * o_b + head * o_h + cols * o_d,
            result.to(out.dtype.element_ty),
            mask=cols < width,
        )

    return _decode_attention_combine
