"""Convolution + bias (+ residual add) + ReLU as one cuDNN call (passes/conv_activation.py,
kernels/conv.py).

The pass takes CUDA half-precision graphs only, where cuDNN's fused call was measured. On the
CPU ``conv2d_relu`` computes ``F.conv2d``, ``+ z`` and ``relu``, so the CPU tests widen the
pass's gates (``DEVICE_TYPES``, ``DTYPES``) and check the rewrite itself: which convolutions it
takes, with their BatchNorms folded into the weights (half precision too), the residual it
picks, outputs equal to eager's, and an in-place weight edit after compiling. The cuDNN calls:
the GPU tests at the end, on timm ResNets with random BatchNorm statistics.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_batch_norm_folding import Bottleneck, _randomize_statistics

import fusebackend
from fusebackend import report
from fusebackend.kernels.conv import conv2d_relu
from fusebackend.passes import conv_activation

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2)}


@pytest.fixture
def cpu_gates(monkeypatch):
    monkeypatch.setattr(conv_activation, "DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(conv_activation, "DTYPES", {torch.float16, torch.float32})


def _run(model: nn.Module, x: torch.Tensor):
    torch._dynamo.reset()
    fusebackend.clear_cache()
    before = report._recorded  # the reports keep 256 graphs: count, not slice
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        expected, out = model(x), compiled(x)
    (graph,) = report._reports_since(before)
    # the fused graph ran, not the unfused one after a failed validation
    assert set(fusebackend.stats()["fusion_modes"].values()) == {"fusion"}, fusebackend.stats()
    return expected, out, graph


def _calls(graph_module: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    return [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_bottlenecks_three_convolutions_each_end_in_one_call(cpu_gates, fused_graphs, dtype):
    model = _randomize_statistics(Bottleneck()).to(dtype)
    x = torch.randn(2, 6, 7, 9, dtype=dtype)
    expected, out, graph = _run(model, x)
    torch.testing.assert_close(out, expected, rtol=TOLERANCES[dtype][0], atol=TOLERANCES[dtype][1])
    assert graph.path == "fused", graph.path
    assert graph.rewrites["conv_activations"] == ["conv2d", "conv2d_1", "conv2d_2"], graph.rewrites
    (fused,) = fused_graphs
    calls = _calls(fused, conv2d_relu)
    assert len(calls) == 3
    # the last one adds the shortcut: the projection's convolution, left as a convolution
    # whose BatchNorm (half precision: not followed by a ReLU) stays an fp32 scale and shift
    assert [c.args[7] is not None for c in calls] == [False, False, True]
    assert len(_calls(fused, torch.conv2d)) == 1
    assert len(graph.rewrites["batch_norms_folded"]) == 4
    scales = [n for n in fused.graph.nodes if n.op == "get_attr" and n.target.endswith("_scale")]
    assert len(scales) == (1 if dtype == torch.float16 else 0)


def test_cpu_graphs_are_left_alone_by_default():
    model = _randomize_statistics(Bottleneck())
    expected, out, graph = _run(model, torch.randn(2, 6, 7, 9))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not graph.rewrites.get("conv_activations")


class NotTaken(nn.Module):
    """A grouped convolution + ReLU, a convolution whose output is read twice, one whose add
    scales the residual (alpha), and one whose ReLU is a part of a concatenation (GhostNet's
    primary part, which its group writes into the result): none is one fused call."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.shared = nn.Conv2d(4, 4, 1)
        self.scaled = nn.Conv2d(4, 4, 1)
        self.part = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.grouped(x))
        b = self.shared(a)
        c = torch.relu(b) + b
        d = torch.relu(torch.add(self.scaled(c), c, alpha=2.0))
        return torch.cat([torch.relu(self.part(d)), d], dim=1)


def test_grouped_shared_scaled_or_concatenated_convolutions_are_not_taken(cpu_gates):
    expected, out, graph = _run(NotTaken().eval(), torch.randn(2, 4, 5, 6))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not graph.rewrites.get("conv_activations"), graph.rewrites


