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
    expected = {"matmul_group", "decode_attention", "write_cache_pair", "depthwise_conv2d"}
    assert kinds == expected, kinds
    assert len(results) >= 100, len(results)
