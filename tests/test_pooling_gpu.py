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
from helpers import graphs_since
from test_batch_norm_folding_gpu import _eval_model, replayed

import fusebackend
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
    ((2, 24, 10, 13), "max", (2, 3), (1, 2), (1, 1), (1, 2), True, True, None),
    ((3, 70, 7, 8), "avg", (2, 3), (1, 2), (0, 1), (1, 1), True, True, None),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}-{c[0][1]}x{c[0][2]}" for c in CASES])
def test_the_kernel_equals_atens_pooling_on_the_gpu(case, dtype):
    torch.manual_seed(0)
    shape, kind, *args = case
    x = (torch.randn(shape, device="cuda") * 2 + 1).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    x[0, 3, 1, 1] = float("nan")  # (in some window of every case: row and column 1)
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


def test_resnet_stem_pool_runs_as_the_kernel_and_replays_equal_eager():
    pytest.importorskip("timm")
    model = _eval_model("resnet50")
    x = torch.randn(2, 3, 160, 160, device="cuda", dtype=torch.float16)
    _, _, graphs = replayed(model, x)
    assert sum(len(g.rewrites.get("pool_kernels", [])) for g in graphs) == 1


def test_inception_pools_run_as_the_kernel_and_equal_eager_in_fp32(monkeypatch):
    # In fp16 with random weights Inception-v3 amplifies rounding: one ulp of the image moved
    # its logits by 15% of their norm (docs/PERFORMANCE.md, bae8e61), and a replay's output
    # was 2e-2 of its scale from eager's on an H200 (2026-12-02, e56272b). In fp32, with the
    # channels-last layout asked for (the default takes it in half precision only), its 9
    # average and 4 max pools run as the kernel and the output is eager's.
    pytest.importorskip("timm")
    # (cuDNN's TF32 convolutions round differently per algorithm and layout: kept out)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _eval_model("inception_v3").float()
    x = torch.randn(2, 3, 160, 160, device="cuda")
    before = fusebackend.reports()
    compiled = torch.compile(model, backend="infinifuse", options={"channels_last": True})
    with torch.no_grad():
        expected = model(x)
        for _ in range(3):  # the 2nd call captures, the 3rd replays
            out = compiled(x)
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)
    graphs = graphs_since(before)
    assert sum(len(g.rewrites.get("pool_kernels", [])) for g in graphs) == 13
