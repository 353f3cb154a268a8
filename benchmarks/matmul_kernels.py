"""Matmul groups (``fusebackend.kernels.matmul.matmul_group``) vs cuBLAS + eager ops vs copy
bandwidth, for a decode step's projections (fp16, M = 1, 4, 16 rows).

Shapes (``SHAPES``): TinyLlama-1.1B (hidden 2048, intermediate 5632, 32 x 64 heads, 4 K/V
heads, vocab 32000): qkv = RMSNorm + 2048/256/256, o = 2048 x 2048 + residual, gate/up =
RMSNorm + 2 x 5632 silu-gated, down = 5632 -> 2048 + residual, lm head = RMSNorm + 32000;
Qwen2-0.5B (896, 4864, 14 x 64 heads, 2 K/V heads, qkv with bias, vocab 151936): the same
five; GPT-2 (768, 3072): LayerNorm (with bias) + c_attn 2304 + bias, LayerNorm + c_fc 3072
+ bias + NewGELU (its 8 ops, as GPT-2 writes them), c_proj 3072 -> 768 + bias +
residual and the attention's c_proj 768 -> 768 + bias + residual; each twice, with weights
[N, K] (``gpt2-*``) and stored [K, N] as GPT-2's Conv1D holds them (``gpt2-conv1d-*``,
``weight_layout`` "kn": one row runs the GEMV along N; cuBLAS gets the same storage).

Per (shape, M): ``fused_us`` (one ``matmul_group`` launch), ``eager_us`` (the eager module
sequence it replaces: transformers' RMSNorm formula or ``F.layer_norm``, one ``F.linear`` per
weight (cuBLAS), ``F.silu(gate) * up``, ``+ residual``), ``cublas_us`` (the ``F.linear``
calls alone), ``weight_mb``, ``gbs`` (bytes the group must move, weights + biases + norm
params + rows + residual + outputs, over ``fused_us``), ``fraction_of_copy`` (gbs over the
device-to-device copy bandwidth measured in the same run, read + write counted as in
``embedding_chain.copy_bandwidth_gbs``) and ``floor_us`` (those bytes at copy bandwidth).
Times: ``embedding_chain.device_ms``: 20 calls captured in one CUDA graph (a decode step is
captured), replayed between CUDA events, median. The 20 calls cycle over enough copies of the
weights (>= 192 MB in all) that the 50 MB L2 cannot hold them: a decode step reads each
layer's weights once, from HBM, and so does every variant here. Each shape's fused output is
checked against the eager sequence (``max_error_vs_eager``).

``--sweep``: for the TinyLlama and Qwen2 shapes at M = 1 and 16, launch configs (block_n in
16/32/64, block_k in 64..512 up to K, warps 2/4/8, stages 1-4 where K has that many steps),
by swapping ``fusebackend.kernels.matmul._launch_config``: first block_n x block_k (4 warps,
3 stages), then warps x stages at the best tile, then split-K (2, 4, 8 slices, at the best
config's K step and at 128) at the best config, each config checked against the reference
once; the best config per (shape, M) and the default config's time beside it go in the
JSON. ``--sweep-seconds`` caps the sweep (default 210 s; cut cases are listed).

    python benchmarks/matmul_kernels.py --out benchmarks/results/matmul_kernels_h100.json
    python benchmarks/matmul_kernels.py --sweep --out benchmarks/results/matmul_sweep_h100.json \\
        --ledger benchmarks/results/ledger.jsonl
    TRITON_INTERPRET=1 python benchmarks/matmul_kernels.py --smoke   # CPU: checks, no times
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
import zlib
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from embedding_chain import copy_bandwidth_gbs, device_ms  # noqa: E402
from row_kernels import versions  # noqa: E402

import fusebackend.kernels.matmul as matmul  # noqa: E402
from fusebackend.kernels.matmul import LaunchConfig, MatmulGroup  # noqa: E402

ROWS = (1, 4, 16)
SWEEP_ROWS = (1, 16)
SWEEP_MODELS = ("tinyllama", "qwen2")
LEDGER_PATH = "benchmarks/results/ledger.jsonl"
ROTATE_BYTES = 192 * 2**20  # weights cycled per timed graph: well past an H100's 50 MB L2


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    model: str
    k: int
    widths: tuple[int, ...]
    norm: str = ""  # "", "rms", "layer" (with bias)
    bias: bool = False
    gate: str = ""
    residual: bool = False
    activation: str = ""
    layout: str = "nk"  # the weights stored [N, K] (nn.Linear) or [K, N] (GPT-2's Conv1D)

    @property
    def group(self) -> MatmulGroup:
        eps = {"rms": 1e-6, "layer": 1e-5}.get(self.norm, 0.0)
        return MatmulGroup(siblings=len(self.widths), norm=self.norm, eps=eps,
                           norm_bias=self.norm == "layer", gate=self.gate, bias=self.bias,
                           residual=self.residual, activation=self.activation,
                           weight_layout=self.layout)  # fmt: skip

    @property
    def out_width(self) -> int:
        return self.widths[0] if self.gate else sum(self.widths)


def _model(model, hidden, inter, q, kv, vocab, bias_qkv):
    return [
        Shape(f"{model}-qkv", model, hidden, (q, kv, kv), "rms", bias=bias_qkv),
        Shape(f"{model}-o", model, q, (hidden,), residual=True),
        Shape(f"{model}-gate-up", model, hidden, (inter, inter), "rms", gate="silu"),
        Shape(f"{model}-down", model, inter, (hidden,), residual=True),
        Shape(f"{model}-lm-head", model, hidden, (vocab,), "rms"),
    ]


def _gpt2(prefix: str, layout: str) -> list[Shape]:
    return [
        Shape(f"{prefix}-c-attn", "gpt2", 768, (2304,), "layer", bias=True, layout=layout),
        Shape(f"{prefix}-c-fc", "gpt2", 768, (3072,), "layer", bias=True,
              activation="gelu_new", layout=layout),
        Shape(f"{prefix}-mlp-c-proj", "gpt2", 3072, (768,), bias=True, residual=True,
              layout=layout),
        Shape(f"{prefix}-attn-c-proj", "gpt2", 768, (768,), bias=True, residual=True,
              layout=layout),
        # the LM head: ln_f, then the token embedding [50257, 768] (tied: stored [N, K])
        Shape(f"{prefix}-lm-head", "gpt2", 768, (50257,), "layer"),
    ]  # fmt: skip


SHAPES = [
    *_model("tinyllama", 2048, 5632, 32 * 64, 4 * 64, 32000, False),
    *_model("qwen2", 896, 4864, 14 * 64, 2 * 64, 151936, True),
    *_gpt2("gpt2", "nk"),
    *_gpt2("gpt2-conv1d", "kn"),
]

# --smoke: one tiny shape of each kind (interpreter-sized)
SMOKE_SHAPES = [
    Shape("smoke-qkv-bias", "smoke", 64, (64, 16, 16), "rms", bias=True),
    Shape("smoke-o-residual", "smoke", 64, (64,), residual=True),
    Shape("smoke-gate-up", "smoke", 64, (96, 96), "rms", gate="silu"),
    Shape("smoke-down-residual", "smoke", 96, (64,), residual=True),
    Shape("smoke-lm-head", "smoke", 64, (97,), "rms"),
    Shape("smoke-layer-bias", "smoke", 48, (144,), "layer", bias=True, activation="gelu_new"),
    Shape("smoke-bias-residual", "smoke", 144, (48,), bias=True, residual=True),
    Shape("smoke-conv1d", "smoke", 48, (144,), "layer", bias=True, layout="kn"),
]


class Weights:
    """One set of a shape's parameters (fp16, scaled so outputs are of order 1)."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, g) -> None:
        def rand(*size, scale=1.0):
            return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)

        k = shape.k
        # the launch's arguments, stored as the shape says; ``linear`` sees them as [N, K]
        if shape.layout == "kn":
            self.weights = [rand(k, n, scale=k**-0.5) for n in shape.widths]
            self.linear = [w.t() for w in self.weights]
        else:
            self.weights = self.linear = [rand(n, k, scale=k**-0.5) for n in shape.widths]
        self.biases = [rand(n, scale=0.1) for n in shape.widths] if shape.bias else []
        self.norm_weight = 1.0 + rand(k, scale=0.1) if shape.norm else None
        self.norm_bias = rand(k, scale=0.1) if shape.norm == "layer" else None

    @property
    def nbytes(self) -> int:
        tensors = [*self.weights, *self.biases, self.norm_weight, self.norm_bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def eager_sequence(shape: Shape, p: Weights, x, residual):
    """The eager ops the group replaces (transformers' spellings)."""
    a = x
    if shape.norm == "rms":  # LlamaRMSNorm.forward
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + shape.group.eps)
        a = p.norm_weight * h.to(x.dtype)
    elif shape.norm == "layer":
        a = F.layer_norm(x, (shape.k,), p.norm_weight, p.norm_bias, shape.group.eps)
    ys = [F.linear(a, w, p.biases[i] if shape.bias else None) for i, w in enumerate(p.linear)]
    if shape.gate:
        ys = [F.silu(ys[0]) * ys[1]]
    if shape.activation == "gelu_new":  # transformers' NewGELUActivation, op by op
        y = ys[0]
        ys = [0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y**3.0)))]
    if shape.residual:
        ys = [ys[0] + residual]
    return tuple(ys)


