"""Is a one-row matmul group faster without tensor cores than with them? A one-row group as
a GEMV (each program multiplies its weight tile by the row in fp32 and sums along K at the
end) against the production ``matmul_group`` (``tl.dot`` on a 16-row tile padded from one
row), for the decode step's projections over 16 MB (issue 23: >= 85% of copy bandwidth,
measured 69-79%).

Why it might pay: a ``tl.dot`` program stages its weight tile through shared memory for the
tensor cores and pads the row to 16; a GEMV reads the tile straight into registers, coalesced
along K, with no shared-memory round trip, and its column tile can be as narrow as 1-8
columns, so the narrow outputs (TinyLlama's down projection: 2048 columns, 128 programs of 16
for 132 SMs) get several programs per SM.

Variants, per shape, each timed as ``matmul_kernels.timed_us`` does (20 launches in one CUDA
graph over weight copies that L2 cannot hold):

* ``production``: ``matmul_group`` with its launch config, launched as a programmatic
  dependent (as in a decode step) and ``production_nopdl`` without;
* ``gemv``: this file's kernel, swept over block_n x block_k (4 warps, the next K step's
  weights loaded ahead: config "stages" 2; Triton's pipeliner takes only loads that feed
  ``tl.dot``, so its num_stages changes nothing here), then warps x ahead-or-not at the best
  tile; without PDL, then its best config with PDL (wait at the start,
  release after the K loop, as the production kernel);
* ``gemv_tma`` (``--tma``): the same with the weight tile read through a host-built tensor
  descriptor (Hopper's bulk copy engine, pipelined by Triton).

Each variant's output is checked against the eager sequence (fp16 tolerance) before timing.

    python benchmarks/diag/diag_matmul_gemv.py --out benchmarks/results/matmul_gemv_h100.json
    TRITON_INTERPRET=1 python benchmarks/diag/diag_matmul_gemv.py --smoke   # CPU: checks only
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import matmul_kernels as mk  # noqa: E402  (benchmarks/)
from embedding_chain import copy_bandwidth_gbs  # noqa: E402
from row_kernels import versions  # noqa: E402

import fusebackend.kernels.dependent_launch as dependent_launch  # noqa: E402

SHAPES = [
    s for s in mk.SHAPES
    if s.name in ("tinyllama-o", "tinyllama-gate-up", "tinyllama-down", "tinyllama-lm-head",
                  "qwen2-gate-up", "qwen2-down")
] + [
    # Llama-3-8B at TP=2: a rank's column-parallel gate/up and row-parallel down
    mk.Shape("llama3-8b-tp2-gate-up", "llama3-8b", 4096, (7168, 7168), "rms", gate="silu"),
    mk.Shape("llama3-8b-tp2-down", "llama3-8b", 7168, (4096,), residual=True),
]  # fmt: skip
SMOKE_SHAPES = [s for s in mk.SMOKE_SHAPES if not s.bias and not s.activation
                and len(s.widths) == (2 if s.gate else 1)]  # fmt: skip


@triton.jit
def _rstd(x, eps, K: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of the row (1.0 without NORM)."""
    rstd = 1.0
    if NORM:
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x + ks, mask=ks < K, other=0.0).to(tl.float32)
            squares += a * a
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    return rstd


@triton.jit
def _row_block(x, norm_w, rstd, ks, K: tl.constexpr, NORM: tl.constexpr):
    """Columns ``ks`` of the row, after transformers' RMSNorm with NORM:
    weight * (x.float() * rstd).to(dtype)."""
    a = tl.load(x + ks, mask=ks < K, other=0.0)
    if NORM:
        g = tl.load(norm_w + ks, mask=ks < K, other=0.0).to(tl.float32)
        a = (((a.to(tl.float32) * rstd).to(a.dtype)).to(tl.float32) * g).to(a.dtype)
    return a


