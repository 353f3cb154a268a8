"""In-place ops made out-of-place (passes/out_of_place.py) and convolution biases moved into
the elementwise group after them (passes/conv_bias.py).

Blocks written the way timm and torchvision write them (``nn.ReLU(inplace=True)``,
``x += shortcut``, ``Tensor.mul_``, ``torch.relu_``, in-place hardswish): outputs equal eager's
at odd shapes, the in-place ops and the moved biases sit inside fused groups; a write into a
graph input or a view of one, into a view of a temporary whose base is read afterwards, or one
whose out-of-place result has another dtype stays in place with its reason, and eager's effect
on the input happens exactly once; a write into a view nobody else reads afterwards (GhostNet's
residual add into a slice of a concatenation) is made out-of-place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import assert_model_fused, graphs_since, rewrites_of

import fusebackend


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    fusebackend.clear_cache()


class InPlaceBlock(nn.Module):
    """conv + BN + ReLU(inplace), conv with bias + hardswish(inplace), ``+=`` shortcut,
    SiLU(inplace), ``mul_`` whose result is dropped, ``torch.relu_``."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 1)
        self.act1, self.act2 = nn.ReLU(inplace=True), nn.Hardswish(inplace=True)
        self.act3 = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shortcut = x
        x = self.act1(self.bn1(self.conv1(x)))
        before = x * 1.5  # reads x before the in-place ops below change it
        x = self.act2(self.conv2(x))
        x += shortcut
        x = self.act3(x)
        x.mul_(2.0)
        return torch.relu_(x), before


def _run(model: nn.Module, *inputs: torch.Tensor, calls: int = 2):
    before = fusebackend.reports()
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(calls):
            out = compiled(*inputs)
    return out, graphs_since(before)


def test_in_place_activations_and_residual_add_fuse_and_equal_eager():
    torch.manual_seed(0)
    model = InPlaceBlock().eval()
    with torch.no_grad():
        model.bn1.running_mean.normal_()
        model.bn1.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 6, 5, 7)
    with torch.no_grad():
        expected = model(x.clone())
    out, graphs = _run(model, x.clone())
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_model_fused(graphs, row_groups=2)  # validation kept the fused graph
    made = rewrites_of(graphs, "made_out_of_place")
    assert len(made) == 6, made  # relu, hardswish, +=, silu, mul_, relu_
    assert not rewrites_of(graphs, "in_place_left_alone")
    assert sorted(rewrites_of(graphs, "conv_biases_moved")) == ["conv2d", "conv2d_1"]
    fused = {node for g in graphs for group in g.groups for node in group.nodes}
    assert set(made) <= fused, (made, fused)  # every one of them inside a fused group


def test_a_write_into_a_graph_input_stays_in_place_and_happens_once():
    def f(x: torch.Tensor) -> torch.Tensor:
        x.relu_()
        return x * 2.0 + 1.0

    x = torch.randn(3, 17)
    expected_input = x.clone().relu_()
    before = fusebackend.reports()
    out = torch.compile(f, backend="infinifuse")(x)
    graphs = graphs_since(before)
    torch.testing.assert_close(x, expected_input)  # the input changed, once
    torch.testing.assert_close(out, expected_input * 2.0 + 1.0)
    left = rewrites_of(graphs, "in_place_left_alone")
    assert any("graph input" in reason for reason in left), left
    assert not rewrites_of(graphs, "made_out_of_place")


def test_a_write_through_a_view_of_a_temporary_stays_in_place():
    def f(x: torch.Tensor) -> torch.Tensor:
        t = x * 3.0
        head = t[:, :5]
        head.relu_()  # changes t too
        return torch.sigmoid(t + 1.0) * 2.0

    x = torch.randn(4, 11)
    before = fusebackend.reports()
    out = torch.compile(f, backend="infinifuse")(x)
    graphs = graphs_since(before)
    torch.testing.assert_close(out, f(x.clone()))
    left = rewrites_of(graphs, "in_place_left_alone")
    assert any("shares its storage" in r and "read after the write" in r for r in left), left


