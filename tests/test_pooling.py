"""2-d max and average pooling of channels-last tensors as one kernel (passes/pooling.py,
kernels/pool2d.py).

The kernel against aten's pooling at odd shapes, dtypes and every argument (stride, padding,
dilation, ceil mode, count_include_pad, divisor_override), NaN included; an Inception-style
block (conv + BN + ReLU branches, an average pool, a max pool, a concatenation) and a ResNet
stem in channels-last graphs: the pools are rewritten, outputs equal eager, the graph runs
fused; NCHW pools, pools with indices and pools of symbolic shape stay aten's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_model_twice
from test_batch_norm_folding import _randomize_statistics as _randomize

from fusebackend.kernels.pool2d import pool2d, pool2d_output_size

TOLERANCES = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
}

# (shape, kind, kernel, stride, padding, dilation, ceil_mode, count_include_pad, divisor)
CASES = [
    ((2, 37, 9, 11), "avg", (3, 3), (1, 1), (1, 1), (1, 1), False, True, None),  # Inception's
    ((2, 37, 9, 11), "avg", (3, 3), (2, 2), (1, 1), (1, 1), True, False, None),
    ((3, 70, 8, 7), "avg", (3, 2), (2, 1), (1, 0), (1, 1), True, True, None),
    ((2, 37, 9, 11), "avg", (2, 3), (2, 2), (1, 1), (1, 1), False, True, 5),
    ((2, 70, 9, 11), "max", (3, 3), (2, 2), (0, 0), (1, 1), False, True, None),  # its reductions
    ((2, 70, 10, 9), "max", (3, 3), (2, 2), (1, 1), (1, 1), True, True, None),  # ResNet's stem
    ((1, 130, 11, 13), "max", (3, 2), (2, 3), (1, 1), (2, 1), True, True, None),
    ((2, 9, 10, 13), "max", (2, 3), (1, 2), (1, 1), (1, 2), True, True, None),  # W dilated
    # windows running past the padded right edge (ceil mode), clipped there
    ((3, 70, 7, 8), "avg", (2, 3), (1, 2), (0, 1), (1, 1), True, True, None),
]


def _aten(x, kind, kernel, stride, padding, dilation, ceil_mode, count_include_pad, divisor):
    if kind == "max":
        return F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
    return F.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}-{c[0][1]}-{c[2]}-{c[3]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernel_equals_atens_pooling(case, dtype):
    torch.manual_seed(0)
    shape, *args = case
    x = (torch.randn(shape) * 3 + 1).to(dtype).contiguous(memory_format=torch.channels_last)
    out = pool2d(x, *args)
    expected = _aten(x.float(), *args).to(dtype)
    assert out.shape == expected.shape and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


def test_a_strided_input_is_read_through_its_strides_and_nan_wins_the_max():
    torch.manual_seed(1)
    base = torch.randn(2, 9, 12, 20).contiguous(memory_format=torch.channels_last)
    x = base[:, 1:8, ::2, 3:17]  # a view: no layout of its own
    args = ("max", (3, 3), (2, 2), (1, 1), (1, 1), False, True, None)
    torch.testing.assert_close(pool2d(x, *args), _aten(x, *args))
    x = x.clone(memory_format=torch.channels_last)
    x[1, 4, 3, 5] = float("nan")
    out, expected = pool2d(x, *args), _aten(x, *args)
    assert out.isnan().sum() == expected.isnan().sum() > 0
    torch.testing.assert_close(out, expected, equal_nan=True)


def test_nan_in_an_average_and_windows_of_padding_alone_are_atens():
    x = torch.randn(2, 6, 7, 9).contiguous(memory_format=torch.channels_last)
    x[0, 2, 3, 4] = float("nan")
    x[1, 1, 0, 0] = float("-inf")
    args = ("avg", (3, 3), (2, 2), (1, 1), (1, 1), True, False, None)
    torch.testing.assert_close(pool2d(x, *args), _aten(x, *args), equal_nan=True)
    # dilation 3 over 2 rows: a window's taps at rows -1 and 2 read padding alone (-inf)
    x = torch.randn(1, 4, 2, 5).contiguous(memory_format=torch.channels_last)
    args = ("max", (2, 2), (1, 1), (1, 1), (3, 1), False, True, None)
    out, expected = pool2d(x, *args), _aten(x, *args)
    assert expected.isinf().any()
    torch.testing.assert_close(out, expected)


def _recorded(monkeypatch):
    """pool2d's kernel replaced by a recorder: (launches, warm-ups)."""
    from helpers import LaunchRecorder

    from fusebackend.kernels import pool2d as module

    launches, warmups = [], []
    monkeypatch.setattr(module, "_pool_kernel", lambda: LaunchRecorder(launches, warmups))
    return module, launches, warmups