@triton.jit
def _gemv(x, norm_w, eps, w0, w1, out, res, N, K: tl.constexpr, NORM: tl.constexpr,
          GATE: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:
        gdc_wait()
    rstd = _rstd(x, eps, K, NORM, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    # AHEAD: the next K step's weight tiles are loaded before this step's products (Triton
    # pipelines only loads that feed tl.dot; these stay in registers, one step ahead)
    ks = tl.arange(0, BLOCK_K)
    at = cols[:, None] * K + ks[None, :]
    keep = (cols[:, None] < N) & (ks[None, :] < K)
    b = tl.load(w0 + at, mask=keep, other=0.0)
    b2 = b
    if GATE:
        b2 = tl.load(w1 + at, mask=keep, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = _row_block(x, norm_w, rstd, ks, K, NORM)
        if AHEAD:
            nks = ks + BLOCK_K
            nkeep = (cols[:, None] < N) & (nks[None, :] < K)
            nb = tl.load(w0 + cols[:, None] * K + nks[None, :], mask=nkeep, other=0.0)
            nb2 = nb
            if GATE:
                nb2 = tl.load(w1 + cols[:, None] * K + nks[None, :], mask=nkeep, other=0.0)
        else:
            keep = (cols[:, None] < N) & (ks[None, :] < K)
            b = tl.load(w0 + cols[:, None] * K + ks[None, :], mask=keep, other=0.0)
            if GATE:
                b2 = tl.load(w1 + cols[:, None] * K + ks[None, :], mask=keep, other=0.0)
            nb, nb2 = b, b2
        acc += b.to(tl.float32) * a.to(tl.float32)[None, :]
        if GATE:
            acc2 += b2.to(tl.float32) * a.to(tl.float32)[None, :]
        b, b2 = nb, nb2
    if PDL:
        gdc_launch_dependents()
    _finish(acc, acc2, out, res, cols, N, GATE, RESIDUAL)


@triton.jit
def _finish(acc, acc2, out, res, cols, N, GATE: tl.constexpr, RESIDUAL: tl.constexpr):
    dtype = out.dtype.element_ty
    y = tl.sum(acc, axis=1).to(dtype)
    if GATE:
        g = y.to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        y = (act * tl.sum(acc2, axis=1).to(dtype).to(tl.float32)).to(dtype)
    if RESIDUAL:
        r = tl.load(res + cols, mask=cols < N, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(out + cols, y, mask=cols < N)


@triton.jit
def _gemv_tma(x, norm_w, eps, d0, d1, out, res, N, K: tl.constexpr, NORM: tl.constexpr,
              GATE: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    col0 = tl.program_id(0) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    if PDL:
        gdc_wait()
    rstd = _rstd(x, eps, K, NORM, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = _row_block(x, norm_w, rstd, ks, K, NORM)
        b = d0.load([col0, k0])  # out of bounds reads zeros
        acc += b.to(tl.float32) * a.to(tl.float32)[None, :]
        if GATE:
            b2 = d1.load([col0, k0])
            acc2 += b2.to(tl.float32) * a.to(tl.float32)[None, :]
    if PDL:
        gdc_launch_dependents()
    _finish(acc, acc2, out, res, cols, N, GATE, RESIDUAL)


def gemv(case: mk.Case, p: mk.Weights, config: tuple[int, int, int, int], pdl: bool = False,
         tma: bool = False) -> tuple[torch.Tensor]:  # fmt: skip
    """The case's group on its one row with ``config`` = (block_n, block_k, warps, stages)."""
    shape = case.shape
    block_n, block_k, warps, stages = config
    n = shape.out_width
    x = case.x.reshape(-1)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    w0 = p.weights[0]
    w1 = p.weights[1] if shape.gate else w0
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w0 = TensorDescriptor.from_tensor(w0, [block_n, block_k])
        w1 = TensorDescriptor.from_tensor(w1, [block_n, block_k])
    meta = {"launch_pdl": True} if pdl else {}
    if not tma:  # Triton pipelines none of these loads: "stages" 2 = one step ahead
        meta["AHEAD"] = stages > 1
        stages = 1
    kernel = _gemv_tma if tma else _gemv
    kernel[(triton.cdiv(n, block_n),)](
        x, p.norm_weight if shape.norm else x, shape.group.eps, w0, w1, out,
        case.residual if shape.residual else x, n, shape.k, NORM=shape.norm == "rms",
        GATE=bool(shape.gate), RESIDUAL=shape.residual, BLOCK_N=block_n, BLOCK_K=block_k,
        PDL=pdl, num_warps=warps, num_stages=stages, **meta,
    )  # fmt: skip
    return (out,)


def _checked(case: mk.Case, fn) -> str | None:
    """None where ``fn`` matches the eager sequence, else why not."""
    try:
        with torch.no_grad():
            out, ref = fn(case.params[0]), case.eager()
        if not mk.within(out, ref, case.x.dtype):
            return f"wrong: max error {mk.max_error(out, ref):.3g}"
        return None
    except Exception as error:  # resources, compile errors: the config is out
        return f"{type(error).__name__}: {str(error)[:200]}"


def _timed(case: mk.Case, fn) -> float | None:
    why = _checked(case, fn)
    if why is not None:
        print(f"  {case.shape.name}: {why}")
        return None
    return mk.timed_us(case, fn, reps=5)


def sweep_gemv(case: mk.Case, deadline: float, tma: bool) -> dict[str, Any]:
    """block_n x block_k at 4 warps and 2 stages, then warps x stages at the best tile."""
    k = case.shape.k
    gated = bool(case.shape.gate)
    tried: dict[tuple, float | None] = {}

    def run(config):
        if config not in tried:
            tried[config] = _timed(case, lambda p: gemv(case, p, config, tma=tma))
        return tried[config]

    widths = (8, 16, 32, 64) if tma else (2, 4, 8, 16)
    ks = (64, 128, 256) if tma else (256, 512, 1024)
    cut = False
    for block_n, block_k in itertools.product(widths, ks):
        regs = block_n * block_k * (2 if gated else 1) // 128  # fp32 per thread at 4 warps
        if block_k > max(64, 1 << (k - 1).bit_length()) or regs > 128:
            continue
        if time.perf_counter() > deadline:
            cut = True
            break
        run((block_n, block_k, 4, 2))
    timed = {c: us for c, us in tried.items() if us is not None}
    if timed:
        tile = min(timed, key=timed.get)
        for warps, stages in itertools.product((2, 4, 8), (2, 3, 4) if tma else (1, 2)):
            if time.perf_counter() > deadline:
                cut = True
                break
            run((tile[0], tile[1], warps, stages))
    timed = {c: us for c, us in tried.items() if us is not None}
    best = min(timed, key=timed.get) if timed else None
    result = {
        "best_config": list(best) if best else None,
        "best_us": timed[best] if best else None,
        "cut_by_time": cut,
        "tried": [{"config": list(c), "us": us} for c, us in tried.items()],
    }
    if best is not None:
        result["best_pdl_us"] = _timed(case, lambda p: gemv(case, p, best, pdl=True, tma=tma))
    return result


def measure(shape: mk.Shape, device, copy_gbs: float, seconds: float, tma: bool):
    case = mk.Case(shape, 1, device, torch.float16)
    row: dict[str, Any] = {"shape": shape.name, "group": shape.group.describe(),
                           "weight_mb": case.weight_bytes / 1e6, "bytes": case.moved}  # fmt: skip
    row["production_us"] = _timed(case, case.fused)
    dependent_launch.USE_PDL = False
    try:
        row["production_nopdl_us"] = _timed(case, case.fused)
    finally:
        dependent_launch.USE_PDL = True
    row["cublas_us"] = mk.timed_us(case, lambda p: mk.cublas_only(shape, p, case.x))
    row["gemv"] = sweep_gemv(case, time.perf_counter() + seconds, tma=False)
    if tma:
        row["gemv_tma"] = sweep_gemv(case, time.perf_counter() + seconds, tma=True)
    for name in ("production_us", "production_nopdl_us"):
        if row[name]:
            row[name.replace("_us", "_fraction_of_copy")] = case.moved / row[name] / 1e3 / copy_gbs
    for variant in ("gemv", "gemv_tma"):
        for key in ("best_us", "best_pdl_us"):
            us = row.get(variant, {}).get(key)
            if us:
                row[variant][key.replace("_us", "_fraction_of_copy")] = (
                    case.moved / us / 1e3 / copy_gbs
                )
    g = row["gemv"]
    print(f"{shape.name}: production {row['production_us'] or float('nan'):.1f} us "
          f"(no PDL {row['production_nopdl_us'] or float('nan'):.1f}), cuBLAS "
          f"{row['cublas_us']:.1f}, gemv {g['best_us'] or float('nan'):.1f} "
          f"{g['best_config']} (PDL {g.get('best_pdl_us') or float('nan'):.1f})"
          + (f", tma {row['gemv_tma']['best_us'] or float('nan'):.1f} "
             f"{row['gemv_tma']['best_config']}" if tma else ""), flush=True)  # fmt: skip
    return row


def smoke() -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for shape in SMOKE_SHAPES:
        case = mk.Case(shape, 1, device, torch.float16, copies=1)
        for tma, stages in ((False, 1), (False, 2), (True, 2)):
            config = (8, 32, 4, stages)
            why = _checked(case, lambda p, c=case, f=config, t=tma: gemv(c, p, f, tma=t))
            rows.append({"shape": shape.name, "config": config, "tma": tma, "ok": why is None,
                         "why": why})  # fmt: skip
            print(f"smoke {shape.name} {config}{' tma' if tma else ''}: {why or 'ok'}")
    return {"smoke": True, "shapes": rows, "all_ok": all(r["ok"] for r in rows)}


def _write(report: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, checks, no times")
    parser.add_argument("--tma", action="store_true", help="also the tensor-descriptor GEMV")
    parser.add_argument("--shapes", help="comma-separated shape names (default: all)")
    parser.add_argument("--sweep-seconds", type=float, default=40.0, help="per shape, variant")
    args = parser.parse_args(argv)
    if args.smoke:
        report = smoke()
    else:
        device = torch.device("cuda")
        copy_gbs = copy_bandwidth_gbs(device, 1.0)["ceiling"]
        chosen = [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(",")]
        report = {**versions(), "benchmark": "diag_matmul_gemv", "dtype": "float16",
                  "copy_gbs": copy_gbs, "shapes": []}  # fmt: skip
        for shape in chosen:  # written after each shape: a call cut off keeps what ran
            report["shapes"].append(measure(shape, device, copy_gbs, args.sweep_seconds,
                                            args.tma))  # fmt: skip
            _write(report, args.out)
    _write(report, args.out)
    if not report.get("all_ok", True):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
