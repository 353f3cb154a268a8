"""Means over H x W on the GPU (kernels/spatial_mean.py, passes/spatial_means.py): the kernel
against ``torch.mean`` at squeeze-excite shapes in every float dtype, one launch and split
over the positions; timm models with squeeze-excite (``pretrained=False``, fp16) run their
means as the kernel, captured, and replays equal eager.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_model_fused
from test_batch_norm_folding_gpu import _eval_model, replayed

from fusebackend.kernels.spatial_mean import spatial_mean

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape", [(8, 32, 112, 112), (1, 72, 28, 28), (8, 960, 7, 7), (3, 5, 1, 1)]
)
def test_the_kernel_equals_torch_mean_on_the_gpu(shape, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda") * 2 + 1).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    out = spatial_mean(x, True)
    expected = x.float().mean((2, 3), keepdim=True)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["efficientnet_b0", "mobilenetv3_large_100"])
def test_squeeze_excite_means_run_as_the_kernel_and_replays_equal_eager(name):
    pytest.importorskip("timm")
    model = _eval_model(name)
    x = torch.randn(2, 3, 96, 80, device="cuda", dtype=torch.float16)
    out, expected, graphs = replayed(model, x)
    means = sum(len(g.rewrites.get("spatial_means", [])) for g in graphs)
    assert means >= 8, [g.rewrites.get("spatial_means") for g in graphs]
    assert_model_fused(graphs, row_groups=1)
