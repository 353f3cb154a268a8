"""benchmarks/diag/diag_matmul_splitk.py --smoke on the CPU (Triton's interpreter): the
split-K kernels (semaphore: one launch, the last arrival reduces; atomic: fp32 atomics + an
epilogue kernel) at SPLIT_K 1, 2, 3 on tiny shapes, fp16 / bf16 / fp32, with and without a
residual, in a subprocess (~4 s). Each case is checked against torch in fp32, the per-tile
counters must be back at zero after every call, and the semaphore variant must give the
same bits twice. No test asserts a time."""

from __future__ import annotations

from helpers import run_smoke


def test_matmul_splitk_diag_smoke(tmp_path):
    report = run_smoke("diag/diag_matmul_splitk.py", tmp_path / "splitk.json",
                       "diag_matmul_splitk")  # fmt: skip
    cases = report["cases"]
    # what the smoke must cover: every split (3 leaves a K tail), both variants, residual
    # or not, the three dtypes
    assert {c["split_k_launched"] for c in cases} == {1, 2, 3}
    assert {c["variant"] for c in cases} == {"semaphore", "atomic"}
    assert {c["residual"] for c in cases} == {False, True}
    assert {c["dtype"] for c in cases} == {"torch.float16", "torch.bfloat16", "torch.float32"}
    assert any(c["k"] % (c["split_k"] * c["block_k"]) for c in cases if c["split_k"] > 1)
    for c in cases:
        assert c["ok"] and c["within"] and c["counters_zero"], c
        if c["variant"] == "semaphore":
            assert c["repeatable"], c
    assert report["all_ok"] is True
