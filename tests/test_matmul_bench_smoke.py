"""benchmarks/matmul_kernels.py --smoke on the CPU (Triton's interpreter): every kind of
matmul group (RMSNorm + q/k/v with bias, residual, silu gate, LayerNorm + bias, lm head) once
at a tiny size, checked against the eager sequence and under a swapped launch config, in a
subprocess (~5 s). No test asserts a time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import run_smoke

ROOT = Path(__file__).resolve().parents[1]


def test_matmul_benchmark_smoke_writes_checked_rows(tmp_path):
    report = run_smoke("matmul_kernels.py", tmp_path / "matmul.json", "matmul_kernels")
    groups = {r["group"] for r in report["shapes"]}
    for kind in ("rms_norm + 3 linears + bias", "linear + residual", "silu(gate) * up",
                 "layer_norm + linear + bias", "linear + bias + residual"):  # fmt: skip
        assert any(kind in g for g in groups), (kind, groups)
    for row in report["shapes"]:
        assert row["ok"] and row["swapped_config_ok"] and row["split_config_ok"], row
        assert row["max_error_vs_eager"] < 1e-2, row
    assert report["all_ok"] is True


def test_matmul_benchmark_ledger_rows():
    """The rows --ledger appends: one per (shape, M, variant) time and per swept best."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        pytest.importorskip("triton")
        import ledger
        import matmul_kernels
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    env = {"device": "NVIDIA H100", "torch": "2", "triton": "3", "transformers": "5",
           "date": "2026-01-01T00:00:00+00:00"}  # fmt: skip
    report = {**env, "shapes": [{"shape": "qwen2-qkv", "rows": 1, "fused_us": 5.0,
                                 "eager_us": 20.0, "cublas_us": 12.0}],
              "sweep": [{"shape": "qwen2-qkv", "rows": 1, "best_us": 4.5},
                        {"shape": "qwen2-o", "rows": 1, "best_us": None}]}  # fmt: skip
    rows = matmul_kernels.ledger_rows(report, "m.json")
    assert [(r["workload"], r["backend"], r["value"]) for r in rows] == [
        ("matmul-qwen2-qkv-m1", "infinifuse", 5.0),
        ("matmul-qwen2-qkv-m1", "eager", 20.0),
        ("matmul-qwen2-qkv-m1", "cublas-linear", 12.0),
        ("matmul-qwen2-qkv-m1", "infinifuse-swept-best", 4.5),
    ]
    assert all(r["device"] == "NVIDIA H100" and r["unit"] == "us" for r in rows)
    assert set(rows[0]) <= set(ledger.FIELDS)
