"""2-d pooling on the GPU (kernels/pool2d.py, passes/pooling.py): the kernel against aten's
pooling at Inception-v3's and ResNet's shapes in every float dtype, a NaN included (Triton's
interpreter propagates a NaN through ``tl.maximum`` where the GPU does not, so only here is
the NaN rule checked on compiled code); timm models that pool (``pretrained=False``, fp16) run
their pools as the kernel, captured, and replays equal eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_batch_norm_folding_gpu import _eval_model, replayed

from fusebackend.kernels.pool2d import pool2d

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [
    ((8, 288, 35, 35), "avg", (3, 3), (1, 1), (1, 1), (1, 1), False, True, None),
    ((8, 768, 17, 17), "avg", (3, 3), (1, 1), (1, 1), (1, 1), False, False, None),
    ((3, 2048, 8, 8), "avg", (3, 3), (2, 2), (1, 1), (1, 1), True, True, 4),
    ((8, 64, 147, 147), "max", (3, 3), (2, 2), (0, 0), (1, 1), False, True, None),
    ((2, 64, 112, 112), "max", (3, 3), (2, 2), (1, 1), (1, 1), True, True, None),
    ((1, 40, 9, 11), "max", (2, 3), (2, 1), (1, 1), (2, 1), False, True, None),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}-{c[0][1]}x{c[0][2]}" for c in CASES])
def test_the_kernel_equals_atens_pooling_on_the_gpu(case, dtype):
    torch.manual_seed(0)
    shape, kind, *args = case
    x = (torch.randn(shape, device="cuda") * 2 + 1).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    x[0, 3, 4, 5] = float("nan")
    out = pool2d(x, kind, *args)
    kernel, stride, padding, dilation, ceil_mode, count_include_pad, divisor = args
    if kind == "max":
        expected = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
    else:
        expected = F.avg_pool2d(x.float(), kernel, stride, padding, ceil_mode,
                                count_include_pad, divisor).to(dtype)  # fmt: skip
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert out.isnan().sum() == expected.isnan().sum() > 0
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize(("name", "pools"), [("inception_v3", 13), ("resnet50", 1)])
def test_timm_pools_run_as_the_kernel_and_replays_equal_eager(name, pools):
    pytest.importorskip("timm")
    model = _eval_model(name)
    x = torch.randn(2, 3, 160, 160, device="cuda", dtype=torch.float16)
    _, _, graphs = replayed(model, x)
    made = sum(len(g.rewrites.get("pool_kernels", [])) for g in graphs)
    assert made == pools, [g.rewrites.get("pool_kernels") for g in graphs]
