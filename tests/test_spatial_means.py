"""Means over H x W of channels-last tensors as one kernel (passes/spatial_means.py,
kernels/spatial_mean.py).

The kernel against ``x.mean((2, 3))`` at odd shapes, dtypes and layouts, both through one
launch and through partial sums split over the positions; squeeze-excite and a global-pool
head in channels-last graphs: the means are rewritten, outputs equal eager's, every signature
runs fused; NCHW means stay aten's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_model_twice
from test_batch_norm_folding import _randomize_statistics as _randomize
from test_channels_last import MBConv

from fusebackend.kernels.spatial_mean import spatial_mean

TOLERANCES = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((2, 37, 5, 7), torch.float32),  # one launch, a part of a channel block
        ((3, 130, 9, 11), torch.float16),  # several channel blocks
        ((2, 16, 40, 40), torch.bfloat16),  # few programs: positions split, partial sums
        ((1, 5, 1, 1), torch.float32),  # one position
    ],
)
@pytest.mark.parametrize("channels_last", [True, False])
def test_the_kernel_equals_torch_mean(shape, dtype, channels_last):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 3 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    rtol, atol = TOLERANCES[dtype]
    for keepdim in (True, False):
        out = spatial_mean(x, keepdim)
        expected = x.float().mean((2, 3), keepdim=keepdim).to(dtype)
        assert out.shape == expected.shape and out.dtype == dtype
        torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    pooled = spatial_mean(x, True, channels_last=True)
    assert pooled.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(pooled, spatial_mean(x, True))


def test_a_strided_input_is_read_through_its_strides():
    torch.manual_seed(1)
    base = torch.randn(2, 9, 12, 20).contiguous(memory_format=torch.channels_last)
    x = base[:, 1:8, ::2, 3:17]  # a view: no layout of its own
    torch.testing.assert_close(spatial_mean(x, False), x.mean((2, 3)), rtol=1e-5, atol=1e-6)


class Head(nn.Module):
    """A conv, then a classifier head's global average pool and a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 10, 3), nn.Linear(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1), 1))


@pytest.mark.parametrize("block", [MBConv, Head])
def test_channels_last_means_run_as_the_kernel_and_equal_eager(block, fused_graphs):
    model = _randomize(block()).eval()
    x = torch.randn(2, 6 if block is MBConv else 3, 11, 13)
    out, expected, graph = run_model_twice(model, x, channels_last=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert len(graph.rewrites.get("spatial_means", [])) == 1, graph.rewrites
    targets = [n.target for n in fused_graphs[-1].graph.nodes if n.op == "call_function"]
    assert spatial_mean in targets
    assert {e["mode"] for e in graph.runtime_modes()} == {"fusion"}


def test_nchw_means_stay_atens():
    model = _randomize(MBConv()).eval()
    out, expected, graph = run_model_twice(model, torch.randn(2, 6, 11, 13), channels_last=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not graph.rewrites.get("spatial_means"), graph.rewrites


class KeywordPool(nn.Module):
    """The pool and the mean spelled with keywords only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.conv(x))
        pooled = F.adaptive_avg_pool2d(input=y, output_size=1)
        return pooled, torch.mean(input=y * 2.0, dim=(-1, -2), keepdim=False)


def test_keyword_spellings_are_rewritten_too():
    model = KeywordPool().eval()
    out, expected, graph = run_model_twice(model, torch.randn(2, 3, 9, 10), channels_last=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert len(graph.rewrites.get("spatial_means", [])) == 2, graph.rewrites


@pytest.mark.parametrize("shape", [(2, 37, 5, 7), (2, 16, 40, 40)])  # one launch; partial sums
def test_precompile_warms_the_kernels_the_launch_runs(monkeypatch, shape):
    # The warm-ups must specialise as the launches do, or the first call compiles them again
    # (each cost a compile at the first launch before the family had a precompile job).
    from helpers import LaunchRecorder, as_triton_sees

    from fusebackend.kernels import spatial_mean as module

    launches, warmups = [], []
    recorder = LaunchRecorder(launches, warmups)
    monkeypatch.setattr(module, "_sum_kernel", lambda: recorder)
    monkeypatch.setattr(module, "_finish_kernel", lambda: recorder)
    x = torch.randn(shape, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    spatial_mean(x, True, channels_last=True)
    module.precompile_spatial_mean(x, True)
    assert len(launches) == len(warmups) == (1 if shape[2] == 5 else 2)
    for (run_args, run_grid, run_meta), (warm_args, warm_grid, warm_meta) in zip(
        launches, warmups, strict=True
    ):
        assert [as_triton_sees(a) for a in warm_args] == [as_triton_sees(a) for a in run_args]
        assert (warm_grid, warm_meta) == (run_grid, run_meta)
    assert module._precompile_job((x, True, True)) is None  # CPU tensors: nothing ahead
