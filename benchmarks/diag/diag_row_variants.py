"""Where do the last percent against Inductor go in the pointwise row kernels? (one GPU run)

row_kernels.py left tanh GELU (1.01-1.04x), SwiGLU (up to 1.04x) and RoPE
(up to 1.03x at prefill) slower than Inductor's kernels, with the launch config ruled out by
the sweep. This compiles each case with infinifuse, then swaps its kernel for variants of the
generated source that differ in one respect, and times each as row_kernels.py does (device
time inside a CUDA graph), beside Inductor's kernel in the same process:

    base            the kernel as generated
    int32_rows      row indices in int32 instead of int64 (Inductor indexes in int32 below
                    2**31 elements)
    no_round        intermediates not rounded to the output dtype (round_intermediates=False)
    libdevice_tanh  tanh from libdevice (as Inductor) instead of the exp-based expression the
                    interpreter can run (GELU cases only)
    fast_div        fp32 divisions approximate (div.full, 2 ulp) instead of IEEE-rounded
    no_nan_check    (a max over a row) without the second reduction that counts NaNs so the
                    max returns NaN as torch.amax does (wrong only for rows with a NaN)
    max_reduce_nan  (a max over a row) the max and its NaN rule as one tl.reduce whose
                    combine keeps NaN, as Inductor's max2 (the same results)
    rows_first      the same kernel on the grid order used until 2026-11-25: axis 0 (the
                    fastest) over row blocks, axis 1 over column blocks (ROWS_AXIS=0), where
                    the launcher now puts a row's column blocks first as Inductor's flat grid
                    does (tile layout with several column blocks; the H100 run that chose this
                    also timed a flat grid with a division per program: SwiGLU 1.00x,
                    tanh GELU 1.12x, recorded in results/diag_row_variants_h100.json)
    no_mask         loads and stores without masks (valid only because every case's shape
                    divides its blocks; Inductor drops its masks then)

    python benchmarks/diag/diag_row_variants.py --out /tmp/diag_row_variants.json
    python benchmarks/diag/diag_row_variants.py --cases softmax:75264x49 --out F.json  # Swin
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import unittest.mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from embedding_chain import device_ms  # noqa: E402
from row_kernels import PATTERNS, compiled, make_inputs, max_error, versions  # noqa: E402

import fusebackend  # noqa: E402
from fusebackend.kernels import codegen, expressions, launch, pair_source  # noqa: E402

CASES = ("gelu_tanh:4096x4096,gelu_tanh:4096x8192,gelu_tanh:1x3072,swiglu:4096x4096,"
         "swiglu:4096x8192,swiglu:1x4096,rope:4096x4096,rope:1x4096")  # fmt: skip
# Swin-T's first-stage attention scores at batch 8 (512 windows x 3 heads x 49 rows of 49):
# its bias + softmax group took 26.6 us against Inductor's 16.9 (diag_swin_rows.py, 980bcf5);
# run it with --cases softmax:75264x49 (its first run, 2026-11-29 at 7864e69, timed ATen's
# softmax for every variant: see run_case's fallback check)
LIBDEVICE = "from triton.language.extra import libdevice\n"


def variant_sources(key: tuple) -> dict[str, str]:
    program, rank, options, layout, pair = key
    generate = pair_source.generate_pair_source if pair else codegen.generate_source
    _, base = generate(program, rank, options, layout)
    out = {"base": base}
    out["int32_rows"] = base.replace(
        "rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)",
        "rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)",
    )
    unrounded = options.__class__(index_checks=options.index_checks, round_intermediates=False)
    out["no_round"] = generate(program, rank, unrounded, layout)[1]
    if any(getattr(i, "name", None) in ("tanh", "gelu") for i in program.instrs):
        with unittest.mock.patch.object(expressions, "_tanh", lambda x: f"libdevice.tanh({x})"):
            text = generate(program, rank, options, layout)[1]
        out["libdevice_tanh"] = text.replace("import triton\n", "import triton\n" + LIBDEVICE, 1)
    fast = _fast_div(base)
    if fast != base:  # only where the program divides
        out["fast_div"] = fast
    # the shapes here divide the blocks, so the masks only cost (Inductor drops them then)
    out["no_mask"] = re.sub(r", mask=mask(, other=0(\.0)?)?\)", ")", base)
    if layout == "tile":
        out["rows_first"] = base  # the same source, launched by RowsFirst
    if re.search(r"^\s*nan\d+ = tl\.sum", base, re.M):  # a max or min over a row
        out["no_nan_check"] = _without_nan_check(base)
        out["max_reduce_nan"] = _max_reduce_nan(base)
    if re.search(r"^\s*size\d+,  #", base, re.M):  # rows indexed through several dims
        out["const_sizes"] = _constant_sizes(base)
    for label, text in out.items():
        if label not in ("base", "rows_first") and text == base:
            raise SystemExit(f"variant {label} came out as the base kernel: its rewrite is stale")
    return out


_NAN_COMBINE = """
@triton.jit
def _max_keeping_nan(a, b):
    return tl.where((a > b) | (a != a), a, b)

