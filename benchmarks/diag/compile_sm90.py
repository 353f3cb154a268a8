"""Do the hand-written kernels compile for an H100 (sm_90)? Checked on a machine without a GPU.

Triton's interpreter (the CPU tests' TRITON_INTERPRET=1) runs a kernel's Python, not its
compiler: a kernel can pass every CPU test and still fail to compile for a GPU. That
happened: an fp32 matmul group with a LayerNorm prologue stopped Triton 3.6's
``TritonGPUOptimizeThreadLocality`` pass (``loopResult.hasOneUse()``) and fell back to the
unfused graph on every GPU; the interpreter never saw it. ``triton.compile`` with a
``GPUTarget`` runs the whole NVIDIA pipeline, ptxas included (Triton's wheel ships it),
with no driver: every variant of ``matmul_group_kernel`` (each prologue, epilogue, dtype,
split-K on and off, the debug build that checks cache indices), decode attention (split,
folded combine, masks), the cache-write pair, the GroupNorm (rows whole and split) and the
depthwise convolution (its window unrolled and in a loop) are compiled here, with the
arguments their launchers build (``matmul._launch``, ``decode_attention._Plan``,
``group_norm._launches``, ``depthwise_conv._launch``).

TRITON_INTERPRET must not be set (the interpreter replaces the compiler):

    env -u TRITON_INTERPRET python benchmarks/diag/compile_sm90.py [--out results.json]

Prints one line per kernel variant; exits 1 when one fails to compile.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from typing import Any

if os.environ.get("TRITON_INTERPRET"):
    raise SystemExit("compile_sm90.py: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusebackend.kernels import (  # noqa: E402
    cache_write,
    depthwise_conv,
    group_norm,
    matmul,
    matmul_triton,
)
from fusebackend.kernels import decode_attention as attention  # noqa: E402
from fusebackend.kernels.ir import MatmulGroup  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}  # fmt: skip


def compile_launch(fn: Any, args: list[Any], meta: dict[str, Any], debug: bool = False) -> Any:
    """Compile ``fn`` as a launch with these arguments and meta-parameters would."""
    params = {p.name: p for p in fn.params}
    values = dict(zip(fn.arg_names, args)) | {k: v for k, v in meta.items() if k in params}
    signature, constants = {}, {}
    for name in fn.arg_names:
        value = values[name]
        if params[name].is_constexpr:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int) and value == 1 and not params[name].do_not_specialize:
            # Triton's launcher makes an integer argument equal to 1 a constant (a stride
            # of 1 above all): a branch on it is then resolved at compile time, as on a GPU
            # (without this a [K, N] weight's prefetch compiled here and failed on an H200)
            signature[name], constants[name] = "constexpr", 1
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: {value!r}")
    options = {"num_warps": meta.get("num_warps", 4), "num_stages": meta.get("num_stages", 3),
               "debug": debug,
               "sanitize_overflow": meta.get("sanitize_overflow", True)}  # fmt: skip
    return triton.compile(ASTSource(fn, signature, constants), target=TARGET, options=options)


def ptx_size(kernel: Any) -> int:
    return len(kernel.asm["ptx"])


def matmul_cases() -> list[tuple[str, MatmulGroup, dict[str, Any]]]:
    """(label, group, how to build its tensors) for every kernel feature."""
    rms = {"norm": "rms", "eps": 1e-6}
    layer = {"norm": "layer", "eps": 1e-5, "norm_bias": True}
    gelu_tanh = {"gate": "gelu_tanh", "norm": "rms_offset", "eps": 1e-6}
    cache = {"rotary": 64, "cache_write": True}
    groups = [
        ("linear", MatmulGroup()),
        ("rms + q/k/v + bias", MatmulGroup(siblings=3, bias=True, **rms)),
        ("layer + linear + bias", MatmulGroup(bias=True, **layer)),
        ("layer + linear + bias + gelu_new",
         MatmulGroup(bias=True, activation="gelu_new", **layer)),
        ("linear + relu", MatmulGroup(activation="relu")),
        ("rms_offset + gelu_tanh gate", MatmulGroup(siblings=2, **gelu_tanh)),
        ("rms + silu gate", MatmulGroup(siblings=2, gate="silu", **rms)),
        ("chunked silu gate", MatmulGroup(siblings=2, gate="silu", chunked=True)),
        ("linear + bias + residual", MatmulGroup(bias=True, residual=True)),
        ("conv1d (kn) + bias", MatmulGroup(bias=True, weight_layout="kn")),
        ("rms + q/k/v + rotary", MatmulGroup(siblings=3, rotary=64, **rms)),
        ("rms + q/k/v + bias + rotary + cache", MatmulGroup(siblings=3, bias=True, **cache, **rms)),
        ("rms + q/k/v + head norms + rotary + cache",
         MatmulGroup(siblings=3, head_norm="rms", head_eps=1e-6, **cache, **rms)),
        ("rms_offset + q/k/v + offset head norms + rotary",
         MatmulGroup(siblings=3, rotary=64, head_norm="rms_offset", head_eps=1e-6,
                     norm="rms_offset", eps=1e-6)),
        ("rms + q/k/v + rotary + cache, index checks",
         MatmulGroup(siblings=3, index_checks=True, **cache, **rms)),
    ]  # fmt: skip
    return [(label, group, {}) for label, group in groups]


def _matmul_tensors(group: MatmulGroup, dtype: torch.dtype, one_row: bool = False):
    """Rows [2, 3, K] ([1, 1, K] with ``one_row``) and the parameters a graph would pass for
    ``group``."""
    k, width = 256, 64
    b, t = (1, 1) if one_row else (2, 3)
    x = torch.randn(b, t, k).to(dtype)
    norm_weight = torch.randn(k).to(dtype) if group.norm else None
    norm_bias = torch.randn(k).to(dtype) if group.norm_bias else None
    widths = [4 * width, 2 * width, 2 * width][: group.siblings]
    if group.chunked:
        widths = [2 * widths[0]]
    shapes = [(k, n) if group.weight_layout == "kn" else (n, k) for n in widths]
    weights = [torch.randn(*s).to(dtype) for s in shapes]
    biases = [torch.randn(n).to(dtype) for n in widths] if group.bias else []
    residual = torch.randn(b, t, widths[0]).to(dtype) if group.residual else None
    extra: list[torch.Tensor] = []
    if group.rotary:
        extra = [torch.randn(b, 1, t, width).to(dtype), torch.randn(b, 1, t, width).to(dtype)]
    if group.head_norm:
        extra += [torch.randn(width).to(dtype), torch.randn(width).to(dtype)]
    if group.cache_write:
        extra += [torch.randn(b, 2, 16, width).to(dtype), torch.randn(b, 2, 16, width).to(dtype),
                  torch.arange(t)]  # fmt: skip
    return x, norm_weight, norm_bias, residual, [*weights, *biases, *extra]


# Launched on a Hopper GPU: programmatic dependent launch and the weight prefetch
# (kernels/dependent_launch.py, matmul.PREFETCH_K), which a CPU launch never turns on
OVERLAP = {"PDL": True, "PREFETCH": 256}


def compile_matmul(group: MatmulGroup, dtype: torch.dtype, split_k: int,
                   overlap: bool = False, gemv: bool = False) -> Any:  # fmt: skip
    """One variant; ``gemv``: one row without tensor cores (LaunchConfig.gemv)."""
    x, norm_weight, norm_bias, residual, params = _matmul_tensors(group, dtype, gemv)
    default = matmul.launch_config
    config = (matmul.LaunchConfig(2, 128, 4, 1, split_k=split_k, gemv=True) if gemv
              else matmul.LaunchConfig(16, 64, 4, 2, split_k=split_k))  # fmt: skip
    matmul._launch_config = lambda *a: config
    try:
        weights, biases, heads = matmul._split_params(group, tuple(params))
        args, _, meta, _ = matmul._launch(group, x, norm_weight, norm_bias, residual, weights,
                                          biases, heads)  # fmt: skip
    finally:
        matmul._launch_config = default
    if overlap:
        meta = {**meta, **OVERLAP}
    checked = group.index_checks
    kernel = (
        matmul_triton.matmul_group_kernel_checked if checked else matmul_triton.matmul_group_kernel
    )
    return compile_launch(kernel, args, meta, debug=checked)


def compile_attention(dtype: torch.dtype, masked: bool, fold: bool, slots: int,
                      overlap: bool = False) -> Any:  # fmt: skip
    batch, heads, kv_heads, width = 2, 8, 2, 64
    q = torch.randn(batch, heads, 1, width).to(dtype)
    k, v = (torch.randn(batch, kv_heads, slots, width).to(dtype) for _ in range(2))
    mask = torch.zeros(batch, 1, 1, slots, dtype=torch.bool) if masked else None
    out = torch.empty(batch, heads, 1, width, dtype=dtype)
    attention.FOLD_COMBINE = fold
    try:
        plan = attention._Plan(q, k, v, mask, None, heads // kv_heads, out)
    finally:
        attention.FOLD_COMBINE = False
    rows = batch * heads
    scratch = [torch.empty(rows, max(plan.splits, 1), plan.block_d), torch.empty(rows, plan.splits),
               torch.empty(rows, plan.splits)]  # fmt: skip
    counters = torch.zeros(16, dtype=torch.int32) if plan.fold else out
    parts = scratch if plan.splits > 1 else [out] * 3
    args = [q, k, v, mask if mask is not None else q, out, *parts, counters, *plan.args]
    pdl = {"PDL": overlap}
    compile_launch(attention._attend_kernel(), args, {**plan.meta, **pdl})
    if plan.splits > 1 and not plan.fold:
        combine = attention._combine_kernel()
        compile_launch(combine, [*scratch, out, *plan.combine_args], {**plan.combine_meta, **pdl})


def compile_cache_pair(dtype: torch.dtype, checks: bool) -> Any:
    k_cache, v_cache = (torch.empty(2, 2, 16, 64, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 3, 64).to(dtype) for _ in range(2))
    args, _, meta = cache_write._launch(k_cache, v_cache, torch.arange(3), k, v)
    return compile_launch(cache_write._kernel(checks), args, meta, debug=checks)


def compile_depthwise(dtype: torch.dtype, window: int, residual: bool) -> Any:
    """A channels-last depthwise convolution with a BatchNorm's affine and SiLU (a window
    over 3 x 3 loops over its rows: ``depthwise_conv._row_loop``)."""
    x = torch.randn(1, 24, 9, 10).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(24, 1, window, window).to(dtype)
    vectors = [torch.randn(24) for _ in range(3)]
    out = torch.empty_like(x)
    added = torch.randn_like(x) if residual else None
    pad = window // 2
    args, _, meta = depthwise_conv._launch(x, weight, (1, 1), (pad, pad), (1, 1), *vectors,
                                           "silu", added, out)  # fmt: skip
    return compile_launch(depthwise_conv._kernel(), args, meta)


def compile_group_norm(dtype: torch.dtype, layout: str, parts: int | None, channels: int) -> Any:
    """A GroupNorm (4 groups of ``channels``) + SiLU: rows held whole (``parts`` None, a
    small input), or a wide row split into ``parts`` (1: one launch reading the row twice;
    more: the partial-sums launch, then the normalising one). Each launch compiles its own
    kernel; channels-last groups of under 32 bytes run the several-groups kernels."""
    shape = (1, channels, 9, 10) if parts is None else (1, channels, 40, 60)
    x = torch.randn(shape).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    vectors = [torch.randn(channels).to(dtype) for _ in range(2)]
    out = torch.empty_like(x)
    launches = group_norm._launches(x, 4, *vectors, 1e-5, "silu", out, parts=parts)
    for kernel, _, args, meta in launches:
        compile_launch(kernel, args, meta)


def cases() -> list[tuple[str, Any]]:
    """(label, a function compiling one variant)."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    found = []
    for (label, group, _), dtype, split_k in itertools.product(matmul_cases(), dtypes, (1, 3)):
        name = f"matmul_group {label} {str(dtype)[6:]} split_k={split_k}"
        found.append((name, lambda g=group, d=dtype, s=split_k: compile_matmul(g, d, s)))
    for dtype, masked, fold, slots in itertools.product(dtypes, (False, True), (False, True),
                                                        (17, 300)):  # fmt: skip
        if fold and slots == 17:
            continue  # one split: nothing to fold
        name = (f"decode_attention {str(dtype)[6:]} mask={masked} fold={fold} "
                f"slots={slots}")  # fmt: skip
        found.append((name, lambda *a, c=(dtype, masked, fold, slots): compile_attention(*c)))
    for (label, group, _), split_k in itertools.product(matmul_cases(), (1, 3)):
        name = f"matmul_group {label} float16 split_k={split_k} PDL + prefetch"
        found.append((name, lambda g=group, s=split_k: compile_matmul(g, torch.float16, s, True)))
    for (label, group, _), dtype, split_k in itertools.product(matmul_cases(), dtypes, (1, 3)):
        if group.head_norm:  # a program holds a whole head: never a GEMV launch
            continue
        name = f"matmul_group {label} {str(dtype)[6:]} split_k={split_k} GEMV + PDL + prefetch"
        gemv = functools.partial(compile_matmul, group, dtype, split_k, True, True)
        found.append((name, gemv))
    for fold in (False, True):
        name = f"decode_attention float16 mask=True fold={fold} slots=300 PDL"
        found.append((name, lambda f=fold: compile_attention(torch.float16, True, f, 300, True)))
    for dtype, checks in itertools.product(dtypes, (False, True)):
        name = f"write_cache_pair {str(dtype)[6:]} checks={checks}"
        found.append((name, lambda d=dtype, c=checks: compile_cache_pair(d, c)))
    for dtype, window, residual in itertools.product(dtypes, (3, 5), (False, True)):
        name = f"depthwise_conv2d {str(dtype)[6:]} {window}x{window} residual={residual}"
        found.append((name, functools.partial(compile_depthwise, dtype, window, residual)))
    for dtype, layout, parts, channels in itertools.product(dtypes, ("nchw", "channels_last"),
                                                            (None, 1, 3), (16, 64)):  # fmt: skip
        if layout == "nchw" and channels == 64:
            continue  # (the same kernel as 16 channels)
        name = f"group_norm {str(dtype)[6:]} {layout} parts={parts} channels={channels}"
        build = functools.partial(compile_group_norm, dtype, layout, parts, channels)
        found.append((name, build))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--only", default="", help="compile only variants whose label has this")
    args = parser.parse_args(argv)
    results = []
    for label, build in cases():
        if args.only not in label:
            continue
        start = time.perf_counter()
        try:
            build()
            error = None
        except Exception as failure:  # a compile error is the finding
            error = f"{type(failure).__name__}: {str(failure)[:2000]}"
        seconds = time.perf_counter() - start
        results.append({"kernel": label, "ok": error is None, "error": error, "seconds": seconds})
        print(f"{'OK  ' if error is None else 'FAIL'} {label} ({seconds:.1f} s)"
              + (f"\n     {error[:300]}" if error else ""), flush=True)  # fmt: skip
    if args.out:
        report = {"target": "cuda sm_90", "triton": triton.__version__, "torch": torch.__version__,
                  "results": results}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    failed = [r["kernel"] for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} of {len(results)} compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