class GhostBlock(nn.Module):
    """timm's GhostNet bottleneck: a ghost module's output is a slice of a concatenation
    (a view), and the residual is added into it in place."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.primary = nn.Conv2d(channels, 4, 1, bias=False)
        self.cheap = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        a = torch.relu(self.primary(x))
        y = torch.cat([a, torch.relu(self.cheap(a))], dim=1)[:, :6]
        y += shortcut
        pooled = torch.relu_(y.mean((2, 3), keepdim=True)).flatten(1)  # (a view of the write)
        return torch.sigmoid(y) * 2.0, pooled * 3.0


def test_a_write_into_a_view_whose_base_is_not_read_again_is_made_out_of_place():
    model = GhostBlock().eval()
    x = torch.randn(2, 6, 5, 7)
    out, graphs = _run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    made = rewrites_of(graphs, "made_out_of_place")
    assert len(made) == 2, made
    assert not rewrites_of(graphs, "in_place_left_alone")
    # the add, the sigmoid and the multiply: one group
    assert any(made[0] in g.nodes and len(g.nodes) >= 3 for g in graphs[-1].groups), graphs
    assert {e["mode"] for e in graphs[-1].runtime_modes()} == {"fusion"}


def test_a_write_through_a_view_of_a_graph_input_stays_in_place_and_happens_once():
    def f(x: torch.Tensor) -> torch.Tensor:
        x[:, 1:].mul_(3.0)
        return torch.sigmoid(x) + 1.0

    x = torch.randn(3, 8)
    expected_input = x.clone()
    expected_input[:, 1:] *= 3.0
    before = fusebackend.reports()
    out = torch.compile(f, backend="infinifuse")(x)
    graphs = graphs_since(before)
    torch.testing.assert_close(x, expected_input)  # the input changed, once
    torch.testing.assert_close(out, torch.sigmoid(expected_input) + 1.0)
    left = rewrites_of(graphs, "in_place_left_alone")
    assert any("view of the graph input" in reason for reason in left), left


def test_an_in_place_op_that_casts_its_result_stays_in_place():
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = x * 2.0  # bfloat16
        t.add_(y)  # float32 operand: in place rounds the sum to bfloat16
        return torch.sigmoid(t * 3.0) + 1.0

    x, y = torch.randn(3, 9, dtype=torch.bfloat16), torch.randn(3, 9)
    before = fusebackend.reports()
    out = torch.compile(f, backend="infinifuse")(x, y)
    graphs = graphs_since(before)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, f(x, y), rtol=1e-2, atol=1e-2)
    left = rewrites_of(graphs, "in_place_left_alone")
    assert any("dtype" in reason for reason in left), left


def test_a_conv_whose_reader_is_not_elementwise_keeps_its_bias():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(4, 5, 3), nn.Conv2d(5, 3, 1), nn.ReLU()).eval()
    x = torch.randn(1, 4, 9, 6)
    out, graphs = _run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert_model_fused(graphs)
    moved = rewrites_of(graphs, "conv_biases_moved")
    assert len(moved) == 1, moved  # the second one only: the first one's reader is a conv


class ConvNeXtStem(nn.Module):
    """timm's ConvNeXt: a conv with bias read by ``permute(0, 2, 3, 1)`` and a LayerNorm over
    channels; a depthwise conv with bias read by a permute and by a residual-style add."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.norm = nn.Conv2d(3, 8, 2, stride=2), nn.LayerNorm(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        z = self.dw(y)
        return torch.sigmoid(z.permute(0, 2, 3, 1)) * 2.0, z * 0.5 + y


def test_a_conv_read_by_a_permute_gets_its_bias_after_the_permute():
    model = ConvNeXtStem().eval()
    x = torch.randn(2, 3, 10, 14)
    out, graphs = _run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert_model_fused(graphs)
    assert len(rewrites_of(graphs, "conv_biases_moved")) == 2
    norm = [g for g in graphs[-1].groups if "layer_norm" in " ".join(g.nodes)]
    assert norm and any("add" in n for n in norm[0].nodes), graphs[-1].groups


def test_a_reader_of_an_earlier_in_place_result_reads_the_rewritten_op():
    # u = t.index_fill_(...) returns t itself and stays in place (not a table op); t.relu_()
    # after it is made out-of-place: u's readers after it must read the relu's result.
    # Validation off: the check is the fused graph's own output.
    def g(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        t = x * 2.0
        u = t.index_fill_(1, idx, -1.0)
        t.relu_()
        return (u + 1.0) * 2.0 + 3.0

    x, idx = torch.randn(3, 9), torch.tensor([0, 2])
    before = fusebackend.reports()
    out = torch.compile(g, backend="infinifuse", options={"validate": False})(x, idx)
    graphs = graphs_since(before)
    torch.testing.assert_close(out, g(x.clone(), idx))
    assert rewrites_of(graphs, "made_out_of_place")  # the relu_ was rewritten


def test_an_unbatched_convolution_keeps_its_bias():
    # Conv1d on a (channels, length) input: its output's channels are dim 0, so a bias viewed
    # per channel as for a batch (dim 1) would add along the length.
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv1d(3, 4, 1), nn.ReLU()).eval()
    x = torch.randn(3, 4)
    before = fusebackend.reports()
    compiled = torch.compile(model, backend="infinifuse", options={"validate": False})
    with torch.no_grad():
        out = compiled(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert not rewrites_of(graphs_since(before), "conv_biases_moved")


def test_an_in_place_eval_dropout_is_dropped_and_the_relu_after_it_fuses():
    # F.dropout(x, training=False) returns x itself: in place it writes nothing
    torch.manual_seed(4)
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1, inplace=True), nn.ReLU(inplace=True))
    model = nn.Sequential(block, nn.Sigmoid()).eval()
    x = torch.randn(3, 8)
    out, graphs = _run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert len(rewrites_of(graphs, "made_out_of_place")) == 2
    assert not rewrites_of(graphs, "in_place_left_alone")
    assert_model_fused(graphs)