"""


def _without_nan_check(source: str) -> str:
    """The kernel with its max's NaN count and NaN select removed (wrong only for rows with
    a NaN; the timing's inputs have none): what the second reduction costs."""
    source = re.sub(r"^\s*nan(\d+) = tl\.sum\(.*\n", "", source, flags=re.M)
    return re.sub(r"^\s*acc(\d+) = tl\.where\(nan\1 > 0, .*\n", "", source, flags=re.M)


def _max_reduce_nan(source: str) -> str:
    """The kernel with its max and NaN count as one ``tl.reduce`` whose combine keeps NaN
    (as Inductor's ``max2``): one reduction instead of two, the same results."""
    source = _without_nan_check(source)
    source = re.sub(r"tl\.max\((.*), axis=1, keep_dims=True\)",
                    r"tl.reduce(\1, 1, _max_keeping_nan, keep_dims=True)", source)  # fmt: skip
    # after the kernel, so that the kernel stays the source's first def (Triton resolves the
    # combine's name when it compiles)
    return source + _NAN_COMBINE


def _constant_sizes(source: str) -> str:
    """The kernel with its row dims' sizes as constants (compiled per size, as Inductor's
    static shapes are): a row's dim indices then cost a multiply and a shift instead of an
    integer division by a runtime value."""
    source = re.sub(r"^(\s*)(size\d+),  #", r"\1\2: tl.constexpr,  #", source, flags=re.M)
    return re.sub(r"'size\d+', ", "", source)


