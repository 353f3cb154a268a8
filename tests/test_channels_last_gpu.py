"""Channels-last graphs on the GPU (passes/channels_last.py): timm models (``pretrained=False``,
fp16) run their convolutions channels-last by default, captured in CUDA graphs; replays equal
eager; a weight edited in place after capture reaches the replayed graph; the elementwise
kernels walk channels-last tensors in storage order in every float dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close_to_scale, assert_model_fused, graphs_since, rewrites_of
from test_batch_norm_folding_gpu import _eval_model, replayed

import fusebackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

timm = pytest.importorskip("timm")


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_b0", "convnext_atto"])
def test_timm_models_run_channels_last_by_default_and_replays_equal_eager(name):
    model = _eval_model(name)
    x = torch.randn(2, 3, 96, 80, device="cuda", dtype=torch.float16)
    out, expected, graphs = replayed(model, x)
    assert out.stride() == expected.stride()
    convs = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    ran = sum(len(g.rewrites.get("channels_last", [])) for g in graphs)
    assert ran == convs, [g.rewrites.get("channels_last_left_alone") for g in graphs]
    assert_model_fused(graphs, row_groups=1)


def test_a_model_of_grouped_convolutions_stays_nchw_with_the_reason():
    # grouped convolutions (16 input channels per group) do most of the work: NCHW
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1, groups=2), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1, groups=4), nn.ReLU(),
    ).eval().to("cuda", torch.float16)  # fmt: skip
    x = torch.randn(1, 3, 64, 64, device="cuda", dtype=torch.float16)
    before = fusebackend.reports()
    with torch.no_grad():
        assert_close_to_scale(torch.compile(model, backend="infinifuse")(x), model(x))
    graphs = graphs_since(before)
    reasons = rewrites_of(graphs, "channels_last_left_alone")
    assert reasons and "grouped convolutions" in reasons[0], reasons


def test_a_weight_edit_after_capture_reaches_the_channels_last_copy():
    model = _eval_model("resnet18")
    x = torch.randn(1, 3, 64, 64, device="cuda", dtype=torch.float16)
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        model.layer1[0].conv1.weight.mul_(-1.0)  # a 3x3 weight: read through its copy
        assert_close_to_scale(compiled(x), model(x))
        assert fusebackend.stats()["recordings"] >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_an_elementwise_kernel_walks_channels_last_tensors(dtype):
    def block(x, skip, scale, gate):
        return F.silu(x * scale + skip) * gate.sigmoid()

    def cl(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)

    x, skip = cl(3, 37, 9, 11), cl(3, 37, 9, 11)
    scale = torch.randn(37, 1, 1, device="cuda", dtype=dtype)
    gate = torch.randn(3, 37, 1, 1, device="cuda", dtype=dtype)
    with torch.no_grad():
        out = torch.compile(block, backend="infinifuse")(x, skip, scale, gate)
    expected = block(x, skip, scale, gate)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert out.stride() == expected.stride()
