"""Reductions over a dim other than the last on the GPU (passes/axis_reductions.py): the
rewritten group, whose kernel reads a permuted view along its rows, equals eager in every
float dtype; timm LeViT-128S (``pretrained=False``, fp16) takes its head's mean over tokens
into the group of its BatchNorms, captured, and replays equal eager.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, compile_fused, eager, tol

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


def test_levit_head_mean_joins_its_batch_norms_and_replays_equal_eager():
    pytest.importorskip("timm")
    from test_batch_norm_folding_gpu import _eval_model, replayed

    model = _eval_model("levit_128s")
    x = torch.randn(2, 3, 224, 224, device="cuda", dtype=torch.float16)
    _, _, graphs = replayed(model, x)
    rewritten = [name for g in graphs for name in g.rewrites.get("axis_reductions", [])]
    assert len(rewritten) == 1, rewritten
    assert fusebackend.stats()["recordings"] >= 1
