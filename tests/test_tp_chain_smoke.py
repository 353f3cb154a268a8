"""benchmarks/diag/diag_tp_chain.py --smoke: two gloo processes under torchrun run every
variant's math once at a tiny shape (no graphs, no timing) and check the all-reduce sums and
the TP chain against the unsharded one; the symmetric-memory rows run emulated (no CUDA).
About 5 s on two CPU cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "diag" / "diag_tp_chain.py"
TIMEOUT_S = 60  # a hung collective fails the test instead of the whole suite hanging

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="no torch.distributed gloo"
)


def test_smoke_sums_and_chains_agree_on_two_gloo_ranks(tmp_path):
    pytest.importorskip("torch.distributed.run", reason="torchrun is absent")
    out = tmp_path / "tp_chain.json"
    proc = run_torchrun(SCRIPT, 2, "--smoke", "--label", "smoke", "--out", str(out),
                        timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads(out.read_text())
    assert report["complete"] and report["smoke"] and report["label"] == "smoke"
    assert report["failed_checks"] == []
    assert report["environment"]["world_size"] == 2
    # Multicast stays off: the script sets these where the environment had not.
    env_seen = report["environment"]["env"]
    assert env_seen["NCCL_NVLS_ENABLE"] == "0"
    assert env_seen["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    block = report["blocks"]["tiny/fp32"]
    variants = ("a_c10d_b2b", "a_nccl_b2b", "a_nccl_dep", "b_compute", "c_nccl_chain",
                "floor_single_full", "a_symm_b2b", "d_symm_chain")  # fmt: skip
    assert set(block["rows"]) == set(variants)
    for name, row in block["rows"].items():
        assert "error" not in row and "skipped" not in row, (name, row)
    checks = ("a_nccl_b2b_equals_sum", "a_symm_b2b_equals_sum", "a_nccl_dep_equals_mean",
              "c_nccl_chain_equals_unsharded", "d_symm_chain_equals_c")  # fmt: skip
    assert set(block["checks"]) == set(checks)
    assert all(check["ok"] for check in block["checks"].values()), block["checks"]
    assert block["symm_backend"].startswith("emulated")
