"""benchmarks/diag/diag_tp_chain.py --smoke: two gloo processes under torchrun run every
variant's math once at a tiny shape (no graphs, no timing) and check the all-reduce sums and
the TP chain against the unsharded one; the symmetric-memory rows run emulated (no CUDA).
About 5 s on two CPU cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "diag" / "diag_tp_chain.py"
TIMEOUT_S = 60  # a hung collective fails the test instead of the whole suite hanging

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="no torch.distributed gloo"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_smoke_sums_and_chains_agree_on_two_gloo_ranks(tmp_path):
    pytest.importorskip("torch.distributed.run", reason="torchrun is absent")
    out = tmp_path / "tp_chain.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_free_port()}", str(SCRIPT), "--smoke", "--label", "smoke",
               "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun ran past {TIMEOUT_S} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]

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
