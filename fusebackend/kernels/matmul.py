"""Matmul groups: a linear layer of few rows, with its siblings, the norm before it and the
work after it, in one Triton launch (``matmul_group``).

A decode step multiplies one row (a few, at small batches) by every weight of the model:
each projection streams its weight once and does almost no arithmetic, so the step costs the
time its weights take to read, plus whatever the kernels around each matmul add (launches,
and re-reading the small activations). One launch here computes, for rows ``x [M, K]``:

    a    = prologue(x)                 "" (none), "rms" (transformers' RMSNorm:
                                       w * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(dt)),
                                       "layer" (F.layer_norm over K with weight and bias),
                                       "rms_offset" (Gemma's RMSNorm: (x.float() * rstd *
                                       (1 + w.float())).to(dt), rounded once)
    y_i  = a @ W_i.T (+ b_i)           W_i [N_i, K], the user's parameters read in place
                                       (1-3 siblings: q, k, v; gate and up); with
                                       ``weight_layout`` "kn" given stored [K, N_i]
                                       (GPT-2's Conv1D, ``x @ W``), read in place
    out  = y_0, y_1, ...               or, with a gate: act(y_0) * y_1 (SwiGLU, GeGLU)
    out  = act(y_0)                    with ``activation`` (one linear): silu, gelu, relu,
                                       gelu_new (NewGELU's 8 ops, each rounded)
    out  = out + residual              (one output only)
    q, k = norm(y_0), norm(y_1)        with ``head_norm``: RMSNorm of each head (Qwen3)
    q, k = rotary(q), rotary(k)        with ``rotary`` (q, k, v): per head of D columns,
                                       y * cos + rotate_half(y) * sin (transformers'
                                       apply_rotary_pos_emb), cos and sin [B, 1, T, D]
    k_cache[b, h, index[t]] = k, ...   with ``cache_write``: k and v go into the KV caches
                                       (StaticCache's index_copy_), only q is returned

rounded where eager rounds: the normalised row to the input's dtype before the weight
multiplies it (as transformers' RMSNorm does), each linear's output once after its bias, the
activation's output, the product, the residual sum. Math runs in fp32 (``tl.dot``
accumulates in fp32; fp32 inputs use IEEE products, not TF32, as eager's default).

One program computes a ``BLOCK_M x BLOCK_N`` tile of one sibling's output (``BLOCK_M`` the
rows padded to 16, the smallest ``tl.dot`` tile; 1 for a one-row GEMV launch, which
multiplies in fp32 registers instead: ``LaunchConfig.gemv``), looping over K; the grid is
the tiles of every sibling one after another. A GEMV reads its weight tiles in the order
they are stored: [columns, K step] for weights contiguous along K, [K step, columns] for
weights stored [K, N] (``matmul_triton._weight_tile``; 32 columns wide). The prologue's row
statistics (a sum over K) are computed by every program from the rows themselves, which are
a few KB read from L2 against the weight tile's tens of KB (a 2-column GEMV tile reads about
as much of the row as of its weights). Programs are many and narrow (``BLOCK_N`` 16-64 on
tensor cores, 2 for GEMV): a 2048-wide output is 32-128 programs, or 1024, so every SM
streams weights. With ``LaunchConfig.split_k`` grid axis 1 also cuts K into slices, and the
last of a tile's programs to finish adds their sums and runs the epilogue (``_sum_slices``
in matmul_triton.py; kernels/arrivals.py).

A rotary group's q and k programs each compute two tiles of one weight, columns ``j`` and
``j + D/2`` of the same heads (the pairs rotate_half mixes), so the rotation happens in
registers before the one store; v's programs are plain tiles. With ``cache_write`` k's and
v's tiles are stored at ``cache[b, h, index[t], j]``: an index outside the cache never writes,
and stops the kernel with a device-side assert when it is built with ``index_checks``
(Triton's debug mode, ``matmul_group_kernel_checked``); an index on the CPU is checked on the
host first, with eager's IndexError.

Where Triton cannot run (a CPU without the interpreter) ``matmul_group`` runs the same math
in torch (``reference``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from fusebackend.kernels.arrivals import arrival_counters
from fusebackend.kernels.cache_write import check_cache_index
from fusebackend.kernels.configs import ceil_div
from fusebackend.kernels.dependent_launch import nvidia_gpu, pdl_launch
from fusebackend.kernels.epilogue import (
    EPILOGUE_OPTIONS,
    activation_program,
    epilogue_function,
    generate_epilogue_source,
)
from fusebackend.kernels.family import concrete_cuda_tensor, launch_key
from fusebackend.kernels.ir import MAX_SIBLINGS, NORMS, MatmulGroup, RowProgram
from fusebackend.kernels.matmul_reference import Heads, reference
from fusebackend.kernels.triton_api import interpreter_enabled, triton_usable, warmup_launch

__all__ = [
    "Heads", "LaunchConfig", "MatmulGroupOp", "argument_slots", "launch_config", "matmul_group",
    "matmul_op", "precompile_matmul", "reference", "widest_k_step",
]  # fmt: skip


def matmul_group(
    group: MatmulGroup,
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    *params: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Run ``group`` on rows ``x [..., K]``; ``params``: the weights ``[N_i, K]``, then
    their biases ``[N_i]`` when ``group.bias``, then with ``group.rotary`` ``cos`` and
    ``sin`` (broadcastable to ``[B, 1, T, D]``, x being ``[B, T, K]``), then with
    ``group.cache_write`` the K and V caches ``[B, H, slots, D]`` and the int64 index of
    the ``T`` slots written. Returns the outputs ``[..., N_i]`` (with a cache write: q's)."""
    weights, biases, heads = _split_params(group, params)
    if group.rotary and x.dim() != 3:
        raise ValueError(f"matmul_group: a rotary group's rows are [B, T, K], not {tuple(x.shape)}")
    if heads is not None and heads.k_cache is not None and heads.index.device.type == "cpu":
        check_cache_index(heads.index, heads.k_cache)  # on the GPU this would be a host sync
    if not triton_usable(x.device) or x.numel() == 0:
        return reference(group, x, norm_weight, norm_bias, residual, weights, biases, heads)
    args, grid, meta, outputs = _launch(group, x, norm_weight, norm_bias, residual, weights,
                                        biases, heads)  # fmt: skip
    _kernel(group.index_checks)[grid](*args, **meta)
    return outputs