@pytest.mark.parametrize(
    "args",
    [("avg", (3, 3), (1, 1), (1, 1), (1, 1), False, True, None),
     ("max", (3, 2), (2, 2), (1, 1), (2, 1), True, True, None),
     ("avg", (2, 3), (2, 2), (1, 1), (1, 1), False, True, 5)],
)  # fmt: skip
def test_precompile_warms_the_kernel_the_launch_runs(monkeypatch, args):
    # The warm-up must specialise as the launch does (on a real and on a fake input), or the
    # first call compiles the kernel again.
    from helpers import as_triton_sees
    from torch._subclasses.fake_tensor import FakeTensorMode

    module, launches, warmups = _recorded(monkeypatch)
    x = torch.randn(2, 37, 9, 11, dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    module.pool2d(x, *args)
    module.precompile_pool2d(x, *args)
    with FakeTensorMode() as mode:
        module.precompile_pool2d(mode.from_tensor(x), *args)
    ((run_args, run_grid, run_meta),) = launches
    assert len(warmups) == 2
    for warm_args, warm_grid, warm_meta in warmups:
        assert [as_triton_sees(a) for a in warm_args] == [as_triton_sees(a) for a in run_args]
        assert (warm_grid, warm_meta) == (run_grid, run_meta)
    assert module._precompile_job((x, *args)) is None  # CPU tensors: nothing ahead


def test_what_the_kernel_does_not_take_runs_atens_pooling(monkeypatch):
    from fusebackend.passes import pooling

    module, launches, _ = _recorded(monkeypatch)
    assert pooling.MAX_TAPS == module.MAX_TAPS  # (the pass's copy: passes import no kernels)
    x = torch.randn(2, 5, 9, 9).contiguous(memory_format=torch.channels_last)
    wide = ("avg", (6, 5), (1, 1), (0, 0), (1, 1), False, True, None)  # 30 taps
    torch.testing.assert_close(module.pool2d(x, *wide), _aten(x, *wide))
    small = ("max", (3, 3), (2, 2), (1, 1), (1, 1), False, True, None)
    doubles = x.double()
    assert torch.equal(module.pool2d(doubles, *small), _aten(doubles, *small))
    monkeypatch.setattr(module, "_INT32_POSITIONS", 2 * 5 * 5 - 1)  # one position too many
    torch.testing.assert_close(module.pool2d(x, *small), _aten(x, *small))
    with pytest.raises(RuntimeError, match="divisor"):  # aten's own error
        module.pool2d(x, "avg", (2, 2), (2, 2), (0, 0), (1, 1), False, True, 0)
    assert launches == []
    monkeypatch.setattr(module, "_INT32_POSITIONS", 2 * 5 * 5)
    module.pool2d(x, *small)
    assert len(launches) == 1


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_output_sizes_are_atens(ceil_mode):
    for size, kernel, stride, padding, dilation in [(9, 3, 2, 1, 1), (10, 3, 2, 1, 1),
                                                    (7, 2, 3, 1, 2), (5, 5, 1, 2, 1)]:  # fmt: skip
        x = torch.zeros(1, 1, size, size)
        expected = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode).shape[-1]
        assert pool2d_output_size(size, kernel, stride, padding, dilation, ceil_mode) == expected


def test_bad_arguments_get_clear_errors():
    x = torch.randn(1, 2, 5, 5)
    with pytest.raises(ValueError, match="kind must be one of"):
        pool2d(x, "min", (2, 2), (2, 2), (0, 0), (1, 1), False, True, None)
    with pytest.raises(ValueError, match="no dilation"):
        pool2d(x, "avg", (2, 2), (2, 2), (0, 0), (2, 2), False, True, None)
    with pytest.raises(ValueError, match="4-d floating"):
        pool2d(x[0], "max", (2, 2), (2, 2), (0, 0), (1, 1), False, True, None)