def cublas_only(shape: Shape, p: Weights, x):
    """The linears alone (what a matmul costs on cuBLAS, nothing around it)."""
    return tuple(
        F.linear(x, w, p.biases[i] if shape.bias else None) for i, w in enumerate(p.linear)
    )


def fused(shape: Shape, p: Weights, x, residual):
    return matmul.matmul_group(shape.group, x, p.norm_weight, p.norm_bias, residual,
                               *p.weights, *p.biases)  # fmt: skip


def max_error(out, ref) -> float:
    return max(float((o.float() - r.float()).abs().max()) for o, r in zip(out, ref))


def within(out, ref, dtype) -> bool:
    """fp16's tolerance (helpers.tol): atol = rtol = 1e-2 (bf16: 2e-2)."""
    t = 2e-2 if dtype == torch.bfloat16 else 1e-2 if dtype == torch.float16 else 1e-4
    return all(
        bool(((o.float() - r.float()).abs() <= t + t * r.float().abs()).all())
        for o, r in zip(out, ref)
    )


class Case:
    """A shape at M rows: the weight copies a timed graph cycles over, rows and residual."""

    def __init__(self, shape: Shape, rows: int, device, dtype, copies: int | None = None):
        g = torch.Generator(device=device).manual_seed(zlib.crc32(shape.name.encode()))
        first = Weights(shape, device, dtype, g)
        if copies is None:
            copies = max(1, min(20, math.ceil(ROTATE_BYTES / first.nbytes)))
        self.shape, self.rows = shape, rows
        self.params = [first] + [Weights(shape, device, dtype, g) for _ in range(copies - 1)]
        self.x = torch.randn(rows, shape.k, generator=g, device=device).to(dtype)
        self.residual = (
            torch.randn(rows, shape.out_width, generator=g, device=device).to(dtype)
            if shape.residual
            else None
        )
        self.weight_bytes = first.nbytes
        out_elems = rows * shape.out_width
        self.moved = (first.nbytes + self.x.numel() * 2 + out_elems * 2
                      + (out_elems * 2 if shape.residual else 0))  # fmt: skip

    def cycling(self, fn):
        """``fn(params)`` over the weight copies in turn, one copy per call."""
        turn = itertools.cycle(self.params)
        return lambda: fn(next(turn))

    def fused(self, p=None):
        return fused(self.shape, p or self.params[0], self.x, self.residual)

    def eager(self, p=None):
        return eager_sequence(self.shape, p or self.params[0], self.x, self.residual)

    def reference(self, p=None):
        p = p or self.params[0]
        return matmul.reference(self.shape.group, self.x, p.norm_weight, p.norm_bias,
                                self.residual, tuple(p.linear), tuple(p.biases))  # fmt: skip