def test_a_weight_edited_in_place_after_compiling_gives_eagers_new_result(cpu_gates):
    model = _randomize_statistics(Bottleneck()).half()
    x = torch.randn(2, 6, 7, 9, dtype=torch.float16)
    _, _, graph = _run(model, x)
    assert len(graph.rewrites["conv_activations"]) == 3
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        model.conv3.weight.mul_(-2.0)
        model.bn1.running_var.add_(1.0)
        out, expected = compiled(x), model(x)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    assert set(fusebackend.stats()["fusion_modes"].values()) == {"fusion"}, fusebackend.stats()


# --- GPU: cuDNN's fused calls -------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_cudnn_call_equals_the_convolution_add_and_relu(residual, dtype):
    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(3, 32, 13, 11, device="cuda", dtype=dtype).contiguous(memory_format=cl)
    w = (torch.randn(48, 32, 3, 3, device="cuda", dtype=dtype) * 0.1).contiguous(memory_format=cl)
    b = torch.randn(48, device="cuda", dtype=dtype)
    args = ((2, 1), (1, 0), (1, 1), 1)
    y = torch.nn.functional.conv2d(x.float(), w.float(), b.float(), *args)
    z = torch.randn_like(y).to(dtype).contiguous(memory_format=cl) if residual else None
    expected = torch.relu(y if z is None else y + z.float())
    out = conv2d_relu(x, w, b, *args, z)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def _calibrated(model: nn.Module, size: int) -> nn.Module:
    """Random BatchNorm affine parameters, running statistics measured on random images in
    fp32 (as ``benchmarks/vision.py`` does: timm's own init makes most blocks the identity)."""
    gen = torch.Generator().manual_seed(1)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
            m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
            m.reset_running_stats()
            m.momentum = None
        model.train()
        for _ in range(2):
            model(torch.randn(4, 3, size, size, generator=gen))
    return model.eval()


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_timm_resnets_run_their_relu_convolutions_fused_and_match_eager(name):
    # Folded into fp16 weights, the logits move from eager fp16's by about as much as eager
    # fp16's are from fp32 (ResNet-50: a few percent of their norm), towards fp32: the fused
    # graph must be at least as near fp32's result as eager fp16 is (as validation asks).
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = _calibrated(timm.create_model(name, pretrained=False), 96).cuda()
    x = torch.randn(2, 3, 96, 96, device="cuda")
    with torch.no_grad():
        reference = model(x)  # fp32
    model, x = model.half(), x.half()
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    torch._dynamo.reset()
    fusebackend.clear_cache()
    before = report._recorded  # the reports keep 256 graphs: count, not slice
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        expected = model(x)
        for _ in range(3):  # the 2nd call captures, the 3rd replays
            out = compiled(x)
        model.layer1[0].conv1.weight.mul_(0.5)  # in place after compiling
        edited, expected_edited = compiled(x), model(x)
    (graph,) = report._reports_since(before)
    # every convolution but the shortcuts' projections ends in a ReLU
    with_relu = [n for n in convs if "downsample" not in n]
    assert len(graph.rewrites["conv_activations"]) == len(with_relu), graph.rewrites
    assert set(fusebackend.stats()["fusion_modes"].values()) == {"fusion"}, fusebackend.stats()
    assert _distance(out, reference) <= 1.25 * _distance(expected, reference) + 1e-3
    # the edit moved eager's logits far more than folding does, and the fold followed it
    assert _distance(expected_edited, expected) > 5 * _distance(out, expected)
    assert _distance(edited, expected_edited) <= 2 * _distance(out, expected) + 1e-3


def test_a_symbolic_batch_runs_the_fused_calls_at_every_size(cpu_gates):
    model = _randomize_statistics(Bottleneck()).half()
    torch._dynamo.reset()
    fusebackend.clear_cache()
    before = report._recorded  # the reports keep 256 graphs: count, not slice
    compiled = torch.compile(model, backend="infinifuse", dynamic=True)
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, 6, 7, 9, dtype=torch.float16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-2, atol=1e-2)
    graphs = report._reports_since(before)
    assert [len(g.rewrites["conv_activations"]) for g in graphs] == [3], graphs
    assert set(fusebackend.stats()["fusion_modes"].values()) == {"fusion"}, fusebackend.stats()