class InceptionBlock(nn.Module):
    """An Inception-v3 block as timm writes it, after a conv + BN + ReLU: 1x1 and 3x3 conv + BN
    + ReLU branches, an
    average-pool branch (3x3, stride 1, padding 1, then a 1x1 conv), a max-pool branch
    (3x3, stride 2 on the reduction side), concatenations."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()

        def unit(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))  # fmt: skip

        self.stem = unit(channels, channels, 3)
        self.b1, self.b3 = unit(channels, 5, 1), unit(channels, 7, 3)
        self.pool_proj, self.reduce = unit(channels, 4, 1), unit(16, 9, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # (the pools read activations, as in the model: channels-last ones)
        pooled = self.pool_proj(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        y = torch.cat([self.b1(x), self.b3(x), pooled], 1)
        return torch.cat([self.reduce(y), F.max_pool2d(y, kernel_size=3, stride=2, padding=1)], 1)


class Stem(nn.Module):
    """A ResNet stem: 7x7 stride-2 conv + BN + ReLU, then nn.MaxPool2d(3, 2, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.bn(self.conv(x))))


@pytest.mark.parametrize(("block", "pools"), [(InceptionBlock, 2), (Stem, 1)])
def test_channels_last_pools_run_as_the_kernel_and_equal_eager(block, pools, fused_graphs):
    torch.manual_seed(2)
    model = _randomize(block()).eval()
    x = torch.randn(2, 6 if block is InceptionBlock else 3, 13, 11)
    out, expected, graph = run_model_twice(model, x, channels_last=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert len(graph.rewrites.get("pool_kernels", [])) == pools, graph.rewrites
    targets = [n.target for n in fused_graphs[-1].graph.nodes if n.op == "call_function"]
    assert targets.count(pool2d) == pools
    assert not {F.max_pool2d, F.avg_pool2d, torch.max_pool2d} & set(targets)
    assert {e["mode"] for e in graph.runtime_modes()} == {"fusion"}


def test_nchw_pools_stay_atens():
    model = _randomize(InceptionBlock()).eval()
    out, expected, graph = run_model_twice(model, torch.randn(2, 6, 13, 11), channels_last=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not graph.rewrites.get("pool_kernels"), graph.rewrites


class Spellings(nn.Module):
    """Pools spelled every way Dynamo's graphs hold them, with non-square arguments and every
    flag, after a conv (channels-last activations); the last returns indices."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.modules_ = nn.ModuleList([nn.AvgPool2d(2), nn.MaxPool2d(3, 2, 1, dilation=2)])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = torch.relu(self.conv(x))
        return [
            torch.max_pool2d(y, [3], [2], [1], [1], True),
            F.max_pool2d(y, (3, 2), None, (1, 0)),
            F.avg_pool2d(
                y,
                kernel_size=(3, 2),
                stride=[],
                padding=(1, 0),
                ceil_mode=True,
                count_include_pad=False,
                divisor_override=4,
            ),  # fmt: skip
            F.avg_pool2d(y, 3, 2, 1, True, True, 7),
            F.max_pool2d(y, 2, 1, 0, (2, 1), False),
            self.modules_[0](y),
            self.modules_[1](y),
            F.avg_pool2d(y, 6) * 1.0,  # 36 taps: aten's
            F.max_pool2d(y, 2, 2, 0, 1, False, True)[1],  # indices: aten's
        ]


def test_every_spelling_is_rewritten_with_its_arguments():
    torch.manual_seed(3)
    out, expected, graph = run_model_twice(
        Spellings().eval(), torch.randn(2, 3, 15, 14), channels_last=True
    )
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(graph.rewrites.get("pool_kernels", [])) == 7, graph.rewrites


class PoolWithIndices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled, indices = F.max_pool2d(torch.relu(self.conv(x)), 2, return_indices=True)
        return pooled * 2.0, indices


def test_a_pool_with_indices_stays_atens():
    model = PoolWithIndices().eval()
    out, expected, graph = run_model_twice(model, torch.randn(2, 3, 9, 10), channels_last=True)
    torch.testing.assert_close(out, expected)
    assert not graph.rewrites.get("pool_kernels"), graph.rewrites
