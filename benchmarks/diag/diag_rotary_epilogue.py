"""Does the q/k/v matmul group's rotary + KV-cache-write epilogue pay for itself, and at
which launch config? (a decode step's attention input, one launch instead of three)

``MatmulGroup(siblings=3, norm="rms", rotary=D, cache_write=True)`` (kernels/matmul.py)
makes the q/k/v launch rotate q and k (transformers' ``apply_rotary_pos_emb``) and write k
and v into StaticCache-style caches at ``index`` (``index_copy_``), returning only q. Its
launch parameters (``matmul.launch_config``'s gated branch, ``outputs`` = Nq/2 + Nk/2 + Nv
columns: 16-column tiles below 80 x 32 columns) were guessed, never measured. This diag
times, for TinyLlama-1.1B (K 2048, 32 q heads, 4 K/V heads of 64, no bias) and Qwen2-0.5B
(K 896, 14 q heads, 2 K/V heads of 64, q/k/v biases), caches of 2048 slots, B = 1 and 16
rows of T = 1 new token, fp16:

- ``fused_us``: the one launch (RMSNorm + q/k/v + rotary + cache write);
- ``before_us``: what the backend ran before it: the plain q/k/v ``matmul_group`` launch
  (returns q, k, v), the rotation of q and k by the backend's own fused row kernel (the
  rotation compiled with ``torch.compile(backend="infinifuse")``: one paired pointwise
  launch for q and k, as the backend fuses it in a decode graph; its kernels and launches
  are recorded in ``before_rotation``) and ``cache_write.write_cache_pair`` (one launch);
- ``qkv_only_us``: the plain q/k/v launch alone (the lower bound of "before": what the
  epilogue must stay close to);
- ``eager_us``: transformers' eager sequence (LlamaRMSNorm's formula, three ``F.linear``,
  view/transpose, ``apply_rotary_pos_emb``, two ``index_copy_``).

Every variant's q and both caches (every slot) are checked once against the eager sequence
before timing (``max_error_vs_eager``, ``ok`` at rtol = atol = 1e-2 in fp16; qkv_only's q,
k, v against eager's linear outputs): a wrong variant is reported with ``ok: false`` and
never timed. Per (shape, B): bytes the fused launch must move (weights, biases and norm
weight, the rows, q, cos and sin, the k and v rows written into the caches), its GB/s and
fraction of copy bandwidth (``embedding_chain.copy_bandwidth_gbs``, read + write) and the
floor those bytes take at copy bandwidth.

Times: ``embedding_chain.device_ms``: the calls captured in one CUDA graph (a decode step is
captured), replayed between CUDA events, median. Each call uses the next of enough copies
of the layer (weights and its own caches; >= 192 MB of weights, at least 20 calls) that the
50 MB L2 cannot hold them: a decode step reads each layer's weights once, from HBM.

``--sweep``: for one row, the tensor-core split-K config launch_config picked before GEMV
launches and GEMV tiles (2-8 columns, 256-1024-wide K steps, 4 or 8 warps); the fused
launch in 2-4 K slices (split-K, see SWEEP_SPLITS), then at
block_n (16, 32, 64) x block_k (64, 128, 256) x warps (2,
4, 8) x stages (2, 3, 4), by swapping ``matmul._launch_config`` (read at each launch): the
default config, each tile at 4 warps and 3 stages, warps x stages at the best tile, then the
rest; configs whose pipeline cannot fit an H100's shared memory are skipped as such, every
other one is checked once against eager before it is timed.
``--sweep-seconds`` (default 150) is shared out over the (shape, B) cases; what did not fit
is listed per case (``cut``). The best config per case goes in the JSON beside the default's
time. The exit status is 1 when any variant was wrong (the JSON is written first). Not yet
run on a GPU: only ``--smoke`` has run (Triton's interpreter).

    python benchmarks/diag/diag_rotary_epilogue.py --out /tmp/rotary_epilogue.json
    python benchmarks/diag/diag_rotary_epilogue.py --sweep --out /tmp/rotary_epilogue.json
    TRITON_INTERPRET=1 python benchmarks/diag/diag_rotary_epilogue.py --smoke   # CPU: checks
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from embedding_chain import copy_bandwidth_gbs, device_ms  # noqa: E402  (benchmarks/)
from row_kernels import versions  # noqa: E402

import fusebackend.kernels.matmul as matmul  # noqa: E402
from fusebackend.kernels.cache_write import write_cache_pair  # noqa: E402
from fusebackend.kernels.matmul import LaunchConfig, MatmulGroup  # noqa: E402

BATCHES = (1, 16)
ROTATE_BYTES = 192 * 2**20  # weights cycled per timed graph: well past an H100's 50 MB L2
EPS = 1e-6
# --sweep's grid (81 configs; those past shared memory are skipped, see _fits)
SWEEP_BLOCK_N = (16, 32, 64)
SWEEP_BLOCK_K = (64, 128, 256)
SWEEP_WARPS = (2, 4, 8)
SWEEP_STAGES = (2, 3, 4)
# ... and first, split-K: 2-4 slices of K at 16 or 32 columns, 128- or 256-wide K steps,
# 2 or 4 warps, 3 stages (a rotary launch has few programs: TinyLlama's 88, Qwen2's 40)
SWEEP_SPLITS = (2, 3, 4)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    k: int
    q_heads: int
    kv_heads: int
    head_dim: int
    bias: bool
    slots: int
    seq: int = 1  # new tokens per step (T)

    @property
    def widths(self) -> tuple[int, int, int]:
        kv = self.kv_heads * self.head_dim
        return self.q_heads * self.head_dim, kv, kv

    @property
    def fused_group(self) -> MatmulGroup:
        return MatmulGroup(siblings=3, norm="rms", eps=EPS, bias=self.bias,
                           rotary=self.head_dim, cache_write=True,
                           index_checks=False)  # fmt: skip

    @property
    def plain_group(self) -> MatmulGroup:
        return MatmulGroup(siblings=3, norm="rms", eps=EPS, bias=self.bias)

    @property
    def launch_columns(self) -> int:
        """The ``outputs`` a rotary launch asks its config for: q's and k's programs each
        cover a column and its rotate_half partner."""
        q, k, v = self.widths
        return q // 2 + k // 2 + v


SHAPES = [
    Shape("tinyllama-qkv-rotary", 2048, 32, 4, 64, bias=False, slots=2048),
    Shape("qwen2-qkv-rotary", 896, 14, 2, 64, bias=True, slots=2048),
    Shape("llama3-8b-qkv-rotary", 4096, 32, 8, 128, bias=False, slots=2048),
    Shape("llama3-8b-tp2-qkv-rotary", 4096, 16, 4, 128, bias=False, slots=2048),
]
# --smoke: interpreter-sized; T = 2 once, so a program's rows span tokens and batches
SMOKE_SHAPES = [
    Shape("smoke-qkv-rotary", 64, 4, 2, 16, bias=False, slots=8),
    Shape("smoke-qkv-rotary-bias", 64, 4, 2, 16, bias=True, slots=8),
    Shape("smoke-qkv-rotary-t2", 64, 4, 2, 16, bias=True, slots=8, seq=2),
]
SMOKE_BATCHES = (1, 2)


class Layer:
    """One layer's q/k/v parameters and its own K and V caches ``[B, Hkv, slots, D]``."""

    def __init__(self, shape: Shape, batch: int, device, dtype, g) -> None:
        def rand(*size, scale=1.0):
            return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)

        self.weights = [rand(n, shape.k, scale=shape.k**-0.5) for n in shape.widths]
        self.biases = [rand(n, scale=0.1) for n in shape.widths] if shape.bias else []
        self.norm_weight = 1.0 + rand(shape.k, scale=0.1)
        size = (batch, shape.kv_heads, shape.slots, shape.head_dim)
        # random, not zero: a write to a wrong slot must show in the check
        self.k_cache, self.v_cache = rand(*size), rand(*size)

    @property
    def nbytes(self) -> int:
        tensors = [*self.weights, *self.biases, self.norm_weight]
        return sum(t.numel() * t.element_size() for t in tensors)

    def with_fresh_caches(self) -> Layer:
        """The same parameters with copies of the caches (each check starts from the same
        cache contents)."""
        other = object.__new__(Layer)
        other.__dict__.update(self.__dict__)
        other.k_cache, other.v_cache = self.k_cache.clone(), self.v_cache.clone()
        return other