def timed_us(case: Case, fn, reps: int = 10) -> float:
    with torch.no_grad():
        return device_ms(case.cycling(fn), calls=20, reps=reps) * 1e3


def measure(case: Case, copy_gbs: float) -> dict[str, Any]:
    shape = case.shape
    with torch.no_grad():
        out, ref = case.fused(), case.eager()
    row: dict[str, Any] = {
        "shape": shape.name, "model": shape.model, "rows": case.rows, "k": shape.k,
        "widths": list(shape.widths), "group": shape.group.describe(),
        "default_config": dataclasses.asdict(_default_config(case)),
        "max_error_vs_eager": max_error(out, ref), "ok": within(out, ref, case.x.dtype),
        "weight_mb": case.weight_bytes / 1e6, "bytes": case.moved,
        "weight_copies_cycled": len(case.params),
    }  # fmt: skip
    row["fused_us"] = timed_us(case, case.fused)
    row["eager_us"] = timed_us(case, case.eager)
    row["cublas_us"] = timed_us(case, lambda p: cublas_only(shape, p, case.x))
    row["gbs"] = case.moved / row["fused_us"] / 1e3
    row["fraction_of_copy"] = row["gbs"] / copy_gbs
    row["floor_us"] = case.moved / copy_gbs / 1e3
    row["speedup_vs_eager"] = row["eager_us"] / row["fused_us"]
    return row