def _split_params(
    group: MatmulGroup, params: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], Heads | None]:
    """(weights as ``[N_i, K]``, biases, the rotary group's ``Heads``) of a launch's
    parameters."""
    count = group.weight_params * (2 if group.bias else 1)
    weights, biases = _weights_and_biases(group, params[:count])
    extra = params[count:]
    if not group.rotary:
        return weights, biases, None
    cos, sin, *rest = extra
    norms, caches = (rest[:2], rest[2:]) if group.head_norm else ((None, None), rest)
    return weights, biases, Heads(cos, sin, *norms, *caches)


def argument_slots(group: MatmulGroup) -> dict[str, int]:
    """Where a graph's call of ``group`` passes what it writes: the K and V caches' positions
    (after rows, norm weight, norm bias, residual, weights, biases, cos and sin, the heads'
    norm weights)."""
    if not group.cache_write:
        return {}
    first = 4 + group.weight_params * (2 if group.bias else 1) + 2 + 2 * bool(group.head_norm)
    return {"k_cache": first, "v_cache": first + 1}


def _weights_and_biases(
    group: MatmulGroup, params: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(weights as ``[N_i, K]``, biases) of a launch's parameters: Conv1D's ``[K, N]``
    weights as their transposes, a chunked pair's one weight (and bias) as its gate and up
    halves. All views: the parameters are read in place."""
    count = group.weight_params
    weights, biases = tuple(params[:count]), tuple(params[count:])
    if group.weight_layout == "kn":
        weights = tuple(w.t() for w in weights)
    if not group.chunked:
        return weights, biases
    halves = weights[0].chunk(2)
    bias_halves = biases[0].chunk(2) if biases else ()
    if group.gate_half == 1:
        halves, bias_halves = halves[::-1], bias_halves[::-1]
    return tuple(halves), tuple(bias_halves)


def precompile_matmul(group: MatmulGroup, x, norm_weight, norm_bias, residual, *params) -> None:
    """Compile the kernel a launch on tensors like these (fake tensors suffice) would run,
    without running it (``launch.precompile_all`` runs such jobs concurrently)."""
    weights, biases, heads = _split_params(group, params)
    args, grid, meta, _ = _launch(group, x, norm_weight, norm_bias, residual, weights, biases,
                                  heads, allocate=False)  # fmt: skip
    warmup_launch(_kernel(group.index_checks), grid, args, meta, x.device)


class MatmulGroupOp:
    """``matmul_group`` bound to one ``MatmulGroup``: the callable a graph node calls (FX
    writes a node's arguments as source, which a ``MatmulGroup`` value is not), and the
    kernel family the backend precompiles (kernels/family.py)."""

    def __init__(self, group: MatmulGroup) -> None:
        self.group = group
        # e.g. matmul_rms_3, matmul_rms_2_silu, matmul_1_residual (never ending in "_": FX
        # passes read a trailing underscore as an in-place op)
        parts = ["matmul", group.norm, str(group.siblings), group.gate, "residual" * group.residual]
        parts += ["rotary"] * bool(group.rotary) + ["cache"] * group.cache_write
        tailed = group.epilogue is not None or group.residual_tail is not None
        parts.append(group.activation or "tail" * tailed)
        self.__name__ = self.__qualname__ = "_".join(p for p in parts if p)
        # the caches a cache-writing group writes (passes/mutations.py reads this)
        self.writes_arguments = tuple(argument_slots(group).values())

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        return matmul_group(self.group, *args)

    def describe(self) -> str:
        return f"matmul_group({self.group.describe()})"

    def launch_path(self, args: Any) -> str | None:
        """GEMV or tensor cores for a launch on ``args`` (kernels/family.py)."""
        x, _norm_weight, _norm_bias, _residual, *params = args
        return launch_path(self.group, x, params)

    def precompile_job(self, args: Any) -> Any:
        """(key, job) compiling the launch on ``args`` (example values), or None."""
        tensors = [v for v in args if v is not None]
        if not all(concrete_cuda_tensor(v) for v in tensors):
            return None
        # the flags the launch reads at each call: a kernel built with others is another
        key = ("matmul", self.group, pdl_launch(tensors[0].device), PREFETCH_K,
               ONE_ROW_GEMV, *map(launch_key, args))  # fmt: skip
        return key, functools.partial(precompile_matmul, self.group, *args)

    def compile_weight(self, args: Any) -> float:  # (family.py; sm_90 on the CPU machine,
        return 8.0 if self.group.rotary else 2.0  # compile_sm90.py: 0.7-1.0 s with a rotary
        # epilogue, else 0.1-0.5 s; a row-sized kernel 0.1 s. H200: 0.18-0.21 s, rows 0.1 s)

    def __repr__(self) -> str:
        return f"MatmulGroupOp({self.group})"


@functools.cache
def matmul_op(group: MatmulGroup) -> MatmulGroupOp:
    """The launcher of ``group`` (one per group: equal groups share it)."""
    return MatmulGroupOp(group)


# ---- Launch parameters


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_n: int
    block_k: int
    warps: int
    stages: int
    # split-K: each output tile's K is summed by this many programs (grid axis 1), the last
    # to finish adding their sums (kernels/arrivals.py). launch_config picks 8 only for a
    # long K over few columns (Qwen2-0.5B's down projection), where the H100 sweep measured
    # it faster (benchmarks/results/matmul_sweep_h100_splitk.json); 1 elsewhere.
    split_k: int = 1
    # One row without tensor cores (matmul_triton._row_products): the rows' tile is one row
    # (BLOCK_M 1, which selects that loop), not 16. For launches of exactly one row.
    gemv: bool = False


def widest_k_step(width: int) -> int:
    """The widest K step a launch over ``width``-wide rows takes: the width rounded up to a
    power of 2, at least 16 (tl.dot's smallest K)."""
    return max(16, 1 << (width - 1).bit_length())


def launch_config(
    rows: int,
    width: int,
    outputs: int,
    gated: bool,
    rotary: bool = False,
    along_n: bool = False,
    gemv: bool = False,
) -> LaunchConfig:
    """Tile, warps, pipeline stages and K slices for ``rows`` rows of a ``width``-wide input
    and ``outputs`` output columns in all (a gated pair: its output's columns; each program
    reads a gate and an up tile; ``rotary``: a q/k/v group with its rotary embedding, gated's
    kind too, ``outputs`` counting q's and k's columns once per rotate_half pair).

    From the H100 sweep of ``benchmarks/matmul_kernels.py --sweep``
    (``benchmarks/results/matmul_sweep_h100.json``, fp16, 1 and 16 rows), against the first
    picks (16 columns, 256-wide K steps, 4 warps, 3 stages; 128-wide K steps when gated):
    TinyLlama's gate/up 19.7 against 25.9 us with 32 columns and 256-wide K steps at 2 warps
    (1 row); its down projection (K 5632) 11.6 against 14.7 us with 512-wide K steps, 2 warps
    and 4 stages (cuBLAS + the residual add: 14.3); q/k/v (2560 outputs) 8.2 against 10.9 us
    with 32 columns (80 programs); the 2048-wide o projection 6.6 against 7.0 us with 16
    columns (128 programs) and 4 stages; LM heads (32000 and 151936 columns) within 5% of
    the best at 64 columns.

    From the sweep with split-K (``benchmarks/results/matmul_sweep_h100_splitk.json``, same
    kernel, fp16, 1 and 16 rows), against the picks above:

    * split-K for a long K (>= 4096) over few columns (<= 1024: at most 64 tiles of 16 for
      an H100's 132 SMs): Qwen2-0.5B's down projection (K 4864, 896 columns, residual) 7.6
      against 8.9 us (1 row) and 7.9 against 9.2 us (16 rows) in 8 slices of 128-wide K
      steps, 2 warps, 4 stages (448 programs). TinyLlama's down projection (2048 columns, 128
      tiles) keeps one slice: 11.5 us (1 row), its best, against 12.0 us at best in 2, 4
      or 8 slices. Qwen2's 4 rows (not swept) take the split as its 1 and 16 rows do.
    * 2 warps for 16 rows (``rows > 4``) of a 16-column tile that does not widen its input
      (``outputs <= width``: the o projections): Qwen2's (896 -> 896) 3.4 against 3.8 us,
      TinyLlama's (2048 -> 2048, 512-wide K steps) 6.5 against 7.5 us. With 1 row 2 warps
      are no faster (Qwen2 3.6 against 3.7 us; TinyLlama 7.3 against 6.6 us), and q/k/v
      (which widen their input) were not swept at 2 warps, so both keep 4. GPT-2's c_proj
      (768 -> 768, 3072 -> 768) falls under the rule unswept. Left out: Qwen2's o projection
      at 1 row with 3 stages, 3.5 against 3.7 us: within the 0.2-0.3 us between two timings
      of the same default in that file (3.7 us in the sweep, 3.9 in its shape table), and
      TinyLlama's is slower with 3 (7.0 against 6.6 us).

    One row with ``gemv`` (the launch allows it: weights contiguous along K or along N, no head
    norm) and at least ``GEMV_MIN_OUTPUTS`` columns: the products without tensor cores; weights
    along K in 2-column tiles of 1024-wide K steps, 4 warps (``LaunchConfig.gemv``). From
    ``diag_matmul_gemv.py`` on an H100 (``matmul_gemv_h100.json``, fp16, one row, launched as
    programmatic dependents), the sweep's best GEMV tile against the tensor-core launch:
    TinyLlama's down projection 9.7 against 11.0 us, gate/up 17.7 against 19.2, o 4.4 against
    5.8; Qwen2-0.5B's down 4.9 against 6.4; Llama-3-8B at TP=2 gate/up 41.6 against 44.1, down
    21.6 against 22.7 (the diag's own kernel, the same math; the sweep: 2-16 columns,
    256-1024-wide K steps, 2-8 warps, the next step's tile loaded ahead or not; Qwen2's best
    loads ahead, TinyLlama's gate/up best is 16 columns wide). This one tile came within 0.8 us
    of the best on the four shapes where it was timed; on TinyLlama's gate/up and the 8B down
    only its variant loading ahead was, 0.4 and 0.8 us from their best. As launched
    (``matmul_kernels_h100_gemv.json``, another run) TinyLlama's down 10.0, gate/up 18.4, o 4.8
    us. The rotary q/k/v launch: 6.6 against 7.9 us for the split-K pick below (TinyLlama), 3.7
    against 5.0 (Qwen2), 11.8 against 13.1 (Llama-3-8B, TP=2; ``rotary_gemv_h100.json``). LM
    heads take it untimed alone (with them on tensor cores, in its own process, Qwen2's step
    took 0.820 ms, rounds 0.773-0.909, against the run before's 0.757:
    ``suite_decode_h100_gemv_no_lm_head.json``; no decision either way). Weights along N
    (``along_n``): ``_gemv_along_n``."""
    widest_k = widest_k_step(width)
    if gemv and rows == 1 and outputs >= GEMV_MIN_OUTPUTS and ONE_ROW_GEMV:
        if along_n:
            return _gemv_along_n(width, outputs)
        # LM heads over a short K (one 1024-wide step): 16-column tiles. On an H200
        # (matmul_kernels.py --sweep-gemv, 2026-11-29) GPT-2's (768 -> 50257) 23.9 us against
        # 35.6 with 2 columns (cuBLAS' GEMV: 29.5), Qwen2-0.5B's (896 -> 151936) 66.5 against
        # 94.6 (66.0); TinyLlama's (K 2048) is faster with 2: 36.7 against 44.4 us.
        block_n = 16 if outputs >= 16384 and width <= 1024 else 2
        return LaunchConfig(block_n, min(1024, widest_k), warps=4, stages=1, gemv=True)
    deep = rows > 4
    if gated:
        # a rotary q, k, v group is gated's kind too (two accumulators per program: columns
        # j and j + D/2); its q/k/v are narrower than a gate/up pair. One row reaches this
        # split only where GEMV is not allowed (head norms, weights stored [K, N]), 2-4 rows
        # always; measured at 1 row before GEMV launches: under 64 tiles of 32
        # columns (1 row: TinyLlama's, Qwen2's, Llama-3-8B's at TP=2), 4 K slices of 32
        # columns: 7.9 against 8.9 us, 4.9 against 6.1, 13.2 against 14.9 (the best of each
        # sweep 7.8, 4.7 and 13.1; Llama-3-8B's 112 tiles keep one slice, its best;
        # benchmarks/results/rotary_splitk_h100.json). Rows > 4 were not swept.
        if rotary and not deep and outputs // 32 < 64:
            return LaunchConfig(32, min(128, widest_k), warps=2, stages=3, split_k=4)
        block_n = 32 if outputs // 32 >= 80 else 16
        return LaunchConfig(block_n, min(256, widest_k), warps=4 if deep else 2, stages=3)
    if width >= 4096:  # down projections: long K, few columns
        if outputs <= 1024:  # under half the SMs in 16-column tiles: 8 K slices each
            return LaunchConfig(16, 128, warps=2, stages=4, split_k=8)
        return LaunchConfig(16, 512, warps=2, stages=4)
    if outputs >= 16384:  # LM heads: programs enough at any tile
        return LaunchConfig(64, min(256, widest_k), warps=4, stages=3)
    block_n = 32 if outputs // 32 >= 80 else 16
    block_k = min(512 if deep and width >= 2048 else 256, widest_k)
    warps = 2 if deep and block_n == 16 and outputs <= width else 4
    return LaunchConfig(block_n, block_k, warps=warps, stages=4 if block_n == 16 else 3)


def _gemv_along_n(width: int, outputs: int) -> LaunchConfig:
    """One row's GEMV on weights stored [K, N] (``along_n``: GPT-2's Conv1D, ``x @ W``), 4
    warps; K sliced only when long (>= 2048: slices until 256 programs, at most 8, each >= 256
    wide). A slice of <= 1024 is one step (a program's loads wait on memory once) in 32-column
    tiles, 16 for outputs under 2048 in one slice: on an H200 (``matmul_kernels.py
    --sweep-gemv``, 2026-12-01, 6eb5265, fp16), against 128-256-wide steps before, GPT-2's
    c_attn 3.9 against 6.2 us (cuBLAS' linear on [N, K] weights: 5.0), c_fc 4.5 against 7.5
    (5.1), the attention's c_proj 2.0 against 2.7 (3.7), the MLP's (K 3072, 6 slices of 512)
    4.8 against 5.4 (7.7); 8 warps within 0.2 us. Longer slices keep the first sweep's tiles
    (2026-11-29): a one-step tile held across steps is 256 fp32 sums a thread, unmeasured."""
    tiles, splits = ceil_div(outputs, 32), 1
    while width >= 2048 and tiles * splits < 256 and splits < 8 and width // (2 * splits) >= 256:
        splits *= 2
    span = ceil_div(width, splits)
    if span > 1024:
        block_n, block_k = (32, 256) if outputs >= 2048 else (16, 128)
    else:
        block_n, block_k = (16 if outputs < 2048 and splits == 1 else 32), widest_k_step(span)
    return LaunchConfig(block_n, block_k, warps=4, stages=1, split_k=splits, gemv=True)


# Weight elements per row of a program's tile asked of L2 first, before anything else is
# read (and, launched as a programmatic dependent, before the wait for the previous kernel:
# kernels/dependent_launch.py). Measured on an H100 with benchmarks/diag/diag_matmul_pdl.py
# (22 TinyLlama-shape MLP blocks, 66 launches in one CUDA graph): with PDL 808 us with none,
# 791 with 128, 785 with 256, 801 with 512 (more requests compete with the previous
# kernel's own reads); without PDL 836 with none, 812 with 256
# (matmul_pdl_prefetch_h100.json). Read at each call; the diag flips it.
PREFETCH_K = 256


# One-row launches as GEMV (launch_config). Read at each call: the suite's
# ``infinifuse-nogemv`` variant turns it off to measure what it gives.
ONE_ROW_GEMV = True
# The fewest launch columns measured with it (Qwen2-0.5B's rotary q/k/v launch: 640, q and k
# counted once per rotate_half pair); under 512 the tl.dot tiles stay (not measured; the
# CPU tests' tiny models keep their few programs). 512-639 are unmeasured.
GEMV_MIN_OUTPUTS = 512


# Tests and the sweep swap this function (the launch reads it at each call).
_launch_config = launch_config


def _launch(
    group: MatmulGroup,
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    weights: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor, ...],
    heads: Heads | None = None,
    allocate: bool = True,
) -> tuple[list[Any], tuple[int], dict[str, Any], tuple[torch.Tensor, ...]]:
    """(arguments, grid, meta-parameters, outputs) of the launch on these tensors."""
    width = x.shape[-1]
    lead = tuple(x.shape[:-1])
    rows = math.prod(lead)
    rows_2d = x.reshape(rows, width)
    widths = [w.shape[0] for w in weights]
    out_widths = widths[: group.outputs]
    if allocate:
        outputs = tuple(x.new_empty(*lead, n) for n in out_widths)
    else:  # a warm-up: any tensor of the dtype shows Triton the pointer type
        outputs = tuple(x for _ in out_widths)
    # The residual as [rows, N_0] (a view where its strides allow; absent: x, never read)
    res = rows_2d if residual is None else residual.reshape(rows, out_widths[0])
    columns = _launch_columns(group, widths)
    gated = bool(group.gate or group.rotary)
    config = _config(group, rows, width, weights, columns)
    tiles = [ceil_div(n, config.block_n) for n in columns]
    block_m = 1 if config.gemv else max(16, 1 << max(0, (rows - 1).bit_length()))
    span, splits = _k_slices(width, config)
    if splits > 1:
        programs = sum(tiles)
        pairs = 2 if gated else 1  # a pair's programs keep two sums per slice
        size = programs * splits * pairs * block_m * config.block_n
        work = x.new_empty(size if allocate else 0, dtype=torch.float32)
        counters = (arrival_counters(x.device, programs) if allocate
                    else x.new_empty(0, dtype=torch.int32))  # fmt: skip
    else:
        work, counters = x, x  # never read: SPLIT_K is 1
    # Absent tensors are passed as x: the kernel's constants keep it from reading them.
    w = [*weights, *(weights[0],) * (MAX_SIBLINGS - len(weights))]
    b = [*biases, *(x,) * (MAX_SIBLINGS - len(biases))]
    outs = [*outputs, *(outputs[0],) * (MAX_SIBLINGS - len(outputs))]
    n = [*widths, *(0,) * (MAX_SIBLINGS - len(widths))]
    args = [
        rows_2d, rows_2d.stride(0), rows_2d.stride(1),
        x if norm_weight is None else norm_weight, x if norm_bias is None else norm_bias,
        float(group.eps),
        *w, *(s for t in w for s in t.stride()),
        *b, *outs, res, *res.stride(),
        rows, width, *n, tiles[0], tiles[1] if len(tiles) > 1 else 0,
        *_heads_args(x, heads, group), work, counters,
    ]  # fmt: skip
    pdl = pdl_launch(x.device)
    meta = {
        "NORM": NORMS.index(group.norm),
        "NORM_BIAS": group.norm_bias,
        "GATED": bool(group.gate),
        "HAS_BIAS": group.bias,
        "HAS_RESIDUAL": group.residual,
        "SIBLINGS": group.siblings,
        "HEAD_DIM": group.rotary,
        "CACHE": group.cache_write,
        "HEAD_NORM": NORMS.index(group.head_norm),
        "HAS_ACT": bool(group.activation) or group.epilogue is not None,
        "HAS_TAIL": group.residual_tail is not None,  # ACT after the residual instead
        "ACT": epilogue_function(_epilogue(group, x.dtype)),
        "SPLIT_K": splits,
        "K_SPAN": span if splits > 1 else width,
        "BLOCK_M": block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "PRECISION": _precision(x.dtype),
        "PDL": pdl,
        "PREFETCH": PREFETCH_K if nvidia_gpu(x.device) else 0,  # inline PTX
        "W_KN": config.gemv and _stored_along_n(weights),  # tensor cores read any layout
        "num_warps": config.warps,
        "num_stages": config.stages,
    }
    if meta["PDL"]:
        meta["launch_pdl"] = True
    if group.index_checks:
        # The debug build is for the cache index's assert alone: Triton's debug mode would
        # also check every 32-bit integer add and multiply for overflow, the weight offsets
        # of the K loop included (the compiled q/k/v kernel's code doubled)
        meta["sanitize_overflow"] = False
    return args, (sum(tiles), splits), meta, outputs


def _epilogue(group: MatmulGroup, dtype: torch.dtype) -> RowProgram:
    """The program the kernel's ``ACT`` function runs: the group's elementwise tail, or its
    gate's or output's named activation (neither: the identity, never called); outputs are
    of the rows' dtype."""
    if group.epilogue is not None:
        return group.epilogue
    if group.residual_tail is not None:
        return group.residual_tail
    return activation_program(group.gate or group.activation, dtype)


def epilogue_source(group: MatmulGroup, dtype: torch.dtype) -> str:
    """The generated source of the function the group's kernel applies to its outputs (its
    gate's or activation or elementwise tail: kernels/epilogue.py), "" when none."""
    if not (group.gate or group.activation or group.epilogue is not None
            or group.residual_tail is not None):  # fmt: skip
        return ""
    return generate_epilogue_source(_epilogue(group, dtype), EPILOGUE_OPTIONS)[1]


def _launch_columns(group: MatmulGroup, widths: list[int]) -> list[int]:
    """Each sibling's output columns as its programs cover them: a rotary group's q and k
    programs each cover columns j and j + D/2 of their heads."""
    return [n // 2 for n in widths[:2]] + widths[2:] if group.rotary else widths[: group.outputs]


def _config(group: MatmulGroup, rows: int, width: int, weights: Sequence[torch.Tensor],
            columns: list[int]) -> LaunchConfig:  # fmt: skip
    """The launch config of ``rows`` rows of ``width`` on these weights, whose programs
    cover ``columns`` (``_launch_columns``)."""
    # Not with a head norm: a program holds a whole head, a GEMV tile a few columns. Weights
    # contiguous along neither K nor N (slices of both) keep tensor cores.
    along_n = _stored_along_n(weights)
    gemv = not group.head_norm and (along_n or all(w.stride(-1) == 1 for w in weights))
    gated = bool(group.gate or group.rotary)
    # (gemv last: tests and sweeps that swap _launch_config read it there)
    config = _launch_config(rows, width, sum(columns), gated, bool(group.rotary), along_n,
                            gemv)  # fmt: skip
    if group.head_norm:  # a program holds whole heads: one head's halves
        config = dataclasses.replace(config, block_n=group.rotary // 2)
    if config.gemv and rows != 1:
        raise ValueError(f"a GEMV launch config is for one row, not {rows}: {config}")
    return config


def _stored_along_n(weights: Sequence[torch.Tensor]) -> bool:
    """Are the weights (``[N, K]`` views) stored [K, N], N contiguous (GPT-2's Conv1D, ``x @
    W``)? Their GEMV then reads tiles along N (matmul_triton._weight_tile)."""
    return all(w.stride(0) == 1 and w.stride(-1) != 1 for w in weights)


def _k_slices(width: int, config: LaunchConfig) -> tuple[int, int]:
    """(K columns per slice, slices): split-K's slices of whole K steps, none empty."""
    span = ceil_div(width, config.split_k)
    span = ceil_div(span, config.block_k) * config.block_k
    return span, ceil_div(width, span)


def launch_path(group: MatmulGroup, x: Any, params: Sequence[Any]) -> str | None:
    """How a launch on these values runs, for ``explain``: "GEMV" (one row) or "tensor
    cores", with ", split-K N" where K is summed in N slices; None for sizes or strides
    known only at run time."""
    if not isinstance(x, torch.Tensor):
        return None
    weights, _, _ = _split_params(group, tuple(params))
    sizes = [n for t in (x, *weights) for n in (*t.shape, *t.stride())]
    if not all(isinstance(n, int) for n in sizes) or x.numel() == 0:
        return None
    columns = _launch_columns(group, [w.shape[0] for w in weights])
    config = _config(group, math.prod(x.shape[:-1]), x.shape[-1], weights, columns)
    _, splits = _k_slices(x.shape[-1], config)
    path = "GEMV" if config.gemv else "tensor cores"
    return f"{path}, split-K {splits}" if splits > 1 else path


def _heads_args(x: torch.Tensor, heads: Heads | None, group: MatmulGroup) -> list[Any]:
    """The kernel's cos, sin, SEQ, head norm, cache and index arguments (x and zeros where
    absent: its constants keep it from reading them)."""
    if heads is None:
        return [x, 0, 0, 0, x, 0, 0, 0, 1, x, x, 0.0, x, 0, 0, 0, 0, x, 0, 0, 0, 0, x, 0, 0]
    batch, seq, width = x.shape[0], x.shape[1], group.rotary
    cos = torch.broadcast_to(heads.cos, (batch, 1, seq, width))
    sin = torch.broadcast_to(heads.sin, (batch, 1, seq, width))
    args = [heads.cos, cos.stride(0), cos.stride(2), cos.stride(3),
            heads.sin, sin.stride(0), sin.stride(2), sin.stride(3), seq]  # fmt: skip
    if group.head_norm:
        args += [heads.q_norm, heads.k_norm, float(group.head_eps)]
    else:
        args += [x, x, 0.0]
    if heads.k_cache is None:
        return args + [x, 0, 0, 0, 0, x, 0, 0, 0, 0, x, 0, 0]
    k_cache, v_cache, index = heads.k_cache, heads.v_cache, heads.index
    return args + [k_cache, *k_cache.stride(), v_cache, *v_cache.stride(),
                   index, index.stride(0), k_cache.shape[2]]  # fmt: skip


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 inputs multiply in IEEE fp32 (eager's default, not
    TF32); half inputs on tensor cores. Triton's interpreter (3.6) multiplies bf16 blocks
    wrongly (results off by 1e10 on a CPU), so there they are upcast to fp32 first: exact,
    as every bf16 value is an fp32 value."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if dtype == torch.bfloat16 and interpreter_enabled() else "tf32"


@functools.cache
def _kernel(checks: bool = False) -> Any:
    """The kernel; with ``checks``, built with the device-side assert on a cache index."""
    # The kernel's module imports Triton at its top (jit functions calling each other must
    # be module globals), so it is imported at the first launch, not with this module.
    from fusebackend.kernels import matmul_triton

    return (
        matmul_triton.matmul_group_kernel_checked if checks else matmul_triton.matmul_group_kernel
    )