# ---- The variants: each takes a layer, writes its caches, returns q as [B, Hq, T, D]


def eager(shape: Shape, p: Layer, h, cos, sin, index):
    """transformers' Llama attention input as its modeling code writes it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    batch, seq, _ = h.shape
    x = h.to(torch.float32)  # LlamaRMSNorm.forward
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    x = p.norm_weight * x.to(h.dtype)
    bias = p.biases if shape.bias else [None] * 3
    q, k, v = (F.linear(x, w, b).view(batch, seq, -1, shape.head_dim).transpose(1, 2)
               for w, b in zip(p.weights, bias))  # fmt: skip
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    p.k_cache.index_copy_(2, index, k)
    p.v_cache.index_copy_(2, index, v)
    return q


def eager_linears(shape: Shape, p: Layer, h):
    """Eager's q, k, v before the rotation, ``[B, T, N_i]`` (what qkv_only returns)."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    x = p.norm_weight * x.to(h.dtype)
    bias = p.biases if shape.bias else [None] * 3
    return tuple(F.linear(x, w, b) for w, b in zip(p.weights, bias))


def fused(shape: Shape, p: Layer, h, cos, sin, index):
    batch, seq, _ = h.shape
    (q,) = matmul.matmul_group(shape.fused_group, h, p.norm_weight, None, None, *p.weights,
                               *p.biases, cos[:, None], sin[:, None], p.k_cache, p.v_cache,
                               index)  # fmt: skip
    return q.view(batch, seq, -1, shape.head_dim).transpose(1, 2)


