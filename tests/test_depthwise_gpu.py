"""Depthwise convolutions on the GPU (kernels/depthwise_conv.py, passes/depthwise.py): the
kernel against aten's convolution at EfficientNet's and MobileNetV3's depthwise shapes in
every float dtype, through each of its launch configurations; timm models with depthwise
convolutions (``pretrained=False``, fp16, random BatchNorm statistics) run every depthwise
convolution as the kernel with its norm and activation, captured, and replays equal eager;
GhostNet's first ghost modules write theirs into their concatenations, the second ones' stay
cuDNN's, and the model still equals eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_model_fused, rewrites_of
from test_batch_norm_folding_gpu import _eval_model, replayed

from fusebackend.kernels.depthwise_conv import depthwise_conv2d

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("shape", "kernel", "stride"),
    [
        ((8, 32, 112, 112), 3, 1),  # ten thousand tiles: 64 positions a program
        ((1, 144, 56, 56), 5, 2),  # a thousand: 32
        ((8, 72, 56, 56), 3, 1),  # channels not a multiple of 16
        ((1, 960, 7, 7), 5, 1),
        ((3, 5, 9, 11), 3, 2),  # odd everything
    ],
)
def test_the_kernel_equals_atens_convolution_on_the_gpu(shape, kernel, stride, dtype):
    torch.manual_seed(0)
    channels = shape[1]
    x = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(channels, 1, kernel, kernel, device="cuda").to(dtype)
    center, shift = torch.randn(2, channels, device="cuda")
    scale = torch.rand(channels, device="cuda") + 0.5
    pad = kernel // 2
    out = depthwise_conv2d(x, weight, (stride, stride), (pad, pad), (1, 1), center, scale, shift,
                           "silu")  # fmt: skip
    y = F.conv2d(x.float(), weight.float(), None, stride, pad, 1, channels)
    expected = F.silu((y - center.view(-1, 1, 1)) * scale.view(-1, 1, 1) + shift.view(-1, 1, 1))
    assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == dtype
    tol = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("name", "depthwise"), [("efficientnet_b0", 16), ("mobilenetv3_large_100", 15)]
)
def test_timm_depthwise_convolutions_run_as_the_kernel_and_replays_equal_eager(name, depthwise):
    pytest.importorskip("timm")
    model = _eval_model(name)
    x = torch.randn(2, 3, 96, 80, device="cuda", dtype=torch.float16)
    _, _, graphs = replayed(model, x)
    made = rewrites_of(graphs, "depthwise_convs")
    assert len(made) == depthwise, made
    assert all("(+" in m for m in made), made  # each with its norm and activation
    assert_model_fused(graphs, row_groups=1)


def test_ghostnet_runs_every_depthwise_convolution_as_the_kernel():
    pytest.importorskip("timm")
    model = _eval_model("ghostnet_100")
    x = torch.randn(2, 3, 96, 80, device="cuda", dtype=torch.float16)
    _, _, graphs = replayed(model, x)
    made = rewrites_of(graphs, "depthwise_convs")
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    depthwise = [m for m in convs if m.groups == m.in_channels == m.out_channels > 1]
    # all of them: the strided ones, the first ghost module's of each bottleneck (written
    # into its concatenation), the second's (its shortcut added in the kernel, written too)
    assert len(made) == len(depthwise), made
    residuals = rewrites_of(graphs, "depthwise_residuals")
    assert len(residuals) == 16, residuals  # one a bottleneck
    assert sum(len(g.rewrites.get("concatenations_written", [])) for g in graphs) > 0
    assert_model_fused(graphs, row_groups=1)
