"""Model zoo: 21 transformers architectures from small configs, compiled with infinifuse,
equal eager on padded batches. On the GPU (fp32 and fp16) every signature must also be
captured: no input signature may end in mode "eager".

Tolerances: fp32 uses assert_close's defaults. fp16 uses 2e-2: the fused kernels compute in
fp32 and round once where eager rounds each op, and two transformer layers of random weights
carry such one-ulp differences (fp16 ulp ~1e-3 relative) through LayerNorm/RMSNorm and
attention, which amplify them a few times.
"""

from __future__ import annotations

import pytest
import torch

import fusebackend

pytest.importorskip("transformers")

import model_zoo  # noqa: E402  (tests/ is on sys.path under pytest's rootdir conftest)

FAMILIES = sorted(model_zoo.ZOO)
_FP16_TOL = {"rtol": 2e-2, "atol": 2e-2}


def _run(family: str, dtype: torch.dtype, device: str) -> None:
    model = model_zoo.build(family, dtype=dtype, device=device)
    x = model_zoo.inputs(family, device=device)
    with torch.no_grad():
        expected = model_zoo.main_output(model(**x))
        compiled = torch.compile(model, backend="infinifuse")
        first = model_zoo.main_output(compiled(**x)).clone()
        second = model_zoo.main_output(compiled(**x))  # a hit: replayed where captured
    tol = _FP16_TOL if dtype == torch.float16 else {}
    torch.testing.assert_close(first, expected, equal_nan=True, **tol)
    torch.testing.assert_close(second, expected, equal_nan=True, **tol)
    assert fusebackend.stats()["cache_hits"] >= 1, "the second call was not served by the cache"


@pytest.mark.parametrize("family", FAMILIES)
def test_zoo_cpu_equals_eager(family):
    _run(family, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_zoo_gpu_equals_eager_and_captures(family, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _run(family, dtype, "cuda")
    modes = fusebackend.stats()["fusion_modes"]
    assert modes, "no signature was cached"
    uncaptured = {k: m for k, m in modes.items() if m == "eager"}
    assert not uncaptured, (uncaptured, fusebackend.stats()["fallback_reasons"])
