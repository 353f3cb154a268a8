"""Every hand-written kernel variant compiles for an H100 (sm_90), on a machine without a GPU
(benchmarks/diag/compile_sm90.py, in a process without TRITON_INTERPRET).

The CPU tests run kernels through Triton's interpreter, which never compiles them: an fp32
matmul group with a LayerNorm prologue passed them all and still failed Triton 3.6's sm_90
pipeline on every GPU (seen failing here before its fix). About 30-90 s (Triton's cache
keeps the binaries for the next run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_variant_compiles_for_sm90(tmp_path):
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sm90.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "diag" / "compile_sm90.py"),
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    failed = [(r["kernel"], r["error"][:500]) for r in results if not r["ok"]]
    assert not failed, failed
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kinds = {r["kernel"].split(" ")[0] for r in results}
    expected = {"matmul_group", "decode_attention", "write_cache_pair", "depthwise_conv2d",
                "group_norm"}  # fmt: skip
    assert kinds == expected, kinds
    assert len(results) >= 100, len(results)


PROBE = """
import sys
import torch
import triton
import triton.language as tl

sys.path.insert(0, sys.argv[1])
import compile_sm90


@triton.jit
def probe(out, stride):
    # a runtime branch may not give one name two types; a stride of 1, made a constant by
    # Triton's launcher, leaves one branch
    if stride == 1:
        v = tl.zeros([2], tl.float32)
        tl.store(out + tl.arange(0, 2), v)
    else:
        v = tl.zeros([4], tl.float32)
        tl.store(out + tl.arange(0, 4) * stride, v)


compile_sm90.compile_launch(probe, [torch.empty(8), int(sys.argv[2])], {})
print("compiled")
"""


@pytest.mark.parametrize("stride, compiles", [(1, True), (2, False)])
def test_compile_launch_makes_an_argument_of_1_a_constant_as_the_launcher_does(
    tmp_path, stride, compiles
):
    """A branch on a stride of 1 is resolved at compile time on a GPU; compiled here as a
    runtime branch, a prefetch of [K, N] weights passed and then failed on an H200."""
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    command = [sys.executable, str(script), str(ROOT / "benchmarks" / "diag"), str(stride)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert (done.returncode == 0) == compiles, done.stdout[-2000:] + done.stderr[-2000:]
    if not compiles:
        assert "Mismatched type" in done.stderr, done.stderr[-2000:]