def qkv_only(shape: Shape, p: Layer, h):
    return matmul.matmul_group(shape.plain_group, h, p.norm_weight, None, None, *p.weights,
                               *p.biases)  # fmt: skip


def _rotate_qk(q, k, cos, sin, head_dim: int):
    """The rotation as a decode graph has it between the q/k/v launch and the cache write."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    batch, seq = q.shape[:2]
    q = q.view(batch, seq, -1, head_dim).transpose(1, 2)
    k = k.view(batch, seq, -1, head_dim).transpose(1, 2)
    return apply_rotary_pos_emb(q, k, cos, sin)


@functools.cache
def rotation(head_dim: int):
    """The rotation of q and k compiled by the backend (its fused row kernel: one paired
    launch). Its own CUDA graphs off: the timing captures it; validation off: a wrong kernel
    must show in the check, not be replaced by the traced ops."""
    fn = functools.partial(_rotate_qk, head_dim=head_dim)
    # Dynamo keeps its compiles per code object (_rotate_qk's, shared by every partial): the
    # smoke's 8 signatures (dtype x B x T) reach its default limit of 8 recompiles, past
    # which it would run the rotation eagerly without a word
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    return torch.compile(fn, backend="infinifuse", dynamic=False, fullgraph=True,
                         options={"cudagraphs": False, "validate": False})  # fmt: skip


def before(shape: Shape, p: Layer, h, cos, sin, index):
    """The backend before the epilogue: q/k/v launch, rotation launch, cache-pair launch."""
    batch, seq, _ = h.shape
    q, k, v = qkv_only(shape, p, h)
    q, k = rotation(shape.head_dim)(q, k, cos, sin)
    v = v.view(batch, seq, -1, shape.head_dim).transpose(1, 2)
    write_cache_pair(p.k_cache, p.v_cache, index, k, v, False)
    return q


# ---- Checks


def tolerance(dtype: torch.dtype) -> float:
    return 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4


def compare(outs, refs, dtype) -> tuple[float, bool]:
    """(max abs error, every element within rtol = atol = tolerance(dtype))."""
    t = tolerance(dtype)
    error, ok = 0.0, True
    for o, r in zip(outs, refs, strict=True):
        o, r = o.float(), r.float()
        error = max(error, float((o - r).abs().max()))
        ok = ok and bool(((o - r).abs() <= t + t * r.abs()).all())
    return error, ok


class Case:
    """A shape at B rows of T tokens: layer copies a timed graph cycles over, its rows,
    cos and sin ``[B, T, D]`` (as transformers' rotary embedding gives them) and slots."""

    def __init__(self, shape: Shape, batch: int, device, dtype, copies: int | None = None):
        g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{shape.name}".encode()))
        first = Layer(shape, batch, device, dtype, g)
        if copies is None:
            copies = max(1, math.ceil(ROTATE_BYTES / first.nbytes))
        self.shape, self.batch, self.dtype = shape, batch, dtype
        self.layers = [first] + [Layer(shape, batch, device, dtype, g) for _ in range(copies - 1)]
        seq, d = shape.seq, shape.head_dim
        self.h = torch.randn(batch, seq, shape.k, generator=g, device=device).to(dtype)
        # positions near the end of the cache, every other slot: a slot off by one shows
        self.index = torch.arange(seq, device=device) * 2 + max(0, shape.slots - 2 * seq - 1)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
        angles = self.index.float()[:, None] * inv_freq[None]
        emb = torch.cat((angles, angles), dim=-1).expand(batch, seq, d)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.weight_bytes = first.nbytes
        size = dtype.itemsize
        rows = batch * seq
        q, kv, _ = shape.widths
        self.moved = (first.nbytes + rows * shape.k * size + rows * q * size
                      + 2 * rows * kv * size + 2 * rows * d * size)  # fmt: skip

    def call(self, name: str, p: Layer):
        if name == "qkv_only":
            return qkv_only(self.shape, p, self.h)
        fn = {"fused": fused, "before": before, "eager": eager}[name]
        return fn(self.shape, p, self.h, self.cos, self.sin, self.index)

    def check(self, name: str) -> dict[str, Any]:
        """Variant ``name`` once on the first layer (fresh caches) against eager."""
        base = self.layers[0]
        want = base.with_fresh_caches()
        got = base.with_fresh_caches()
        with torch.no_grad():
            if name == "qkv_only":
                outs, refs = self.call(name, got), eager_linears(self.shape, want, self.h)
            else:
                q_ref = eager(self.shape, want, self.h, self.cos, self.sin, self.index)
                outs = (self.call(name, got), got.k_cache, got.v_cache)
                refs = (q_ref, want.k_cache, want.v_cache)
        error, ok = compare(outs, refs, self.dtype)
        return {"max_error_vs_eager": error, "ok": ok}

    def timed_us(self, name: str, reps: int = 10) -> float:
        turn = itertools.cycle(self.layers)
        calls = max(20, len(self.layers))
        with torch.no_grad():
            return device_ms(lambda: self.call(name, next(turn)), calls=calls, reps=reps) * 1e3


def default_config(case: Case) -> LaunchConfig:
    shape = case.shape
    return matmul.launch_config(case.batch * shape.seq, shape.k, shape.launch_columns, True,
                                rotary=True, gemv=True)  # fmt: skip


VARIANTS = ("fused", "before", "qkv_only", "eager")


def before_rotation_report(case: Case) -> dict[str, Any]:
    """What the backend made of the rotation on this case's tensors: the kernels and
    launches of the graph that ran this signature, and whether it ran fused (every group a
    Triton kernel, the runtime in its fusion mode)."""
    import fusebackend

    with torch.no_grad():  # compiled for this case's shapes (dynamic=False), or a guard hit
        q, k, _ = qkv_only(case.shape, case.layers[0], case.h)
        rotation(case.shape.head_dim)(q, k, case.cos, case.sin)
    # A guard hit compiles nothing, so the last report may be another signature's: the
    # graph whose runtime ran q's and k's shapes is the one
    dt, rows = str(case.dtype).removeprefix("torch."), f"{case.batch}, {case.shape.seq}"
    needle = f"{dt}[{rows}, {case.shape.widths[0]}], {dt}[{rows}, {case.shape.widths[1]}]"
    graphs = [g for g in fusebackend.reports().graphs
              if any(needle in e["key"] for e in g.runtime_modes())]  # fmt: skip
    if not graphs:
        return {"fused": False, "error": f"no compiled graph ran {needle}"}
    graph = graphs[-1]
    modes = [e for e in graph.runtime_modes() if needle in e["key"]]
    return {
        "groups": [{"kernel": g.kernel_name, "backend": g.backend, "nodes": list(g.nodes)}
                   for g in graph.groups],
        "launches": dict(graph.launches),
        "modes": sorted({e["mode"] for e in modes}),
        "signatures": [e["key"] for e in modes],
        "fused": bool(graph.groups) and all(g.backend == "triton" for g in graph.groups)
                 and {e["mode"] for e in modes} == {"fusion"},
    }  # fmt: skip


def measure(case: Case, copy_gbs: float) -> dict[str, Any]:
    shape = case.shape
    row: dict[str, Any] = {
        "shape": shape.name, "batch": case.batch, "seq": shape.seq, "k": shape.k,
        "q_heads": shape.q_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "bias": shape.bias, "slots": shape.slots, "group": shape.fused_group.describe(),
        "default_config": dataclasses.asdict(default_config(case)),
        "weight_mb": case.weight_bytes / 1e6, "bytes": case.moved,
        "layer_copies_cycled": len(case.layers),
        "before_rotation": before_rotation_report(case),
    }  # fmt: skip
    for name in VARIANTS:
        checked = case.check(name)
        row[f"{name}_max_error_vs_eager"] = checked["max_error_vs_eager"]
        row[f"{name}_ok"] = checked["ok"]
        # a wrong variant is reported, never timed
        row[f"{name}_us"] = case.timed_us(name) if checked["ok"] else None
    row["ok"] = all(row[f"{name}_ok"] for name in VARIANTS)
    if row["fused_us"]:
        row["gbs"] = case.moved / row["fused_us"] / 1e3
        row["fraction_of_copy"] = row["gbs"] / copy_gbs
        for name in ("before", "qkv_only", "eager"):
            if row[f"{name}_us"]:
                row[f"{name}_over_fused"] = row[f"{name}_us"] / row["fused_us"]
    row["floor_us"] = case.moved / copy_gbs / 1e3
    return row


# ---- --sweep


def _fits(config: LaunchConfig) -> bool:
    """Shared memory of the pipeline: stages x (rows tile + two weight tiles: a rotary
    program loads columns j and j + D/2) in fp16, under an H100's 227 KB per block."""
    tiles = 16 * config.block_k + 2 * config.block_n * config.block_k
    return config.stages * tiles * 2 <= 200 * 1024


def try_config(case: Case, config: LaunchConfig, timing: bool = True) -> dict[str, Any]:
    """The fused launch with ``config``: checked against eager, then (with ``timing``)
    timed; ``us`` None where it fails or is wrong."""
    matmul._launch_config = lambda *a: config
    entry: dict[str, Any] = {"config": dataclasses.asdict(config), "us": None}
    try:
        entry.update(case.check("fused"))
        if entry["ok"] and timing:
            entry["us"] = case.timed_us("fused", reps=5)
    except Exception as error:  # out of resources, compile errors: the config is out
        entry.update(ok=False, error=f"{type(error).__name__}: {error}"[:300])
        print(f"  {case.shape.name} B={case.batch} {config}: {entry['error']}")
    finally:
        matmul._launch_config = matmul.launch_config
    return entry


def sweep(case: Case, deadline: float) -> dict[str, Any]:
    """The default config, then each tile (block_n x block_k) at 4 warps and 3 stages, then
    warps x stages at the best tile so far, then the rest of the grid: the informative part
    first, as the deadline may cut the rest (a cold config compiles for ~1 s or more)."""
    default = default_config(case)
    tried: list[dict[str, Any]] = []
    cut: list[dict[str, int]] = []
    seen: set[LaunchConfig] = set()

    def run(config: LaunchConfig) -> None:
        if config in seen:
            return
        seen.add(config)
        if not _fits(config):
            tried.append({"config": dataclasses.asdict(config), "us": None,
                          "skipped": "pipeline past shared memory"})  # fmt: skip
        elif time.perf_counter() > deadline and config != default:
            cut.append(dataclasses.asdict(config))
        else:
            tried.append(try_config(case, config))

    def best_tile() -> LaunchConfig:
        timed = [t for t in tried if t["us"] is not None]
        if not timed:
            return default
        return LaunchConfig(**min(timed, key=lambda t: t["us"])["config"])

    run(default)
    if case.batch * case.shape.seq == 1:
        # one row: the tensor-core split-K pick before GEMV launches, then GEMV tiles
        run(LaunchConfig(32, 128, 2, 3, split_k=4))
        for block_n, block_k, warps in itertools.product((2, 4, 8), (256, 512, 1024), (4, 8)):
            run(LaunchConfig(block_n, block_k, warps, 1, gemv=True))
    for split_k, block_n, block_k, warps in itertools.product(SWEEP_SPLITS, (16, 32), (128, 256),
                                                              (2, 4)):  # fmt: skip
        run(LaunchConfig(block_n, block_k, warps, 3, split_k=split_k))
    for block_n, block_k in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K):
        run(LaunchConfig(block_n, block_k, 4, 3))
    tile = best_tile()
    for warps, stages in itertools.product(SWEEP_WARPS, SWEEP_STAGES):
        # the best tile's kind kept (a GEMV tile, a split), with its warps and stages swept
        run(dataclasses.replace(tile, warps=warps, stages=stages))
    for config in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_WARPS, SWEEP_STAGES):
        run(LaunchConfig(*config))
    timed = [t for t in tried if t["us"] is not None]
    best = min(timed, key=lambda t: t["us"]) if timed else None
    default_us = tried[0]["us"]
    result = {
        "shape": case.shape.name, "batch": case.batch,
        "best_config": best["config"] if best else None, "best_us": best["us"] if best else None,
        "default_config": dataclasses.asdict(default), "default_us": default_us,
        "default_over_best": default_us / best["us"] if best and default_us else None,
        "wrong_configs": [t["config"] for t in tried if t.get("ok") is False],
        "cut": cut, "tried": tried,
    }  # fmt: skip
    print(f"sweep {case.shape.name} B={case.batch}: best {result['best_config']} "
          f"{result['best_us'] or float('nan'):.1f} us, default {default} "
          f"{default_us or float('nan'):.1f} us ({len(tried)} tried, {len(cut)} cut)")  # fmt: skip
    return result


