"""Folded BatchNorms on the GPU: timm models (``pretrained=False``) captured in CUDA graphs.

Each model's eval BatchNorms fold into their convolutions (fp16: a per-channel scale and shift
after each), and the activations after them (written in place) fuse with those; outputs equal
eager's in fp16 after the signature is captured (replays), and a weight edited in place or a
``load_state_dict()`` after capture reaches the replayed graph (the derived constants are
written in place, where the captured graph reads them).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close_to_scale, assert_model_fused, graphs_since

import fusebackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

timm = pytest.importorskip("timm")

MODELS = ["resnet18", "mobilenetv3_small_100", "efficientnet_b0"]


def _eval_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False).eval()
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():  # statistics far from the defaults 0 and 1
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            n = module.num_features
            module.running_mean.copy_(torch.randn(n, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
    return model.to("cuda", torch.float16)


def replayed(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(the compiled model's third output: a replay, eager's output, the graphs compiled),
    the first two checked close."""
    before = fusebackend.reports()
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        expected = model(x)
        for _ in range(3):  # the 2nd call captures, the 3rd replays
            out = compiled(x)
    assert_close_to_scale(out, expected)
    return out, expected, graphs_since(before)


@pytest.mark.parametrize("name", MODELS)
def test_timm_batch_norms_fold_and_replays_equal_eager(name):
    model = _eval_model(name)
    x = torch.randn(2, 3, 96, 96, device="cuda", dtype=torch.float16)
    _, _, graphs = replayed(model, x)
    norms = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    folded = sum(len(g.rewrites.get("batch_norms_folded", [])) for g in graphs)
    assert folded == norms, [g.rewrites.get("batch_norms_left_alone") for g in graphs]
    assert fusebackend.stats()["recordings"] >= 1
    # the activations after the convolutions (timm writes them in place: out_of_place.py)
    # fuse with the folds' fp32 scale and shift, or run in cuDNN's fused call with a ReLU
    # (conv_activation.py), and validation kept the fused graph
    in_cudnn = sum(len(g.rewrites.get("conv_activations", [])) for g in graphs)
    assert_model_fused(graphs, row_groups=max(0, norms // 2 - in_cudnn))
    assert sum(len(g.rewrites.get("made_out_of_place", [])) for g in graphs) > 0


def test_an_edit_after_capture_reaches_the_replayed_graph():
    model = _eval_model("resnet18")
    other = _eval_model("resnet18", seed=1)
    x = torch.randn(1, 3, 64, 64, device="cuda", dtype=torch.float16)
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        recordings = fusebackend.stats()["recordings"]
        model.layer1[0].conv1.weight.mul_(-1.0)  # in place, after capture
        assert_close_to_scale(compiled(x), model(x))
        model.load_state_dict(copy.deepcopy(other.state_dict()))
        assert_close_to_scale(compiled(x), other(x))
    # the same captured graph replayed: the derived constants changed in place
    assert fusebackend.stats()["recordings"] == recordings
