"""benchmarks/diag/diag_rotary_epilogue.py --smoke on the CPU (Triton's interpreter): the q/k/v
group with its rotary + KV-cache-write epilogue (one launch), what it replaces (the plain q/k/v
launch, the backend's fused rotation, write_cache_pair), the plain launch alone and
transformers' eager sequence, on tiny shapes (with and without biases, T = 1 and 2), fp32 and
fp16, B = 1 and 2, each checked against eager (q and every slot of both caches), the fused
launch also under a swapped launch config; in a subprocess (~10 s). No test asserts a time."""

from __future__ import annotations

import pytest
from helpers import run_smoke

VARIANTS = ("fused", "before", "qkv_only", "eager")


def test_rotary_epilogue_diag_smoke(tmp_path):
    pytest.importorskip("transformers")  # the eager sequence is transformers' own
    report = run_smoke("diag/diag_rotary_epilogue.py", tmp_path / "rotary_epilogue.json",
                       "diag_rotary_epilogue")  # fmt: skip
    rows = report["rows"]
    # what the smoke must cover: both dtypes, both batches, biases or not, T > 1 once
    assert {r["dtype"] for r in rows} == {"torch.float32", "torch.float16"}
    assert {r["batch"] for r in rows} == {1, 2}
    assert {r["bias"] for r in rows} == {False, True}
    assert {r["seq"] for r in rows} == {1, 2}
    for row in rows:
        assert "cache write(k, v)" in row["group"], row["group"]
        for name in VARIANTS:
            assert row[f"{name}_ok"], (name, row)
            assert row[f"{name}_max_error_vs_eager"] < 1e-2, (name, row)
        assert row["swapped_config_ok"], row
        # "before" rotates with the backend's own fused kernel, not a fallback
        assert row["before_rotation"]["fused"], row["before_rotation"]
        assert row["ok"], row
    assert report["all_ok"] is True