def _default_config(case: Case) -> LaunchConfig:
    shape = case.shape
    # the weights are contiguous along K or (Conv1D's) along N, and no group has a head
    # norm: GEMV allowed
    return matmul.launch_config(case.rows, shape.k, shape.out_width, bool(shape.gate),
                                gemv=True, along_n=shape.layout == "kn")  # fmt: skip


# ---- --sweep


def _stages(k: int, block_k: int) -> tuple[int, ...]:
    steps = -(-k // block_k)
    return tuple(s for s in (1, 2, 3, 4) if s == 1 or s <= steps)


def _fits(shape: Shape, config: LaunchConfig) -> bool:
    """Shared memory of the pipeline: stages x (rows tile + weight tiles) in fp16, under
    an H100's 227 KB per block."""
    tiles = 16 * config.block_k + config.block_n * config.block_k * (2 if shape.gate else 1)
    return config.stages * tiles * 2 <= 200 * 1024


def try_config(
    case: Case, config: LaunchConfig, checked: dict, timing: bool = True
) -> float | None:
    """Device us of one launch with ``config`` (0.0 without ``timing``); None where it fails
    or gives a wrong answer (checked once per (shape, config) against the reference)."""
    matmul._launch_config = lambda *a: config
    try:
        key = (case.shape.name, config)
        if key not in checked:
            with torch.no_grad():
                checked[key] = within(case.fused(), case.reference(), case.x.dtype)
        if not checked[key]:
            return None
        return timed_us(case, case.fused, reps=5) if timing else 0.0
    except Exception as error:  # out of resources, compile errors: the config is out
        checked[(case.shape.name, config)] = False
        print(f"  {case.shape.name} M={case.rows} {config}: {type(error).__name__}: {error}")
        return None
    finally:
        matmul._launch_config = matmul.launch_config


def sweep(case: Case, deadline: float, checked: dict) -> dict[str, Any]:
    shape = case.shape
    k = shape.k
    block_ks = [b for b in (64, 128, 256, 512) if b <= max(64, 1 << (k - 1).bit_length())]
    tried: list[dict[str, Any]] = []

    def run(config: LaunchConfig) -> float | None:
        if any(t["config"] == dataclasses.asdict(config) for t in tried):
            return next(t["us"] for t in tried if t["config"] == dataclasses.asdict(config))
        us = try_config(case, config, checked) if _fits(shape, config) else None
        tried.append({"config": dataclasses.asdict(config), "us": us})
        return us

    cut = False
    best: tuple[float, LaunchConfig] | None = None
    # 1: the tile at 4 warps and up to 3 stages
    for block_n, block_k in itertools.product((16, 32, 64), block_ks):
        if time.perf_counter() > deadline:
            cut = True
            break
        config = LaunchConfig(block_n, block_k, 4, max(_stages(k, block_k)[:3]))
        us = run(config)
        if us is not None and (best is None or us < best[0]):
            best = (us, config)
    # 2: warps x stages at the best tile
    if best is not None:
        tile = best[1]
        for warps, stages in itertools.product((2, 4, 8), _stages(k, tile.block_k)):
            if time.perf_counter() > deadline:
                cut = True
                break
            config = LaunchConfig(tile.block_n, tile.block_k, warps, stages)
            us = run(config)
            if us is not None and us < best[0]:
                best = (us, config)
    # 3: split-K at the best config, and at the narrower K steps a split leaves room for
    if best is not None:
        at = best[1]
        for split, block_k in itertools.product((2, 4, 8), sorted({at.block_k, 128})):
            if time.perf_counter() > deadline:
                cut = True
                break
            if -(-k // block_k) < split:  # fewer K steps than slices
                continue
            stages = min(at.stages, max(_stages(k // split, block_k)))
            config = dataclasses.replace(at, block_k=block_k, split_k=split, stages=stages)
            us = run(config)
            if us is not None and us < best[0]:
                best = (us, config)
    default = _default_config(case)
    default_us = run(default)
    if default_us is not None and (best is None or default_us < best[0]):
        best = (default_us, default)
    return _sweep_result(case, best, default, default_us, cut, tried)


def _sweep_result(case: Case, best: tuple[float, LaunchConfig] | None, default: LaunchConfig,
                  default_us: float | None, cut: bool, tried: list[dict[str, Any]],
                  gemv: bool = False) -> dict[str, Any]:  # fmt: skip
    """One swept case's JSON record (``gemv``: a --sweep-gemv case), printed in a line."""
    result = {
        "shape": case.shape.name, "rows": case.rows, **({"gemv": True} if gemv else {}),
        "best_config": dataclasses.asdict(best[1]) if best else None,
        "best_us": best[0] if best else None,
        "default_config": dataclasses.asdict(default), "default_us": default_us,
        "default_over_best": default_us / best[0] if best and default_us else None,
        "cut_by_time": cut, "tried": tried,
    }  # fmt: skip
    print(f"{'gemv sweep' if gemv else 'sweep'} {case.shape.name} M={case.rows}: best "
          f"{result['best_config']} {result['best_us'] or float('nan'):.1f} us, default "
          f"{default} {default_us or float('nan'):.1f} us ({len(tried)} configs)")  # fmt: skip
    return result


def sweep_gemv(case: Case, deadline: float, checked: dict) -> dict[str, Any]:
    """One row's GEMV launch configs (``LaunchConfig.gemv``; stages unused): the tile
    (columns x K step) at 4 warps and the default's K slices, then warps x K slices at the
    best tile; the default config beside the best."""
    shape, default = case.shape, _default_config(case)
    along_n = shape.layout == "kn"
    block_ns = (8, 16, 32, 64, 128) if along_n else (1, 2, 4, 8, 16)
    # along N up to 1024-wide K steps: GPT-2's K of 768 in one step (one latency of loads a
    # program, not three), which the first sweep (up to 256) never tried
    block_ks = (32, 64, 128, 256, 512, 1024) if along_n else (128, 256, 512, 1024)
    tried: list[dict[str, Any]] = []
    best: tuple[float, LaunchConfig] | None = None
    cut = False

    def run(config: LaunchConfig) -> None:
        nonlocal best
        if any(t["config"] == dataclasses.asdict(config) for t in tried):
            return
        us = try_config(case, config, checked)
        tried.append({"config": dataclasses.asdict(config), "us": us})
        if us is not None and (best is None or us < best[0]):
            best = (us, config)

    for block_n, block_k in itertools.product(block_ns, block_ks):
        if time.perf_counter() > deadline:
            cut = True
            break
        run(LaunchConfig(block_n, min(block_k, matmul.widest_k_step(shape.k)), 4, 1,
                         split_k=default.split_k, gemv=True))  # fmt: skip
    tile = best[1] if best else default
    for warps, split in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        if time.perf_counter() > deadline:
            cut = True
            break
        if split == 1 or shape.k // split >= tile.block_k:  # a one-step tile keeps split 1
            run(dataclasses.replace(tile, warps=warps, split_k=split))
    run(default)
    default_us = next(t["us"] for t in tried if t["config"] == dataclasses.asdict(default))
    return _sweep_result(case, best, default, default_us, cut, tried, gemv=True)


# ---- output


def ledger_rows(report: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """One ledger row per (shape, M, variant) time: workload matmul-SHAPE-mM."""
    rows = []
    for r in report["shapes"]:
        workload = f"matmul-{r['shape']}-m{r['rows']}"
        for backend, key in (("infinifuse", "fused_us"), ("eager", "eager_us"),
                             ("cublas-linear", "cublas_us")):  # fmt: skip
            rows.append({"workload": workload, "backend": backend, "metric": "device_us",
                         "value": r[key], "unit": "us", "source": source})  # fmt: skip
    for s in report.get("sweep", []):
        if s["best_us"] is not None:
            rows.append({"workload": f"matmul-{s['shape']}-m{s['rows']}",
                         "backend": "infinifuse-swept-best", "metric": "device_us",
                         "value": s["best_us"], "unit": "us", "source": source})  # fmt: skip
    env = {k: report.get(k) for k in ("device", "torch", "triton", "transformers", "date")}
    return [{**row, **env} for row in rows]


def smoke() -> dict[str, Any]:
    """Each kind of shape once, tiny, checked against the eager sequence and the reference,
    with the default config and with a swapped one; no timing (CPU + TRITON_INTERPRET=1)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from fusebackend.kernels.triton_api import triton_usable

    if not triton_usable(device):
        raise SystemExit("--smoke needs a GPU or TRITON_INTERPRET=1")
    results = []
    for shape, dtype in zip(SMOKE_SHAPES, itertools.cycle((torch.float16, torch.float32))):
        case = Case(shape, 3, device, dtype, copies=1)
        row = {"shape": shape.name, "group": shape.group.describe(), "rows": 3,
               "dtype": str(dtype)}  # fmt: skip
        with torch.no_grad():
            out, ref = case.fused(), case.eager()
            row["max_error_vs_eager"] = max_error(out, ref)
            row["ok"] = within(out, ref, dtype)
            swapped = try_config(case, LaunchConfig(32, 64, 4, 2), {}, timing=False)
            row["swapped_config_ok"] = swapped is not None
            split = LaunchConfig(16, 16, 4, 2, split_k=3)  # the sweep's split-K path
            row["split_config_ok"] = try_config(case, split, {}, timing=False) is not None
        results.append(row)
        print(f"smoke {shape.name}: max error {row['max_error_vs_eager']:.2e} ok={row['ok']}")
    return {
        **versions(),
        "benchmark": "matmul_kernels",
        "smoke": True,
        "shapes": results,
        "all_ok": all(r["ok"] and r["swapped_config_ok"] and r["split_config_ok"] for r in results),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--ledger", metavar="PATH", nargs="?", const=LEDGER_PATH,
                        help="also append the figures to the results ledger at PATH "
                        "(default: %(const)s)")  # fmt: skip
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default all)")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs")
    parser.add_argument(
        "--sweep-gemv",
        action="store_true",
        help="sweep one row's GEMV configs for the shapes given (M = 1)",
    )
    parser.add_argument("--sweep-seconds", type=float, default=210.0)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (CPU ok)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        report = smoke()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("matmul_kernels.py times CUDA kernels: no CUDA device (try --smoke)")
        device, dtype = torch.device("cuda"), torch.float16
        copy = copy_bandwidth_gbs(device, 0.25)  # 256 MB each way
        copy_gbs = copy["ceiling"]
        names = set(filter(None, args.shapes.split(",")))
        shapes = [s for s in SHAPES if not names or s.name in names]
        rows = [int(r) for r in args.rows.split(",")]
        report = {**versions(), "benchmark": "matmul_kernels", "dtype": "float16",
                  "copy_gbs": copy, "shapes": []}  # fmt: skip
        print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
        print(f"{'shape':22} {'M':>3} {'fused us':>9} {'eager us':>9} {'cublas us':>9} "
              f"{'weight MB':>9} {'GB/s':>6} {'copy %':>6}")  # fmt: skip
        for shape in shapes:
            for m in rows:
                case = Case(shape, m, device, dtype)
                row = measure(case, copy_gbs)
                report["shapes"].append(row)
                print(f"{shape.name:22} {m:3} {row['fused_us']:9.1f} {row['eager_us']:9.1f} "
                      f"{row['cublas_us']:9.1f} {row['weight_mb']:9.1f} {row['gbs']:6.0f} "
                      f"{row['fraction_of_copy'] * 100:5.0f}%"
                      f"{'' if row['ok'] else '  WRONG vs eager'}")  # fmt: skip
                del case
        if args.sweep:
            end = time.perf_counter() + args.sweep_seconds
            checked: dict = {}
            report["sweep"] = []
            cases = [(s, m) for s in shapes if s.model in SWEEP_MODELS for m in SWEEP_ROWS]
            for i, (shape, m) in enumerate(cases):
                # each case gets an equal share of the time left (M = 16 reuses M = 1's
                # compiled configs, so its unused share rolls on to the next shape)
                now = time.perf_counter()
                case = Case(shape, m, device, dtype)
                report["sweep"].append(sweep(case, now + (end - now) / (len(cases) - i), checked))
                del case
        if args.sweep_gemv:
            end = time.perf_counter() + args.sweep_seconds
            checked = {}
            report.setdefault("sweep", [])
            for i, shape in enumerate(shapes):
                now = time.perf_counter()
                case = Case(shape, 1, device, dtype)
                share = now + (end - now) / (len(shapes) - i)
                report["sweep"].append(sweep_gemv(case, share, checked))
                del case
        report["all_ok"] = all(r["ok"] for r in report["shapes"])
    report["seconds"] = time.perf_counter() - started
    print(f"took {report['seconds']:.0f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    if args.ledger and not args.smoke:
        import ledger  # benchmarks/ledger.py, beside this file

        source = os.path.basename(args.out) if args.out else "matmul_kernels"
        written = ledger.append(ledger_rows(report, source), args.ledger)
        print(f"ledger: {len(written)} rows -> {args.ledger}")


if __name__ == "__main__":
    main()