# ---- output


NOTE = (
    "before = the plain q/k/v matmul_group launch + the rotation of q and k compiled by "
    "torch.compile(backend='infinifuse') (the backend's fused row kernel; see "
    "before_rotation for its launches) + write_cache_pair; qkv_only = the plain q/k/v "
    "launch alone, the lower bound of before. Device time per call in CUDA graphs."
)


def smoke() -> dict[str, Any]:
    """Every variant on tiny shapes, fp32 and fp16, B = 1 and 2, checked against eager, and
    the fused launch under a swapped config; no timing (CPU + TRITON_INTERPRET=1)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from fusebackend.kernels.triton_api import triton_usable

    if not triton_usable(device):
        raise SystemExit("--smoke needs a GPU or TRITON_INTERPRET=1")
    rows = []
    for shape, dtype, batch in itertools.product(SMOKE_SHAPES, (torch.float32, torch.float16),
                                                 SMOKE_BATCHES):  # fmt: skip
        case = Case(shape, batch, device, dtype, copies=1)
        row: dict[str, Any] = {"shape": shape.name, "batch": batch, "seq": shape.seq,
                               "dtype": str(dtype), "bias": shape.bias,
                               "group": shape.fused_group.describe()}  # fmt: skip
        for name in VARIANTS:
            checked = case.check(name)
            row[f"{name}_max_error_vs_eager"] = checked["max_error_vs_eager"]
            row[f"{name}_ok"] = checked["ok"]
        swapped = try_config(case, LaunchConfig(32, 64, 4, 2), timing=False)
        row["swapped_config_ok"] = bool(swapped.get("ok"))
        row["before_rotation"] = before_rotation_report(case)
        # the "before" rotation must be the backend's fused kernel, not a silent fallback
        row["ok"] = (all(row[f"{name}_ok"] for name in VARIANTS) and row["swapped_config_ok"]
                     and row["before_rotation"]["fused"])  # fmt: skip
        rows.append(row)
        errors = " ".join(f"{n} {row[f'{n}_max_error_vs_eager']:.1e}" for n in VARIANTS)
        print(f"smoke {shape.name} {dtype} B={batch}: {errors} ok={row['ok']}")
    return {**versions(), "benchmark": "diag_rotary_epilogue", "smoke": True, "note": NOTE,
            "rows": rows, "all_ok": all(r["ok"] for r in rows)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default all)")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs")
    parser.add_argument("--sweep-seconds", type=float, default=150.0)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (CPU ok)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.smoke:
        report = smoke()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("diag_rotary_epilogue.py times CUDA kernels: no CUDA (try --smoke)")
        device, dtype = torch.device("cuda"), torch.float16
        copy = copy_bandwidth_gbs(device, 0.25)  # 256 MB each way
        copy_gbs = copy["ceiling"]
        names = set(filter(None, args.shapes.split(",")))
        shapes = [s for s in SHAPES if not names or s.name in names]
        batches = [int(b) for b in args.batches.split(",")]
        report = {**versions(), "benchmark": "diag_rotary_epilogue", "dtype": "float16",
                  "note": NOTE, "copy_gbs": copy, "rows": []}  # fmt: skip
        print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
        print(f"{'shape':22} {'B':>3} {'fused us':>9} {'before us':>9} {'qkv us':>8} "
              f"{'eager us':>9} {'copy %':>6}")  # fmt: skip
        nan = float("nan")
        for shape in shapes:
            for batch in batches:
                case = Case(shape, batch, device, dtype)
                row = measure(case, copy_gbs)
                report["rows"].append(row)
                print(f"{shape.name:22} {batch:3} {row['fused_us'] or nan:9.1f} "
                      f"{row['before_us'] or nan:9.1f} {row['qkv_only_us'] or nan:8.1f} "
                      f"{row['eager_us'] or nan:9.1f} "
                      f"{row.get('fraction_of_copy', nan) * 100:5.0f}%"
                      f"{'' if row['ok'] else '  WRONG vs eager'}")  # fmt: skip
                del case
        if args.sweep:
            end = time.perf_counter() + args.sweep_seconds
            report["sweep"] = []
            cases = [(s, b) for s in shapes for b in batches]
            for i, (shape, batch) in enumerate(cases):
                # an equal share of the time left, so a case that finishes early hands its
                # rest on (B = 1 compiles its own kernels: a GEMV tile, BLOCK_M 1, and
                # Triton specializes an integer argument equal to 1, here M)
                now = time.perf_counter()
                case = Case(shape, batch, device, dtype)
                report["sweep"].append(sweep(case, now + (end - now) / (len(cases) - i)))
                del case
        report["all_ok"] = all(r["ok"] for r in report["rows"])
    report["seconds"] = time.perf_counter() - started
    print(f"took {report['seconds']:.0f} s, all_ok={report['all_ok']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