class RowsFirst:
    """A kernel launched with its row blocks on grid axis 0 (ROWS_AXIS=0) whatever the
    launcher chose."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **meta):
            if meta["ROWS_AXIS"] == 1:
                return self.kernel[(grid[1], grid[0])](*args, **{**meta, "ROWS_AXIS": 0})
            return self.kernel[grid](*args, **meta)

        return launch


def _fast_div(source: str) -> str:
    """Rewrites ``(A) / (B)`` where A and B are balanced parentheses into tl.fdiv."""
    result, i = [], 0
    while True:
        j = source.find(") / (", i)
        if j < 0:
            result.append(source[i:])
            return "".join(result)
        start = _matching_open(source, j)
        end = _matching_close(source, j + 4)
        result.append(source[i:start])
        numerator, denominator = source[start : j + 1], source[j + 4 : end + 1]
        result.append(f"tl.fdiv({numerator}, {denominator}, ieee_rounding=False)")
        i = end + 1


def _matching_open(text: str, close: int) -> int:
    depth = 0
    for k in range(close, -1, -1):
        depth += {")": 1, "(": -1}.get(text[k], 0)
        if depth == 0:
            return k
    raise ValueError("unbalanced")


def _matching_close(text: str, open_: int) -> int:
    depth = 0
    for k in range(open_, len(text)):
        depth += {"(": 1, ")": -1}.get(text[k], 0)
        if depth == 0:
            return k
    raise ValueError("unbalanced")


def run_case(name: str, rows: int, width: int) -> list[dict]:
    fn = PATTERNS[name]
    args, moved = make_inputs(name, rows, width, "cuda")
    results = []
    with torch.no_grad():
        ref = fn(*args)
        inductor = compiled(fn, "inductor")
        inductor(*args)
        call = compiled(fn, "infinifuse")
        keys = set()
        compiled_kernel = launch._compiled_kernel

        def recording(program, rank, options, layout, pair=False):
            keys.add((program, rank, options, layout, pair))
            return compiled_kernel(program, rank, options, layout, pair)

        with unittest.mock.patch.object(launch, "_compiled_kernel", recording):
            call(*args)
        assert len(keys) == 1, f"{name}: expected one kernel, got {len(keys)}"
        (key,) = keys
        original = launch._KERNELS[key]
        kernels = {}
        sources = variant_sources(key)
        if width & (width - 1):  # a row narrower than its block: unmasked stores write past it
            del sources["no_mask"]
        for label, source in sources.items():
            kname = re.search(r"^def (\w+)\(", source, re.M).group(1)  # the kernel: first
            kernels[label] = getattr(launch._import_source(kname, source), kname)
            if label == "rows_first":
                kernels[label] = RowsFirst(kernels[label])
        # The backend keeps each group's launch plan (kernel included) per signature and
        # launch_config; a distinct launch_config object per variant gives each its own plan.
        default_config = launch.launch_config
        configs = {label: functools.partial(default_config) for label in kernels}
        try:
            for label, kernel in kernels.items():
                launch._KERNELS[key] = kernel
                launch.launch_config = configs[label]
                out = call(*args)
                torch.cuda.synchronize()
                # a variant that raises sends the graph to its unfused replay for good, and
                # every later timing would be ATen's (as on 2026-11-29, 7864e69: the
                # max_reduce_nan kernel was launched under its combine's name)
                fallbacks = fusebackend.stats()["fusion_fallbacks"]
                if fallbacks:
                    raise SystemExit(f"{name}: variant {label} fell back: "
                                     f"{fusebackend.stats()['fallback_reasons']}")  # fmt: skip
                results.append({"label": label, "error": max_error(out, ref)})
            # alternate the variants over rounds so drift hits all alike
            times: dict[str, list[float]] = {label: [] for label in ["inductor", *kernels]}
            for _ in range(3):
                for label in times:
                    fn_ = inductor if label == "inductor" else call
                    launch.launch_config = configs.get(label, default_config)
                    times[label].append(device_ms(lambda fn_=fn_: fn_(*args), reps=5))
        finally:
            launch._KERNELS[key] = original
            launch.launch_config = default_config
    errors = {r["label"]: r["error"] for r in results}
    rows_out = []
    for label, ts in times.items():
        ms = sorted(ts)[1]
        rows_out.append({"pattern": name, "rows": rows, "width": width, "variant": label,
                         "us": ms * 1000, "gb_per_s": moved / ms / 1e6,
                         "max_error_vs_eager": errors.get(label)})  # fmt: skip
    inductor_us = rows_out[0]["us"]
    for r in rows_out:
        r["vs_inductor"] = r["us"] / inductor_us
        print(f"{name} {rows}x{width} {r['variant']:>15}: {r['us']:7.2f} us "
              f"{r['vs_inductor']:.3f}x inductor  err {r['max_error_vs_eager']}")  # fmt: skip
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES, help="pattern:ROWSxWIDTH,...")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for case in args.cases.split(","):
        name, shape = case.split(":")
        rows, width = map(int, shape.split("x"))
        results += run_case(name, rows, width)
    record = {"benchmark": "diag_row_variants", **versions(), "results": results}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
