"""Depthwise convolutions with their BatchNorm and activation as one Triton kernel
(passes/depthwise.py, kernels/depthwise_conv.py).

The kernel (Triton's interpreter) against aten's convolution and ops in fp32, at odd shapes,
strides, paddings and dilations, every activation, with and without the per-channel
center, scale and shift; the pass through the backend on blocks written as timm writes them
(MBConv, MobileNetV3's inverted residual with hardswish, a ghost module): which
convolutions it takes, with which ops, outputs equal to eager's, an in-place weight edit
and ``load_state_dict`` after compiling; what it leaves to cuDNN (NCHW graphs, 7 x 7
windows, a part of a concatenation, a bias-free BatchNorm whose value another node reads).
The pass takes CUDA graphs only; these tests add the CPU (``DEVICE_TYPES``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import EAGER_ACTIVATIONS, KERNEL_TOLERANCES, graphs_since
from test_batch_norm_folding import _randomize_statistics as _randomize
from test_channels_last import ConvNeXtBlock, MBConv

import fusebackend
from fusebackend.kernels import depthwise_conv
from fusebackend.kernels.depthwise_conv import depthwise_conv2d
from fusebackend.passes import depthwise


def _expected(x, weight, stride, padding, dilation, center, scale, shift, activation):
    """The kernel's value in aten's fp32 ops, rounded once."""
    y = F.conv2d(x.float(), weight.float(), None, stride, padding, dilation, x.shape[1])
    for vector, op in ((center, torch.sub), (scale, torch.mul), (shift, torch.add)):
        if vector is not None:
            y = op(y, vector.float().view(-1, 1, 1))
    return EAGER_ACTIVATIONS[activation](y).to(x.dtype)


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "padding", "dilation"),
    [
        ((2, 5, 9, 7), 3, 1, 1, 1),  # a part of a channel block
        ((1, 19, 11, 10), 5, 2, 2, 1),  # 5 x 5, stride 2, odd sizes
        ((3, 33, 6, 8), 3, 2, 0, 1),  # no padding: the window never leaves the image
        ((1, 8, 7, 9), 3, 1, 2, 2),  # dilation
        ((2, 4, 5, 5), (1, 3), (1, 2), (0, 1), 1),  # a rectangular window
        # windows over 3 x 3: the rows in a loop (depthwise_conv._row_loop)
        ((1, 6, 9, 8), (5, 3), 1, (4, 1), (2, 1)),  # tall, rows dilated
        ((2, 10, 8, 9), 7, 1, 3, 1),
    ],
)
@pytest.mark.parametrize("affine", [True, False])
def test_the_kernel_equals_atens_convolution(shape, kernel, stride, padding, dilation, affine):
    torch.manual_seed(0)
    pair = lambda v: (v, v) if isinstance(v, int) else v  # noqa: E731
    kh, kw = pair(kernel)
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(shape[1], 1, kh, kw)
    vectors = [torch.randn(shape[1]), torch.rand(shape[1]) + 0.5, torch.randn(shape[1])]
    center, scale, shift = vectors if affine else (None, None, None)
    args = (x, weight, pair(stride), pair(padding), pair(dilation), center, scale, shift, "silu")
    out = depthwise_conv2d(*args)
    expected = _expected(*args)
    assert out.shape == expected.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_only_windows_over_three_by_three_loop_over_their_rows():
    # A wide window's taps unrolled made the longest compiles of a convnet's first call
    x = torch.randn(1, 4, 9, 9).contiguous(memory_format=torch.channels_last)
    looped = {}
    for kh, kw in [(3, 3), (1, 3), (3, 5), (5, 5), (7, 7)]:
        args = (x, torch.randn(4, 1, kh, kw), (1, 1), (kh // 2, kw // 2), (1, 1))
        out = torch.empty(depthwise_conv._output_shape(*args))
        launch = depthwise_conv._launch(*args, None, None, None, "", None, out)
        looped[kh, kw] = launch[2]["ROW_LOOP"]
    assert looped == {(3, 3): False, (1, 3): False, (3, 5): True, (5, 5): True, (7, 7): True}


@pytest.mark.parametrize("activation", sorted(EAGER_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_activation_and_dtype(activation, dtype):
    torch.manual_seed(1)
    # 30 positions x 21 channels: 2 x 2 programs, the last of each partial
    x = (torch.randn(2, 21, 5, 3) * 2).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(21, 1, 3, 3).to(dtype)
    scale = torch.rand(21) + 0.5  # fp32 vectors, as a half-precision BatchNorm's are
    shift = torch.randn(21)
    args = (x, weight, (1, 1), (1, 1), (1, 1), None, scale, shift, activation)
    out = depthwise_conv2d(*args)
    assert out.dtype == dtype
    rtol, atol = KERNEL_TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), _expected(*args).float(), rtol=rtol, atol=atol)


def test_an_nchw_input_gets_atens_value():
    x = torch.randn(2, 6, 5, 5)  # channels not contiguous: the kernel is not launched
    weight = torch.randn(6, 1, 3, 3)
    out = depthwise_conv2d(x, weight, (1, 1), (1, 1), (1, 1), None, None, None, "relu")
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.relu(F.conv2d(x, weight, None, 1, 1, 1, 6)))


@pytest.fixture
def cpu_gates(monkeypatch):
    monkeypatch.setattr(depthwise, "DEVICE_TYPES", {"cuda", "cpu"})


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expand + BN + hardswish, depthwise 5x5 stride 2 + BN +
    hardswish, 1x1 project + BN."""

    def __init__(self, channels: int = 5, expanded: int = 14) -> None:
        super().__init__()
        self.expand = nn.Conv2d(channels, expanded, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(expanded)
        self.dw = nn.Conv2d(expanded, expanded, 5, 2, 2, groups=expanded, bias=False)
        self.bn2 = nn.BatchNorm2d(expanded)
        self.project = nn.Conv2d(expanded, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.hardswish(self.bn1(self.expand(x)))
        y = F.hardswish(self.bn2(self.dw(y)))
        return self.bn3(self.project(y))


class GhostModule(nn.Module):
    """GhostNet's: a 1x1 conv + BN + ReLU, a depthwise 3x3 + BN + ReLU on it, concatenated."""

    def __init__(self, channels: int = 6, out: int = 8) -> None:
        super().__init__()
        self.primary = nn.Sequential(nn.Conv2d(channels, out // 2, 1, bias=False),
                                     nn.BatchNorm2d(out // 2), nn.ReLU())  # fmt: skip
        half = out // 2
        self.cheap = nn.Sequential(nn.Conv2d(half, half, 3, 1, 1, groups=half, bias=False),
                                   nn.BatchNorm2d(half), nn.ReLU())  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.primary(x)
        return torch.cat([x1, self.cheap(x1)], dim=1)


class GhostResidual(nn.Module):
    """GhostNet's second ghost module (no activation) and the bottleneck's residual add."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        half = channels // 2
        self.primary = nn.Sequential(nn.Conv2d(channels, half, 1, bias=False), nn.BatchNorm2d(half))
        self.cheap = nn.Sequential(nn.Conv2d(half, half, 3, 1, 1, groups=half, bias=False),
                                   nn.BatchNorm2d(half))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.primary(x)
        out = torch.cat([x1, self.cheap(x1)], dim=1)
        return out[:, :8] + x


class GhostScaled(GhostResidual):
    """GhostResidual with a product in place of its add: not a residual the kernel takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.primary(x)
        return torch.cat([x1, self.cheap(x1)], dim=1)[:, :8] * x


class SharedNorm(nn.Module):
    """A depthwise conv whose BatchNorm's value is read twice: the activation is not taken."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.dw(x))
        return F.silu(y) + y.mean((2, 3), keepdim=True)


def _run(model: nn.Module, x: torch.Tensor, dtype: torch.dtype = torch.float32, **options):
    torch._dynamo.reset()
    fusebackend.clear_cache()
    model, x = model.to(dtype), x.to(dtype)
    before = fusebackend.reports()
    compiled = torch.compile(model, backend="infinifuse", options={"channels_last": True,
                                                                    **options})  # fmt: skip
    with torch.no_grad():
        for _ in range(2):
            out = compiled(x)
        expected = model(x)
    (graph,) = graphs_since(before)
    assert {e["mode"] for e in graph.runtime_modes()} == {"fusion"}
    return out, expected, graph, compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [MBConv, InvertedResidual])
def test_blocks_run_the_kernel_with_norm_and_activation(block, dtype, cpu_gates, fused_graphs):
    model = _randomize(block()).eval()
    # 2 x 5 x 7 (MBConv: 70 positions, 5 programs of 16; MobileNetV3's stride 2: 2 x 3 x 4, 2
    # programs), the last partial and blocks that cross from one image into the next
    x = torch.randn(2, 6 if block is MBConv else 5, 5, 7)
    out, expected, graph, _ = _run(model, x, dtype)
    rtol, atol = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2),
                  torch.bfloat16: (5e-2, 5e-2)}[dtype]  # fmt: skip
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)
    (made,) = graph.rewrites["depthwise_convs"]
    (call,) = [n for n in fused_graphs[-1].graph.nodes if n.target is depthwise_conv2d]
    center, scale, shift, activation = call.args[5:9]
    assert activation == ("silu" if block is MBConv else "hardswish")
    # fp32 folds the norm into the weights (its shift moved after the conv: + bias); half
    # precision keeps its fp32 center, scale and shift after the conv, then the cast back
    if dtype == torch.float32:
        assert center is None and scale is None and shift is not None
        assert made.count(", ") == 1, made  # the add and the activation
    else:
        assert None not in (center, scale, shift)
        assert made.count(", ") == 4, made  # sub, mul, add, the cast, the activation


def test_weights_edited_after_compiling_give_eagers_new_result(cpu_gates):
    torch.manual_seed(2)
    model = _randomize(MBConv()).eval()
    x = torch.randn(2, 6, 9, 10)
    _, _, graph, compiled = _run(model, x)
    assert graph.rewrites["depthwise_convs"]
    with torch.no_grad():
        model.dw.weight.mul_(-1.5)
        model.bn2.running_var.add_(0.7)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        state = {k: v + 0.25 if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_ghost_module_writes_its_depthwise_part_into_the_concatenation(
    dtype, cpu_gates, fused_graphs
):
    model = _randomize(GhostModule()).eval()
    out, expected, graph, _ = _run(model, torch.randn(2, 6, 9, 10), dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    (made,) = graph.rewrites["depthwise_convs"]
    assert "(+ " in made, made  # with its norm and ReLU
    assert len(graph.rewrites["concatenations_written"]) == 1, graph.rewrites
    (call,) = [n for n in fused_graphs[-1].graph.nodes if n.target is depthwise_conv2d]
    assert len(call.args) == 11 and call.args[9] is None  # written into the part (its out)
    assert not [n for n in fused_graphs[-1].graph.nodes if n.target is torch.cat]


def test_an_out_of_another_shape_is_refused():
    x = torch.randn(1, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="out is"):
        depthwise_conv2d(x, torch.randn(4, 1, 3, 3), (1, 1), (1, 1), (1, 1), None, None,
                              None, "", out=torch.empty(1, 4, 4, 5))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_value_read_twice_ends_the_kernel_before_the_activation(dtype, cpu_gates, fused_graphs):
    model = _randomize(SharedNorm()).eval()
    out, expected, graph, _ = _run(model, torch.randn(2, 6, 7, 8), dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    (made,) = graph.rewrites["depthwise_convs"]
    (call,) = [n for n in fused_graphs[-1].graph.nodes if n.target is depthwise_conv2d]
    center, scale, shift, activation = call.args[5:9]
    assert activation == "" and shift is not None
    # fp32: the norm folded into the weights, its shift the convolution's bias (which stays:
    # the mean reads the convolution); half precision: sub, mul, add and the cast taken
    if dtype == torch.float32:
        assert "(+" not in made, made
    else:
        assert made.count(", ") == 3, made


@pytest.mark.parametrize(
    ("block", "options", "dtype"),
    [
        (MBConv, {"channels_last": False}, torch.float32),  # NCHW: channels not contiguous
        (ConvNeXtBlock, {}, torch.float32),  # a 7 x 7 window: not measured against cuDNN
    ],
)
def test_left_to_cudnn(block, options, dtype, cpu_gates):
    model = _randomize(block()).eval()
    channels = {MBConv: 6, ConvNeXtBlock: 8}[block]
    out, expected, graph, _ = _run(model, torch.randn(2, channels, 9, 9), dtype, **options)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert not graph.rewrites.get("depthwise_convs"), graph.rewrites


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_second_ghost_module_adds_its_shortcut_in_the_depthwise_kernel(dtype, cpu_gates,
                                                                         fused_graphs):  # fmt: skip
    # The add reading the concatenation runs on each part (pushed); on the depthwise part it
    # becomes the kernel's residual, and the kernel writes into the concatenation: a row
    # kernel (the 1 x 1's norm, its add, its part) and the depthwise kernel, nothing else.
    # (Half precision, as GhostNet runs: in fp32 the norms fold into cuDNN's convolutions.)
    model = _randomize(GhostResidual()).eval()
    out, expected, graph, _ = _run(model, torch.randn(2, 8, 9, 7), dtype)
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    assert graph.rewrites["pushed_into_cats"] and graph.rewrites["concatenations_written"]
    assert len(graph.rewrites["depthwise_convs"]) == len(graph.rewrites["depthwise_residuals"]) == 1
    (call,) = [n for n in fused_graphs[-1].graph.nodes if n.target is depthwise_conv2d]
    residual, into = call.args[9:]
    assert residual is not None and into is not None  # the shortcut's half; the cat's part
    assert graph.launches["depthwise_conv2d"] == 1 and sum(graph.launches.values()) == 2


def test_an_op_other_than_an_add_is_not_pushed_onto_a_depthwise_part(cpu_gates):
    # On the depthwise part it would be a launch of its own: it stays one op on the whole
    # concatenation, which both parts are written into.
    model = _randomize(GhostScaled()).eval()
    out, expected, graph, _ = _run(model, torch.randn(2, 8, 9, 7), torch.float16)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert graph.rewrites["depthwise_convs"] and not graph.rewrites.get("pushed_into_cats")
    assert not graph.rewrites.get("depthwise_residuals")


def test_the_pass_takes_cuda_graphs_only_by_default():
    model = _randomize(MBConv()).eval()
    out, expected, graph, _ = _run(model, torch.randn(2, 6, 9, 9))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert not graph.rewrites.get("depthwise_convs"), graph.rewrites


@pytest.mark.parametrize(
    ("affine", "into", "residual"),
    [(True, False, False), (False, False, False), (False, True, False), (True, True, True)],
)
def test_precompile_warms_the_kernel_the_launch_runs(monkeypatch, affine, into, residual):
    # The warm-up must specialise as the launch does (grid, meta-parameters, ints, each tensor
    # as its dtype and alignment), or the first call compiles the kernel again.
    from helpers import LaunchRecorder, as_triton_sees

    from fusebackend.kernels import depthwise_conv

    launches, warmups = [], []
    monkeypatch.setattr(depthwise_conv, "_kernel", lambda: LaunchRecorder(launches, warmups))
    x = torch.randn(2, 24, 9, 11, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    vectors = [torch.randn(24) for _ in range(3)] if affine else [None] * 3
    args = (x, torch.randn(24, 1, 5, 5, dtype=torch.float16), (2, 2), (2, 2), (1, 1), *vectors,
            "hardswish")  # fmt: skip
    if into:  # a concatenation's part: written through its strides
        cat = torch.empty(2, 40, 5, 6, dtype=torch.float16, memory_format=torch.channels_last)
        added = torch.randn(2, 5, 6, 25, dtype=torch.float16).permute(0, 3, 1, 2)[:, 1:]
        args = (*args, added if residual else None, cat[:, 16:])
    depthwise_conv2d(*args)
    depthwise_conv.precompile_depthwise_conv2d(*args)
    ((run_args, run_grid, run_meta),) = launches
    ((warm_args, warm_grid, warm_meta),) = warmups
    assert [as_triton_sees(a) for a in warm_args] == [as_triton_sees(a) for a in run_args]
    assert (warm_grid, warm_meta) == (run_grid, run_meta)
    assert depthwise_conv._precompile_job(args) is None  # CPU tensors: nothing ahead


def test_wide_offsets_take_the_int64_index_math(monkeypatch):
    # An image whose offsets pass int32 launches WIDE (decided on fake tensors: nothing that
    # large is allocated); the int64 branch itself, made to run on a small input, equals aten
    # (an overflow needs 2**31 elements, which no CPU test allocates).
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusebackend.kernels import depthwise_conv

    with FakeTensorMode():
        big = torch.empty(1, 64, 6000, 6000, memory_format=torch.channels_last)
        weight = torch.empty(64, 1, 3, 3)
        shape = depthwise_conv._output_shape(big, weight, (1, 1), (1, 1), (1, 1))
        out = depthwise_conv._empty_output(big, shape)
        launch = depthwise_conv._launch(big, weight, (1, 1), (1, 1), (1, 1), None, None, None,
                                        "", None, out)  # fmt: skip
    assert launch[2]["WIDE"]
    monkeypatch.setattr(depthwise_conv, "_INT32_OFFSETS", 0)
    torch.manual_seed(3)
    x = torch.randn(2, 12, 7, 9).contiguous(memory_format=torch.channels_last)
    args = (x, torch.randn(12, 1, 3, 3), (2, 1), (1, 2), (1, 2), None, torch.rand(12),
            torch.randn(12), "relu6")  # fmt: skip
    out = depthwise_conv2d(*args)
    assert depthwise_conv._launch(*args, None, out)[2]["WIDE"]
    torch.testing.assert_close(out, _expected(*args), rtol=1e-5, atol=1e-5)


def test_a_channel_slice_with_a_storage_offset_is_read_and_written_through_its_strides():
    torch.manual_seed(4)
    base = torch.randn(2, 11, 8, 6).contiguous(memory_format=torch.channels_last)
    x = base[:, 1:8]  # channels still contiguous; one element in; not channels-last itself
    assert x.storage_offset() == 1 and not x.is_contiguous(memory_format=torch.channels_last)
    args = (x, torch.randn(7, 1, 3, 3), (1, 2), (2, 1), (2, 1), torch.randn(7), None, None, "")
    out = depthwise_conv2d(*args)
    torch.testing.assert_close(out, _expected(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_residual_is_added_as_eagers_add_through_its_strides(dtype):
    # The residual is a channel slice (strided, offset) of a channels-last tensor, and the
    # value goes into a concatenation's part: the sum as eager rounds it (the kernel's value
    # rounded, then added and rounded again).
    torch.manual_seed(6)
    x = torch.randn(2, 10, 9, 7).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(10, 1, 3, 3).to(dtype)
    shortcut = torch.randn(2, 16, 9, 7).to(dtype).contiguous(memory_format=torch.channels_last)
    residual = shortcut[:, 5:15]
    cat = torch.zeros(2, 13, 9, 7, dtype=dtype).contiguous(memory_format=torch.channels_last)
    args = (x, weight, (1, 1), (1, 1), (1, 1), None, torch.rand(10) + 0.5, torch.randn(10),
            "relu")  # fmt: skip
    out = depthwise_conv2d(*args, residual, cat[:, 3:])
    assert out.data_ptr() == cat[:, 3:].data_ptr() and not cat[:, :3].any()
    expected = _expected(*args).to(dtype) + residual
    rtol, atol = KERNEL_TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


def test_a_residual_of_another_shape_or_dtype_is_refused():
    x = torch.randn(1, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    args = (x, torch.randn(4, 1, 3, 3), (1, 1), (1, 1), (1, 1), None, None, None, "")
    with pytest.raises(ValueError, match="residual is"):
        depthwise_conv2d(*args, torch.randn(1, 4, 5, 4))
    with pytest.raises(ValueError, match="residual is"):
        depthwise_conv2d(*args, torch.randn(1, 4, 5, 5, dtype=torch.float64))


def test_arguments_the_kernel_would_read_wrongly_are_refused():
    x = torch.randn(1, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"is not \[C, 1, KH, KW\]"):
        depthwise_conv2d(x, torch.randn(8, 1, 3, 3), (1, 1), (1, 1), (1, 1), None, None, None, "")
    with pytest.raises(ValueError, match="4 contiguous elements"):
        depthwise_conv2d(x, torch.randn(4, 1, 3, 3), (1, 1), (1, 1), (1, 1), None,
                         torch.randn(8)[::2], None, "")  # fmt: skip


def _fake_graph(fn, channels: int = 8, weight=None):
    """``fn(x, w, v)``'s graph over a fake channels-last fp16 image, a depthwise 3 x 3 weight
    (or ``weight``'s shape) and a [C, 1, 1] vector, with example values (on the CPU: fake
    CUDA convolutions without CUDA give contiguous strides)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = torch.fx.symbolic_trace(fn)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        half = {"device": "cpu", "dtype": torch.float16}
        x = torch.empty(2, channels, 9, 9, **half, memory_format=torch.channels_last)
        values = [x, torch.empty(weight or (channels, 1, 3, 3), **half),
                  torch.empty(channels, 1, 1, **half)]  # fmt: skip
        FakeTensorProp(gm, mode).propagate(*values)
    for node in gm.graph.nodes:
        node.meta["example_value"] = node.meta.get("val")
    return gm.graph


def _dw(x, w, groups=8):
    return torch.conv2d(x, w, None, 1, 1, 1, groups)


@pytest.mark.parametrize(
    ("fn", "taken", "activation"),
    [
        (lambda x, w, v: F.gelu(_dw(x, w) - v, approximate="tanh"), 2, "gelu_tanh"),
        (lambda x, w, v: F.hardtanh(_dw(x, w) * v, 0.0, 6.0), 2, "relu6"),  # nn.ReLU6
        (lambda x, w, v: F.hardtanh(_dw(x, w) * v, -1.0, 1.0), 1, ""),  # not relu6
        (lambda x, w, v: F.silu(v - _dw(x, w)), 0, ""),  # reversed: not a center
        (lambda x, w, v: torch.relu(torch.add(_dw(x, w), v, alpha=2)), 0, ""),
        (lambda x, w, v: torch.relu((_dw(x, w) + v).to("meta")), 1, ""),  # moved: not taken
    ],
)
def test_what_the_pass_takes_after_the_convolution(fn, taken, activation, cpu_gates):
    graph = _fake_graph(fn)
    made = depthwise.use_depthwise_convs(graph, depthwise_conv2d)
    (call,) = [n for n in graph.nodes if n.target is depthwise_conv2d]
    assert call.args[8] == activation
    (made,) = made
    ops = made.partition(" (+ ")[2].rstrip(")")
    assert (len(ops.split(", ")) if ops else 0) == taken, made
    graph.lint()


@pytest.mark.parametrize(
    ("fn", "taken"),
    [
        (lambda x, w, v: _dw(x, w) + x, True),
        (lambda x, w, v: x + _dw(x, w) * v, True),  # the mul is the kernel's, then the add
        (lambda x, w, v: torch.add(_dw(x, w), x, alpha=2), False),
        (lambda x, w, v: _dw(x, w) + x.float(), False),  # promoted to fp32: another dtype
        (lambda x, w, v: _dw(x, w) + v, False),  # per channel: the kernel's shift instead
        (lambda x, w, v: _dw(x, w) + x[:, :, :1], False),  # broadcast along H: another shape
        (lambda x, w, v: _dw(x, w) + x.add_(1), False),  # a write between
        (lambda x, w, v: (lambda y: (y + x, y.mean()))(_dw(x, w)), False),  # read twice
    ],
)
def test_which_adds_become_the_residual(fn, taken, cpu_gates):
    graph = _fake_graph(fn)
    depthwise.use_depthwise_convs(graph, depthwise_conv2d)
    made = depthwise.take_residual_adds(graph, depthwise_conv2d)
    graph.lint()
    (call,) = [n for n in graph.nodes if n.target is depthwise_conv2d]
    assert (call.args[9] is not None) == taken and len(made) == taken, made
    if taken:
        assert call.args[9].name == "x" and not [n for n in graph.nodes if "add" in n.name]


def test_a_channel_multiplier_is_left_to_cudnn(cpu_gates):
    graph = _fake_graph(lambda x, w, v: torch.conv2d(x, w, None, 1, 1, 1, 8), weight=(16, 1, 3, 3))
    assert depthwise.use_depthwise_convs(graph, depthwise_conv2d) == []
