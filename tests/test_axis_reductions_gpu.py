"""Reductions over a dim other than the last on the GPU (passes/axis_reductions.py): the
rewritten group, whose kernel reads a permuted view along its rows, equals eager in every
float dtype; timm LeViT-128S (``pretrained=False``, fp16) takes its head's mean over tokens
into the group of its BatchNorms, captured, and replays equal eager.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, compile_fused, eager, rewrites_of, tol

import fusebackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,dim", [((8, 16, 384), 1), ((3, 49, 7, 96), 1), ((33, 5, 70), 0)])
def test_a_mean_and_its_affine_equal_eager(shape, dim, dtype):
    torch.manual_seed(0)
    scale = torch.rand(shape[-1], device="cuda") + 0.5

    def fn(x):
        m = x.mean(dim)
        return ((m.float() - 0.25) * scale).to(x.dtype), torch.relu(m)

    x = (torch.randn(shape, device="cuda") * 2).to(dtype)
    expected = eager(fn, x)
    with torch.no_grad():
        actual = compile_fused(fn)(x)
    assert_close(actual, expected, **tol(dtype))
    assert fusebackend.last_report().graphs[-1].rewrites.get("axis_reductions") == ["m"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sentence_transformers_mean_pooling_is_one_kernel_and_equals_eager(dtype):
    torch.manual_seed(1)

    def pool(h, mask):
        expanded = mask.unsqueeze(-1).expand(h.size()).to(h.dtype)
        return torch.sum(h * expanded, 1) / torch.clamp(expanded.sum(1), min=1e-9)

    mask = (torch.rand(32, 57, device="cuda") > 0.3).to(torch.int64)
    mask[:, 0] = 1
    h = torch.randn(32, 57, 384, device="cuda").to(dtype)
    expected = eager(pool, h, mask)
    with torch.no_grad():
        actual = compile_fused(pool)(h, mask)
    assert_close(actual, expected, **tol(dtype))
    graph = fusebackend.last_report().graphs[-1]
    assert len(graph.rewrites.get("axis_reductions", [])) == 2
    assert len(graph.groups) == 1, str(fusebackend.last_report())


def test_levit_head_mean_joins_its_batch_norms_and_replays_equal_eager():
    pytest.importorskip("timm")
    from test_batch_norm_folding_gpu import _eval_model, replayed

    model = _eval_model("levit_128s")
    x = torch.randn(2, 3, 224, 224, device="cuda", dtype=torch.float16)
    _, _, graphs = replayed(model, x)
    rewritten = rewrites_of(graphs, "axis_reductions")
    assert len(rewritten) == 1, rewritten
    assert fusebackend.stats()["recordings"] >= 1
