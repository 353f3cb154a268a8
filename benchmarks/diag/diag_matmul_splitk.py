"""Does split-K lift a few-row matmul to copy bandwidth? (a decode step's narrow projections)

``matmul_group_kernel`` (fusebackend/kernels/matmul_triton.py) runs one program per BLOCK_N
column tile, each looping over the whole K. On an H100 it reached only 40-45% of copy
bandwidth on TinyLlama's o_proj (N = K = 2048: 6.7 us against a 2.8 us floor), 44% on its
qkv, 66% on its down_proj and 14-32% on Qwen2-0.5B's o/down
(benchmarks/results/matmul_kernels_h100.json, ``fraction_of_copy``). The suspect: with
BLOCK_N 16-64 there are only 32-128 programs for 132 SMs, too few bytes in flight. Split-K
gives each column tile SPLIT_K programs, each over one slice of K, and sums their partials.

This diag has its own kernels (the project's kernel is untouched) computing
``out = x @ W.T (+ residual)`` for x [M, K] (M <= 16, padded to BLOCK_M = 16 with masked
rows) and W [N, K], fp32 accumulation, the residual added in fp32 and the output rounded
once to the dtype (as the project's ``_store``):

- ``semaphore`` (the candidate): ONE launch, grid (column tiles, SPLIT_K). Each program
  stores its fp32 partial to a workspace [SPLIT_K, BLOCK_M, N] (torch.empty per call: fine
  inside a CUDA graph), then ``tl.atomic_add``s the tile's int32 counter (acq_rel, gpu
  scope). The program that sees SPLIT_K - 1 arrives last: it sums partials 0, 1, ... in
  that fixed order (its own from registers; the order never depends on which program came
  last, so the result is deterministic), adds the residual, casts, stores and puts the
  counter back to 0 for the next launch or graph replay. The counters are one persistent
  zeroed int32 buffer per device, allocated once. SPLIT_K = 1 is the plain kernel (no
  workspace, no atomics) so the sweep compares like for like.
- ``atomic`` (for comparison): fp32 ``tl.atomic_add`` of the partials into a buffer zeroed
  per call, then a second tiny kernel adding the residual and casting: three graph nodes
  (memset, matmul, epilogue) and a sum order that varies from run to run.

Measured (GPU, fp16, M = 1 and 16): TinyLlama o (2048 x 2048 + residual), down (5632 -> 2048
+ residual), qkv-like (2048 -> 2560), gate-like (2048 -> 11264); Qwen2-0.5B o (896 x 896 +
residual), down (4864 -> 896 + residual), qkv-like (896 -> 1152). For each (shape, M) the
sweep runs SPLIT_K in {1, 2, 4, 8, 16} (where K / SPLIT_K >= BLOCK_K) x BLOCK_N in {16, 32,
64} x BLOCK_K in {64, 128, 256} x warps {2, 4} x stages {2, 3, 4}, ordered so the
informative part comes first (each tile at every SPLIT_K, 4 warps, 3 stages or 2 where the
slice is shorter; then warps x stages at the best tiles, overall and at SPLIT_K = 1; then
the rest). Both M of a shape try each config in turn (M is not specialized: one compile);
``--sweep-seconds`` (default 240) is shared out over the shapes and what did not fit is
listed per case (``cut``). Not yet run on a GPU: the kernels have only run in Triton's
interpreter (``--smoke``), where programs run one after another. Every config is checked
once against a torch fp32 reference before it is timed (``max_error``; a wrong one is
reported with ``ok: false`` and never timed). Per case: the best config and its time, the
best SPLIT_K = 1 time, cuBLAS ``F.linear`` (+ ``add`` of the residual) and ``torch.addmm``
(the residual in cuBLAS's epilogue), the atomic variant at the best config's tile for each
SPLIT_K, bytes moved (weights, rows, residual, output) and the fraction of copy bandwidth
(``embedding_chain.copy_bandwidth_gbs``, read + write).

Times: ``embedding_chain.device_ms``: the calls captured in one CUDA graph, replayed
between CUDA events, median. The calls cycle over enough weight copies (>= 192 MB, one copy
per call: ``calls`` = copies, at least 20) that the 50 MB L2 cannot hold them, so every
call reads its weights from HBM as a decode step does. (matmul_kernels.py caps the copies at
20: Qwen2's 1.6 MB o_proj then cycles over 32 MB, which L2 may partly hold.)

    python benchmarks/diag/diag_matmul_splitk.py --out /tmp/matmul_splitk.json
    python benchmarks/diag/diag_matmul_splitk.py --shapes tinyllama-o --rows 1 --sweep-seconds 60
    TRITON_INTERPRET=1 python benchmarks/diag/diag_matmul_splitk.py --smoke   # CPU: checks only
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from embedding_chain import copy_bandwidth_gbs, device_ms  # noqa: E402  (benchmarks/)
from row_kernels import versions  # noqa: E402

BLOCK_M = 16  # tl.dot's smallest tile; M <= 16 rows are masked into it
ROTATE_BYTES = 192 * 2**20  # weights cycled per timed graph: well past an H100's 50 MB L2
MAX_CALLS = 256  # calls captured per timed graph (a 1.6 MB weight needs 120 copies)
COUNTER_SLOTS = 8192  # column tiles the counters cover: gate-like N = 11264 / 16 = 704
SPLITS, BLOCK_NS, BLOCK_KS, WARPS, STAGES = (1, 2, 4, 8, 16), (16, 32, 64), (64, 128, 256), \
    (2, 4), (2, 3, 4)  # fmt: skip
ROWS = (1, 16)


# ---- kernels


@triton.jit
def _partial(x, x_row, w, w_n, rows, cols, part, M, N, K: tl.constexpr,
             K_SLICE: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """fp32 products of the rows with columns ``cols`` of W over K slice ``part``:
    ks in [part * K_SLICE, (part + 1) * K_SLICE), masked at K (the last slice's tail)."""
    acc = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    k_start = part * K_SLICE
    for k0 in range(0, K_SLICE, BLOCK_K):
        ks = k_start + k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x + rows[:, None] * x_row + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)  # fmt: skip
        b = tl.load(w + cols[None, :] * w_n + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # fmt: skip
        if PRECISION == "upcast":  # see _precision
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _epilogue(acc, out, res, res_row, rows, cols, M, N, HAS_RESIDUAL: tl.constexpr):
    """The output tile [M, N] (contiguous): residual added in fp32, one rounding."""
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_RESIDUAL:
        r = tl.load(res + rows[:, None] * res_row + cols[None, :], mask=keep, other=0.0)
        acc = acc + r.to(tl.float32)
    tl.store(out + rows[:, None] * N + cols[None, :], acc.to(out.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=["M"])  # M = 1 would otherwise compile apart from M = 16
def _splitk_semaphore_kernel(
    x, x_row,          # rows [M, K], unit column stride, and their row stride
    w, w_n,            # weight [N, K], unit column stride, and its row stride
    out,               # output [M, N], contiguous
    res, res_row,      # residual [M, N] (unit column stride) or any pointer
    work,              # fp32 workspace [SPLIT_K, BLOCK_M, N] (unused when SPLIT_K == 1)
    counters,          # int32 arrivals per column tile, zero between launches
    M, N, K: tl.constexpr,
    K_SLICE: tl.constexpr,       # K per program: a multiple of BLOCK_K (slices never overlap)
    SPLIT_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out = x @ W.T (+ residual), grid (column tiles, SPLIT_K): program (t, p) computes
    tile t's fp32 partial over K slice p; the last of a tile's programs to arrive sums the
    partials in the order 0..SPLIT_K-1, applies the epilogue and zeroes the counter."""
    tile = tl.program_id(0)
    part = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _partial(x, x_row, w, w_n, rows, cols, part, M, N, K, K_SLICE, BLOCK_K, PRECISION)
    if SPLIT_K == 1:
        _epilogue(acc, out, res, res_row, rows, cols, M, N, HAS_RESIDUAL)
    else:
        keep = (rows[:, None] < M) & (cols[None, :] < N)
        tile_at = rows[:, None] * N + cols[None, :]
        tl.store(work + part * BLOCK_M * N + tile_at, acc, mask=keep)
        # A scalar atomic is issued by one thread of the program (Triton's lowering); its
        # release orders only what that thread saw, so the barrier first makes every
        # thread's partial store precede it.
        tl.debug_barrier()
        arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # Every other partial of this tile was released before its program's atomic,
            # which this program's acquire read. ".cg" reads them from L2: L1 is not
            # coherent with the other SMs that wrote them.
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for p in tl.static_range(SPLIT_K):
                other = tl.load(work + p * BLOCK_M * N + tile_at, mask=keep & (p != part),
                                other=0.0, cache_modifier=".cg")  # fmt: skip
                total += tl.where(p == part, acc, other)
            _epilogue(total, out, res, res_row, rows, cols, M, N, HAS_RESIDUAL)
            # all SPLIT_K arrivals are in: nobody touches the counter again in this launch,
            # and the next launch (or graph replay) is stream-ordered after this store
            tl.store(counters + tile, 0)


@triton.jit(do_not_specialize=["M"])
def _splitk_atomic_kernel(
    x, x_row, w, w_n,
    acc_out,           # fp32 [M, N], zeroed before the launch: partials are added into it
    M, N, K: tl.constexpr, K_SLICE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc_out += x @ W.T over K slice program_id(1) (fp32 atomics: order not fixed)."""
    tile = tl.program_id(0)
    part = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _partial(x, x_row, w, w_n, rows, cols, part, M, N, K, K_SLICE, BLOCK_K, PRECISION)
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    tl.atomic_add(acc_out + rows[:, None] * N + cols[None, :], acc, mask=keep, sem="relaxed")


@triton.jit
def _finish_kernel(acc_in, out, res, res_row, M, N, HAS_RESIDUAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """out = (acc_in (+ residual)).to(dtype), one column tile per program."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = (rows[:, None] < M) & (cols[None, :] < N)
    acc = tl.load(acc_in + rows[:, None] * N + cols[None, :], mask=keep, other=0.0)
    _epilogue(acc, out, res, res_row, rows, cols, M, N, HAS_RESIDUAL)


# ---- launchers


@dataclasses.dataclass(frozen=True)
class Config:
    split_k: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The persistent zeroed int32 arrival counters of ``device`` (one per column tile),
    allocated once: a captured graph keeps their address, and each launch leaves them 0."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def k_slice(k: int, config: Config) -> tuple[int, int]:
    """(K per program, programs per tile): the slice is a multiple of BLOCK_K so slices
    never overlap; a split that would leave trailing slices empty launches fewer."""
    per = -(-k // (config.split_k * config.block_k)) * config.block_k
    return per, -(-k // per)


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: fp32 inputs in IEEE fp32 (not TF32), half inputs on
    tensor cores. Triton 3.6's interpreter multiplies bf16 blocks wrongly (off by 1e11 here,
    as fusebackend/kernels/matmul.py found), so there they are upcast to fp32 first: exact,
    as every bf16 value is an fp32 value."""
    if dtype == torch.float32:
        return "ieee"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return "upcast" if dtype == torch.bfloat16 and interpreted else "tf32"


def _check(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None) -> None:
    m, k = x.shape
    if m > BLOCK_M or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"expected x [M <= {BLOCK_M}, K] and W [N, K] with unit column "
                         f"strides, got {tuple(x.shape)} and {tuple(w.shape)}")  # fmt: skip
    if residual is not None and (residual.shape != (m, w.shape[0]) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [M, N] = {(m, w.shape[0])}, got {residual.shape}")


def matmul_semaphore(x, w, residual, config: Config) -> torch.Tensor:
    """out = x @ W.T (+ residual) in one launch, split-K reduced by the last arrival."""
    _check(x, w, residual)
    (m, k), n = x.shape, w.shape[0]
    per, split = k_slice(k, config)
    tiles = triton.cdiv(n, config.block_n)
    sem = counters(x.device)
    if tiles > sem.numel():
        raise ValueError(f"{tiles} column tiles, counters cover {sem.numel()}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # SPLIT_K = 1 never reads the workspace: hand it ``out`` instead of an allocation
    work = torch.empty(split, BLOCK_M, n, dtype=torch.float32, device=x.device) if split > 1 \
        else out  # fmt: skip
    res = residual if residual is not None else out
    _splitk_semaphore_kernel[(tiles, split)](
        x, x.stride(0), w, w.stride(0), out, res, res.stride(0), work, sem, m, n, k, per,
        SPLIT_K=split, HAS_RESIDUAL=residual is not None, PRECISION=_precision(x.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return out


def matmul_atomic(x, w, residual, config: Config) -> torch.Tensor:
    """out = x @ W.T (+ residual): fp32 atomics into a zeroed buffer, then an epilogue
    kernel (memset + two launches)."""
    _check(x, w, residual)
    (m, k), n = x.shape, w.shape[0]
    per, split = k_slice(k, config)
    tiles = triton.cdiv(n, config.block_n)
    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    _splitk_atomic_kernel[(tiles, split)](
        x, x.stride(0), w, w.stride(0), acc, m, n, k, per, PRECISION=_precision(x.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    _finish_kernel[(triton.cdiv(n, 64),)](acc, out, res, res.stride(0), m, n,
                                          HAS_RESIDUAL=residual is not None, BLOCK_M=BLOCK_M,
                                          BLOCK_N=64, num_warps=2)  # fmt: skip
    return out


VARIANTS = {"semaphore": matmul_semaphore, "atomic": matmul_atomic}


# ---- checking


def reference(x, w, residual) -> torch.Tensor:
    """torch in fp32, unrounded: the error measured includes the output's one rounding."""
    y = x.float() @ w.float().T
    return y + residual.float() if residual is not None else y


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max())


def within(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """tests/helpers.py's tolerances: fp16 atol = rtol = 1e-2, bf16 2e-2 (Triton 3.6's
    interpreter truncates to bf16), fp32 1e-4."""
    t = {torch.float16: 1e-2, torch.bfloat16: 2e-2}.get(out.dtype, 1e-4)
    return bool(((out.float() - ref).abs() <= t + t * ref.abs()).all())


# ---- GPU measurement


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    model: str
    n: int
    k: int
    residual: bool


SHAPES = [
    Shape("tinyllama-o", "tinyllama", 2048, 2048, True),
    Shape("tinyllama-down", "tinyllama", 2048, 5632, True),
    Shape("tinyllama-qkv", "tinyllama", 2048 + 256 + 256, 2048, False),
    Shape("tinyllama-gate", "tinyllama", 2 * 5632, 2048, False),
    Shape("qwen2-o", "qwen2", 896, 896, True),
    Shape("qwen2-down", "qwen2", 896, 4864, True),
    Shape("qwen2-qkv", "qwen2", 896 + 128 + 128, 896, False),
]


class Case:
    """A shape at M rows: the weight copies a timed graph cycles over, rows and residual."""

    def __init__(self, shape: Shape, rows: int, device, dtype) -> None:
        g = torch.Generator(device=device).manual_seed(shape.n * 7919 + shape.k)
        weight_bytes = shape.n * shape.k * torch.finfo(dtype).bits // 8
        self.calls = max(20, min(MAX_CALLS, math.ceil(ROTATE_BYTES / weight_bytes)))
        copies = min(self.calls, math.ceil(ROTATE_BYTES / weight_bytes))
        self.weights = [
            (torch.randn(shape.n, shape.k, generator=g, device=device) * shape.k**-0.5).to(dtype)
            for _ in range(copies)
        ]
        self.x = torch.randn(rows, shape.k, generator=g, device=device).to(dtype)
        self.residual = (torch.randn(rows, shape.n, generator=g, device=device).to(dtype)
                         if shape.residual else None)  # fmt: skip
        self.shape, self.rows, self.weight_bytes = shape, rows, weight_bytes
        item = torch.finfo(dtype).bits // 8
        self.moved = (
            weight_bytes
            + rows * shape.k * item
            + rows * shape.n * item * (2 if shape.residual else 1)
        )
        self.ref = reference(self.x, self.weights[0], self.residual)

    def timed_us(self, fn, reps: int = 10) -> float:
        """Device us per call of ``fn(x, w, residual)``, one weight copy per call."""
        turn = itertools.cycle(self.weights)
        with torch.no_grad():
            ms = device_ms(lambda: fn(self.x, next(turn), self.residual), self.calls, reps)
        return ms * 1e3


def _valid(k: int, config: Config) -> bool:
    """K / SPLIT_K >= BLOCK_K; stages past the slice's loop steps repeat another config."""
    if config.split_k > 1 and k // config.split_k < config.block_k:
        return False
    per, _ = k_slice(k, config)
    return config.stages == 2 or config.stages <= per // config.block_k


# Tiles of the first pass, most promising first (the project's sweep mostly picked 32 x 128
# and 16 x 128 at 4 warps): each tile runs at every SPLIT_K before the next tile, so a sweep
# cut short still compares every split.
TILE_ORDER = [(32, 128), (16, 128), (64, 128), (32, 64), (16, 256), (32, 256), (64, 64),
              (16, 64), (64, 256)]  # fmt: skip


def _ordered_configs(k: int, best_tiles: list[Config]) -> list[Config]:
    """Every tile x SPLIT_K at 4 warps / 3 stages (2 where the slice is shorter), then
    warps x stages at ``best_tiles``, then the rest of the product."""
    first = [Config(s, bn, bk, 4, 3) for (bn, bk), s in itertools.product(TILE_ORDER, SPLITS)]
    # 3 stages where the slice has 3 steps, else 2 (a split of 1-2 steps still gets its turn)
    first = [c if _valid(k, c) else dataclasses.replace(c, stages=2) for c in first]
    second = [dataclasses.replace(t, warps=wp, stages=st)
              for t in best_tiles for wp, st in itertools.product(WARPS, STAGES)]  # fmt: skip
    rest = [Config(*c) for c in itertools.product(SPLITS, BLOCK_NS, BLOCK_KS, WARPS, STAGES)]
    seen: set[Config] = set()
    out = []
    for c in first + second + rest:
        if c not in seen and _valid(k, c):
            seen.add(c)
            out.append(c)
    return out


def try_config(case: Case, config: Config, variant: str = "semaphore") -> dict[str, Any]:
    """Check ``config`` once against the fp32 reference, then time it if it is right."""
    fn = VARIANTS[variant]
    row: dict[str, Any] = {"variant": variant, **dataclasses.asdict(config),
                           "split_k_launched": k_slice(case.shape.k, config)[1]}  # fmt: skip
    try:
        with torch.no_grad():
            out = fn(case.x, case.weights[0], case.residual, config)
        row["max_error"] = max_error(out, case.ref)
        row["ok"] = within(out, case.ref)
        if variant == "semaphore":
            torch.cuda.synchronize()
            row["counters_zero"] = not bool(counters(case.x.device).any())
            row["ok"] = row["ok"] and row["counters_zero"]
        row["us"] = case.timed_us(lambda x, w, r: fn(x, w, r, config), reps=5) if row["ok"] \
            else None  # fmt: skip
    except Exception as error:  # out of resources, compile errors: the config is out
        row.update(ok=False, us=None, error=f"{type(error).__name__}: {error}"[:300])
        # a tile that does not fit the SM is a config that cannot run, not a wrong answer
        row["out_of_resources"] = type(error).__name__ == "OutOfResources"
    if not row["ok"]:
        print(f"  {case.shape.name} M={case.rows} {variant} {config}: WRONG or failed "
              f"(max error {row.get('max_error')}, {row.get('error', '')})")  # fmt: skip
    return row


def _fastest(tried: list[dict[str, Any]], split_k: int | None = None) -> dict[str, Any] | None:
    timed = [t for t in tried if t["us"] is not None
             and (split_k is None or t["split_k_launched"] == split_k)]  # fmt: skip
    return min(timed, key=lambda t: t["us"]) if timed else None


def _config_of(row: dict[str, Any]) -> Config:
    return Config(*(row[f.name] for f in dataclasses.fields(Config)))


def sweep(cases: list[Case], deadline: float) -> dict[int, dict[str, Any]]:
    """Configs in ``_ordered_configs``'s order until ``deadline``, each tried at every M of
    ``cases`` (one shape) in turn: M is not specialized, so one compile serves all rows.
    Per M: what was tried and what was cut."""
    k = cases[0].shape.k
    tried: dict[int, list[dict[str, Any]]] = {c.rows: [] for c in cases}
    done: set[Config] = set()
    cut: list[dict[str, Any]] = []
    while True:
        # past the first pass the order depends on the best tiles found so far (overall and
        # at SPLIT_K = 1, for every M)
        tiles = [_config_of(r) for t in tried.values()
                 for r in (_fastest(t), _fastest(t, 1)) if r is not None]  # fmt: skip
        todo = [c for c in _ordered_configs(k, tiles) if c not in done]
        if not todo:
            break
        if time.perf_counter() > deadline:
            cut = [dataclasses.asdict(c) for c in todo]
            break
        done.add(todo[0])
        for case in cases:
            tried[case.rows].append(try_config(case, todo[0]))
    return {m: {"tried": t, "cut": cut} for m, t in tried.items()}


def measure(case: Case, swept: dict[str, Any], copy_gbs: float, atomic: bool) -> dict[str, Any]:
    """The figures of one (shape, M): best swept config, best at SPLIT_K = 1, cuBLAS, and
    (``atomic``) the atomic variant at the best config's tile for each SPLIT_K."""
    shape, k, tried = case.shape, case.shape.k, swept["tried"]
    best, best1 = _fastest(tried), _fastest(tried, 1)

    def figures(us: float | None) -> dict[str, Any]:
        if us is None:
            return {"us": None}
        gbs = case.moved / us / 1e3
        return {"us": us, "gbs": gbs, "fraction_of_copy": gbs / copy_gbs}

    linear = (lambda x, w, r: F.linear(x, w) + r) if shape.residual else F.linear
    row: dict[str, Any] = {
        "shape": shape.name, "model": shape.model, "rows": case.rows, "n": shape.n, "k": k,
        "residual": shape.residual, "bytes": case.moved, "weight_mb": case.weight_bytes / 1e6,
        "weight_copies_cycled": len(case.weights), "calls_per_graph": case.calls,
        "floor_us": case.moved / copy_gbs / 1e3,
        "best": {**(best or {}), **figures(best and best["us"])},
        "best_split_k_1": {**(best1 or {}), **figures(best1 and best1["us"])},
        "cublas": figures(case.timed_us(linear)),
        "configs_tried": len(tried), "cut": swept["cut"], "tried": tried,
    }  # fmt: skip
    if shape.residual:
        addmm = case.timed_us(lambda x, w, r: torch.addmm(r, x, w.T))
        row["cublas_addmm"] = figures(addmm)  # the residual in cuBLAS's epilogue (beta = 1)
    row["atomic"] = []
    if best is not None and atomic:
        for s in SPLITS[1:]:
            config = dataclasses.replace(_config_of(best), split_k=s)
            if _valid(k, config):
                a = try_config(case, config, "atomic")
                row["atomic"].append({**a, **figures(a["us"])})
    row["all_ok"] = all(t["ok"] or t.get("out_of_resources") for t in tried + row["atomic"])
    b, b1, cu = row["best"], row["best_split_k_1"], row["cublas"]["us"]
    print(f"{shape.name:16} M={case.rows:2}: best {_config_of(best) if best else None} "
          f"{b['us'] or math.nan:6.2f} us ({(b.get('fraction_of_copy') or 0) * 100:3.0f}% of "
          f"copy), split-K 1 best {b1['us'] or math.nan:6.2f} us, cuBLAS {cu:6.2f} us, floor "
          f"{row['floor_us']:5.2f} us; {len(tried)} configs, {len(row['cut'])} cut")  # fmt: skip
    return row


# ---- --smoke


def smoke() -> dict[str, Any]:
    """Tiny shapes under the interpreter (or a GPU): each split (1, 2, 3; K = 100 leaves a
    tail that K_SLICE does not divide), with and without residual, fp16 / bf16 / fp32, both
    variants; each against torch, the counters zero after every call, and a second call
    bit-identical to the first (the semaphore variant's fixed order). No timing."""
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke needs a GPU or TRITON_INTERPRET=1")
    device = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    results = []
    dtypes = itertools.cycle((torch.float16, torch.bfloat16, torch.float32))
    for (k, split, residual), rows in zip(
        itertools.product((96, 100), (1, 2, 3), (False, True)), itertools.cycle((1, 5, 16))
    ):
        dtype = next(dtypes)
        n = 48
        x = torch.randn(rows, k, generator=g, device=device).to(dtype)
        w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
        r = torch.randn(rows, n, generator=g, device=device).to(dtype) if residual else None
        ref = reference(x, w, r)
        # BLOCK_N 32 leaves a half-empty last tile of N = 48; BLOCK_K 16 is tl.dot's least
        config = Config(split, 32 if split != 2 else 16, 16, 4, 2)
        for variant in ("semaphore", "atomic") if split > 1 else ("semaphore",):
            fn = VARIANTS[variant]
            with torch.no_grad():
                first = fn(x, w, r, config)
                zero_after_first = not bool(counters(device).any())
                second = fn(x, w, r, config)
                zero_after_second = not bool(counters(device).any())
            row = {"variant": variant, "rows": rows, "n": n, "k": k, "dtype": str(dtype),
                   "residual": residual, **dataclasses.asdict(config),
                   "split_k_launched": k_slice(k, config)[1],
                   "max_error": max_error(first, ref), "within": within(first, ref),
                   "counters_zero": zero_after_first and zero_after_second,
                   "repeatable": bool(torch.equal(first, second))}  # fmt: skip
            # fp32 atomics may sum in another order each call: only the semaphore's is fixed
            row["ok"] = (
                row["within"]
                and row["counters_zero"]
                and (row["repeatable"] or variant == "atomic")
            )
            results.append(row)
            print(f"smoke {variant:9} M={rows} K={k} split={split} residual={residual:d} "
                  f"{dtype}: max error {row['max_error']:.2e} zeroed={row['counters_zero']} "
                  f"repeatable={row['repeatable']} ok={row['ok']}")  # fmt: skip
    return {**versions(), "benchmark": "diag_matmul_splitk", "smoke": True, "cases": results,
            "all_ok": all(r["ok"] for r in results)}  # fmt: skip


# ---- output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default all)")
    parser.add_argument("--sweep-seconds", type=float, default=240.0)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (CPU ok)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        report = smoke()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("diag_matmul_splitk.py times CUDA kernels: no CUDA device "
                             "(try --smoke)")  # fmt: skip
        device, dtype = torch.device("cuda"), torch.float16
        copy = copy_bandwidth_gbs(device, 0.25)  # 256 MB each way
        names = set(filter(None, args.shapes.split(",")))
        shapes = [s for s in SHAPES if not names or s.name in names]
        rows = [int(m) for m in args.rows.split(",")]
        report = {**versions(), "benchmark": "diag_matmul_splitk", "dtype": "float16",
                  "copy_gbs": copy, "sweep_seconds": args.sweep_seconds,
                  "cases": []}  # fmt: skip
        print(f"copy bandwidth {copy['ceiling']:.0f} GB/s (read + write)")
        end = time.perf_counter() + args.sweep_seconds
        for i, shape in enumerate(shapes):
            # each shape gets an equal share of the sweep time left (a fast one's unused
            # share rolls on to the next)
            now = time.perf_counter()
            cases = [Case(shape, m, device, dtype) for m in rows]
            swept = sweep(cases, now + (end - now) / (len(shapes) - i))
            # the atomic variant's few compiles are skipped once the sweep ran 60 s over
            atomic = time.perf_counter() < end + 60
            for case in cases:
                report["cases"].append(measure(case, swept[case.rows], copy["ceiling"], atomic))
            del cases
        report["all_ok"] = all(c["all_ok"] for c in report["cases"])
    report["seconds"] = time.perf_counter() - started
    print(f"took {report['seconds']:.0f} s; all ok: {report['all_ok']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    if not report["all_ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
