"""Channels-last graphs (passes/channels_last.py) and elementwise groups walked in storage
order (passes/lowering.py's ``LoweredGroup.order``).

CPU, Triton's interpreter: blocks written the way timm writes them (a ResNet bottleneck, an
MBConv with squeeze-excite, a ConvNeXt block), in eval mode with non-trivial BatchNorm
statistics, at odd sizes. Outputs equal eager's and keep eager's strides; the fused graph runs
its convolutions on channels-last weight copies and its groups in storage order; a weight
edited in place or loaded after compiling gives eager's new result; a reader that needs the
traced layout gets it back; what is not run channels-last says why.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from helpers import graphs_since
from test_batch_norm_folding import Bottleneck, _randomize_statistics

import fusebackend
from fusebackend.passes.channels_last import choose_channels_last
from fusebackend.passes.concat_writes import written_parts
from fusebackend.passes.fx_util import example_value
from fusebackend.passes.rewrite import in_storage_order

TOLERANCES = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    # bf16 outputs near 4 are 0.03125 apart: the chains here differ from eager by up to two
    # of those steps (channels-last or not: the same figures with channels_last=False)
    torch.bfloat16: (3e-2, 7e-2),
}


class MBConv(nn.Module):
    """An EfficientNet block: 1x1 expand + BN + SiLU, depthwise 3x3 + BN + SiLU, a
    squeeze-excite gate (mean over H x W, two 1x1 convs, SiLU, sigmoid), 1x1 project + BN,
    the residual add."""

    def __init__(self, channels: int = 6, expanded: int = 12, squeezed: int = 3) -> None:
        super().__init__()
        self.expand = nn.Conv2d(channels, expanded, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(expanded)
        self.dw = nn.Conv2d(expanded, expanded, 3, padding=1, groups=expanded, bias=False)
        self.bn2 = nn.BatchNorm2d(expanded)
        self.reduce, self.grow = nn.Conv2d(expanded, squeezed, 1), nn.Conv2d(squeezed, expanded, 1)
        self.project = nn.Conv2d(expanded, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.bn1(self.expand(x)))
        y = F.silu(self.bn2(self.dw(y)))
        gate = self.grow(F.silu(self.reduce(y.mean((2, 3), keepdim=True))))
        y = y * gate.sigmoid()
        return self.bn3(self.project(y)) + x


class ConvNeXtBlock(nn.Module):
    """A ConvNeXt block: depthwise 7x7, a LayerNorm over channels after a permute, two linears
    with a GELU, a layer scale, the permute back and the residual add."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class Viewed(nn.Module):
    """A conv whose output is read through ``view`` (which needs its traced strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 5, 3, padding=1, bias=False), nn.BatchNorm2d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)))
        return y.view(y.shape[0], y.shape[1], -1).softmax(-1)


_BEFORE: list = []


def _compiled(model: nn.Module, dynamic: bool | None = None, **options):
    torch._dynamo.reset()
    fusebackend.clear_cache()
    _BEFORE[:] = [fusebackend.reports()]
    return torch.compile(model, backend="infinifuse", dynamic=dynamic, options=options)


def _graph():
    graphs = graphs_since(_BEFORE[0])
    assert len(graphs) == 1, graphs
    return graphs[0]


def _ran_fused(graph) -> None:
    """Every signature ran the fused graph: validation found it equal to the unfused one (a
    wrong fused graph falls back to the unfused graph, whose outputs equal eager's)."""
    modes = [entry["mode"] for entry in graph.runtime_modes()]
    assert modes and set(modes) == {"fusion"}, graph.runtime_modes()


def _assert_like_eager(out: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    assert out.stride() == expected.stride(), (out.stride(), expected.stride())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_group_over_channels_last_tensors_walks_them_in_storage_order(dtype, fused_graphs):
    # A user's channels-last tensors: the group's rows run along C (contiguous) and its output
    # is channels-last, as eager's; the per-channel operand [C, 1, 1] and a [N, C, 1, 1] gate
    # broadcast in that order too.
    def block(x, skip, scale, gate):
        return F.silu(x * scale + skip) * gate.sigmoid()

    x = torch.randn(2, 5, 7, 3, dtype=dtype).to(memory_format=torch.channels_last)
    skip = torch.randn(2, 5, 7, 3, dtype=dtype).to(memory_format=torch.channels_last)
    scale = torch.randn(5, 1, 1, dtype=dtype)
    gate = torch.randn(2, 5, 1, 1, dtype=dtype)
    with torch.no_grad():
        out = _compiled(block)(x, skip, scale, gate)
    _assert_like_eager(out, block(x, skip, scale, gate))
    (group,) = _graph().groups
    assert len(group.nodes) == 5, group.nodes
    walks = [n for n in fused_graphs[0].graph.nodes if n.target is in_storage_order]
    assert len(walks) == 4 and all(n.args[1] == (0, 2, 3, 1) for n in walks), walks


def test_mixed_layouts_and_contiguous_tensors_keep_their_results():
    # One channels-last operand and one contiguous: the group walks the first's order and
    # reads the other through its strides; all-contiguous groups are not walked differently.
    def block(x, y):
        return torch.relu(x + 2 * y)

    x = torch.randn(3, 4, 5, 6).to(memory_format=torch.channels_last)
    y = torch.randn(3, 4, 5, 6)
    with torch.no_grad():
        _assert_like_eager(_compiled(block)(x, y), block(x, y))
        _assert_like_eager(_compiled(block)(y, x), block(y, x))
        _assert_like_eager(_compiled(block)(y, y), block(y, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [Bottleneck, MBConv, ConvNeXtBlock])
def test_blocks_run_channels_last_and_equal_eager(block, dtype, fused_graphs):
    torch.manual_seed(0)
    model = _randomize_statistics(block()).to(dtype)
    channels = next(m for m in model.modules() if isinstance(m, nn.Conv2d)).in_channels
    x = torch.randn(2, channels, 9, 7, dtype=dtype)
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    with torch.no_grad():
        out = _compiled(model, channels_last=True)(x)
        expected = model(x)
    _assert_like_eager(out, expected)
    graph = _graph()
    assert graph.path == "fused", graph.path
    _ran_fused(graph)
    assert len(graph.rewrites["channels_last"]) == convs, graph.rewrites
    assert not graph.rewrites.get("channels_last_left_alone"), graph.rewrites
    fused = fused_graphs[0].graph
    entry = [n for n in fused.nodes if n.target == "contiguous" and n.kwargs]
    assert len(entry) == 1 and entry[0].args[0].op == "placeholder"  # the image, once
    for conv in (n for n in fused.nodes if n.target is torch.conv2d):
        weight = conv.args[1]
        value = weight.meta["example_value"]
        assert value.is_contiguous(memory_format=torch.channels_last), weight
        if weight.op == "placeholder":  # the user's: both layouts at once (1x1, depthwise)
            assert value.is_contiguous(), weight
        else:  # a copy of the user's weight, or (fp32) the BatchNorm folded into a buffer
            folded = dtype == torch.float32 and "_folded_" in weight.target
            assert ("_channels_last_" in weight.target) != folded, weight
        assert conv.meta["example_value"].is_contiguous(memory_format=torch.channels_last)
    if block is not ConvNeXtBlock:  # (its groups read the NCHW input x: they keep NCHW)
        assert any(n.target is in_storage_order for n in fused.nodes)


def test_an_edited_or_loaded_weight_reaches_the_channels_last_copy(fused_graphs):
    def convs():
        return nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Conv2d(5, 4, 3, padding=1)).eval()

    model = convs()
    x = torch.randn(2, 3, 8, 7)
    compiled = _compiled(model, channels_last=True)
    with torch.no_grad():
        compiled(x)
        copies = [n for n in fused_graphs[0].graph.nodes if n.op == "get_attr"]
        assert len(copies) == 2 and all("_channels_last_" in n.target for n in copies)
        model[2].weight.mul_(-1.5)  # in place, after compiling
        _assert_like_eager(compiled(x), model(x))
        other = convs()
        model.load_state_dict(other.state_dict())
        _assert_like_eager(compiled(x), other(x))
    _ran_fused(_graph())


class StandardisedConvs(nn.Module):
    """Two weight-standardised convolutions (timm's StdConv2d, BiT's): each weight is
    computed from its parameter every call, then convolved."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Conv2d(3, 5, 3), nn.Conv2d(5, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in (self.first, self.second):
            flat = conv.weight.reshape(1, conv.out_channels, -1)
            weight = F.batch_norm(flat, None, None, training=True, momentum=0.0, eps=1e-6)
            x = F.relu(F.conv2d(x, weight.reshape_as(conv.weight), conv.bias, padding=conv.padding))
        return x


def test_a_weight_computed_from_parameters_is_one_channels_last_constant(fused_graphs):
    # The standardised weight is folded with its channels-last copy into one derived
    # constant in that layout: nothing converts a weight during the call, and an edited or
    # loaded parameter reaches it.
    torch.manual_seed(7)
    model = StandardisedConvs().eval()
    x = torch.randn(2, 3, 8, 7)
    compiled = _compiled(model, channels_last=True)
    with torch.no_grad():
        _assert_like_eager(compiled(x), model(x))
        fused = fused_graphs[0]
        convs = [n for n in fused.graph.nodes if n.target is torch.conv2d]
        assert len(convs) == 2
        for conv in convs:
            weight = conv.args[1]
            assert weight.op == "get_attr", weight.format_node()
            assert getattr(fused, weight.target).is_contiguous(memory_format=torch.channels_last)
        assert not _graph().rewrites.get("channels_last_left_alone")
        model.second.weight.mul_(-1.5)  # in place, after compiling
        _assert_like_eager(compiled(x), model(x))
        other = StandardisedConvs().eval()
        model.load_state_dict(other.state_dict())
        _assert_like_eager(compiled(x), other(x))
    _ran_fused(_graph())


def test_a_reader_that_needs_the_traced_layout_gets_it_back(fused_graphs):
    # view() of a channels-last tensor would raise: it reads a contiguous copy instead.
    model = _randomize_statistics(Viewed())
    x = torch.randn(2, 3, 6, 5)
    with torch.no_grad():
        _assert_like_eager(_compiled(model, channels_last=True)(x), model(x))
    (view,) = [n for n in fused_graphs[0].graph.nodes if n.target == "view" and len(n.args) == 4]
    # the copy back to the traced layout, written straight in it by the group computing it
    # (passes/folded_copies.py)
    assert view.args[0].target is written_parts, view.args[0].target
    assert example_value(view.args[0]).is_contiguous()


def test_the_default_says_why_a_cpu_graph_stays_as_traced():
    model = _randomize_statistics(Bottleneck())
    with torch.no_grad():
        _compiled(model)(torch.randn(1, 6, 5, 5))
    graph = _graph()
    assert "channels_last" not in graph.rewrites or not graph.rewrites["channels_last"]
    assert graph.rewrites["channels_last_left_alone"] == [
        "not on CUDA (channels_last=True forces it)"
    ]
    with torch.no_grad():
        _compiled(copy.deepcopy(model), channels_last=False)(torch.randn(1, 6, 5, 5))
    assert _graph().rewrites["channels_last_left_alone"] == ["channels_last=False"]
    with torch.no_grad():  # nothing to fuse: the graph is not rewritten, the reason stays
        _compiled(nn.Conv2d(3, 4, 3).eval())(torch.randn(1, 3, 8, 8))
    graph = _graph()
    assert graph.path == "unfused (nothing to fuse)", graph.path
    assert graph.rewrites["channels_last_left_alone"] == [
        "not on CUDA (channels_last=True forces it)"
    ]


def _fake_cuda_graph(weights: list[tuple[int, ...]], groups: list[int], dtype=torch.float16):
    """A graph of convolutions (one or two) over one fake CUDA image, with example values."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def one(x, w):
        return torch.conv2d(x, w, None, 1, 1, 1, groups[0])

    def two(x, w, v):
        return one(x, w) + torch.conv2d(x, v, None, 1, 1, 1, groups[1])

    gm = torch.fx.symbolic_trace(one if len(weights) == 1 else two)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        values = [torch.empty(1, 8, 9, 9, device="cuda", dtype=dtype)]
        values += [torch.empty(w, device="cuda", dtype=dtype) for w in weights]
        FakeTensorProp(gm, mode).propagate(*values)
    for node in gm.graph.nodes:
        node.meta["example_value"] = node.meta.get("val")
    return gm.graph


def test_the_default_chooses_channels_last_on_cuda_half_precision_only():
    dense, depthwise, grouped = (8, 8, 3, 3), (8, 1, 3, 3), (8, 2, 3, 3)
    wide_grouped = (8, 4, 3, 3)
    assert choose_channels_last(_fake_cuda_graph([dense, depthwise], [1, 8]), None) is None
    # a grouped convolution doing 20% of the work (ResNeXt): channels-last (weighted 0.90x)
    assert choose_channels_last(_fake_cuda_graph([dense, grouped], [1, 4]), None) is None
    # doing 80% (beside a depthwise one): NCHW, weighted 1.24x
    why = choose_channels_last(_fake_cuda_graph([depthwise, wide_grouped], [8, 2]), None)
    assert why is not None and "do 80% of the work" in why and "(1.24x;" in why, why
    assert choose_channels_last(_fake_cuda_graph([depthwise, wide_grouped], [8, 2]), True) is None
    why = choose_channels_last(_fake_cuda_graph([dense], [1], torch.float32), None)
    assert why == "not half precision (channels_last=True forces it)"


def test_a_graph_with_few_convolutions_for_its_size_stays_nchw_by_default():
    # ViT's patch embedding: one convolution, then hundreds of nodes of attention and MLPs.
    # Inductor's rule, fewer than one convolution per 300 nodes: NCHW unless forced.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def embed_then(ops):
        def f(x, w):
            y = torch.conv2d(x, w, None, 1, 1)
            for _ in range(ops):
                y = y * 1.5
            return y

        return f

    def graph(ops):
        gm = torch.fx.symbolic_trace(embed_then(ops))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            values = [torch.empty(1, 3, 9, 9, device="cuda", dtype=torch.float16),
                      torch.empty(8, 3, 3, 3, device="cuda", dtype=torch.float16)]  # fmt: skip
            FakeTensorProp(gm, mode).propagate(*values)
        for node in gm.graph.nodes:
            node.meta["example_value"] = node.meta.get("val")
        return gm.graph

    long = graph(300)  # 2 placeholders, the convolution, 300 products, the output: 304 nodes
    why = choose_channels_last(long, None)
    assert why is not None and why.startswith("1 convolution(s) among 304 nodes"), why
    assert choose_channels_last(long, True) is None
    assert choose_channels_last(graph(295), None) is None  # 299 nodes: one per 300 or more


@pytest.mark.parametrize("block", [Bottleneck, MBConv])
def test_dynamic_batch_sizes_run_channels_last_in_one_graph(block, fused_graphs):
    # A second batch size makes Dynamo compile a graph with a symbolic batch (automatic
    # dynamic shapes; dynamic=True here): layouts are compared through their stride
    # formulas (statically_known_true), so one graph serves every size, channels-last,
    # with its groups in storage order.
    torch.manual_seed(1)
    model = _randomize_statistics(block())
    channels = next(m for m in model.modules() if isinstance(m, nn.Conv2d)).in_channels
    compiled = _compiled(model, dynamic=True, channels_last=True)
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, channels, 7, 9)
            _assert_like_eager(compiled(x), model(x))
    graph = _graph()
    _ran_fused(graph)
    assert graph.rewrites["channels_last"], graph.rewrites
    fused = fused_graphs[0].graph
    assert any(n.target is in_storage_order for n in fused.nodes)


class Stem(nn.Module):
    """A ResNet stem: a 7x7 stride-2 conv, BatchNorm, ReLU, max pool."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.bn(self.conv(x))), 3, 2, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_batch_norm_folded_into_a_wide_kernel_runs_channels_last(dtype):
    # fp32/fp64 folds write W' into a buffer the fused graph owns: it is made channels-last
    # in place (its fake had symbolic sizes once, and Dynamo failed on the guards they
    # made); fp64 folds are derived in fp64 (in fp32 they left validation's tolerance)
    torch.manual_seed(2)
    model = _randomize_statistics(Stem()).to(dtype)
    x = torch.randn(2, 3, 20, 18, dtype=dtype)
    compiled = _compiled(model, channels_last=True)
    with torch.no_grad():
        _assert_like_eager(compiled(x), model(x))
        model.bn.running_var.mul_(2.0)  # the fold follows, into the channels-last buffer
        _assert_like_eager(compiled(x), model(x))
    graph = _graph()
    _ran_fused(graph)
    assert graph.rewrites["channels_last"] == ["conv2d"]
    assert graph.rewrites["batch_norms_folded"] == ["batch_norm"]


class PermutedOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.bn(self.conv(x))
        return y.view(y.shape[0], -1), y.permute(0, 2, 3, 1)


class Written(nn.Module):
    """Writes into a conv's output, and into its input between two convs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.a(x)
        y[:, 0] = 0
        first = y.sum((2, 3))
        z = x.clone()
        w = self.b(z)
        z.mul_(2)
        return first, self.b(z) + w


@pytest.mark.parametrize(
    "model, why",
    [
        (PermutedOut, "output reads permute, whose traced layout would not come back"),
        (Written, "the graph writes into"),
    ],
)
def test_graphs_whose_layout_cannot_change_stay_as_traced_with_the_reason(model, why):
    # A permuted output's strides would not come back; a write into a value whose layout
    # changes would land in a copy (eager's was a view, or read by others): left as traced,
    # and the folded weights (fp32) stay in the traced layout too.
    torch.manual_seed(3)
    model = _randomize_statistics(model())
    x = torch.randn(2, 3, 8, 7)
    with torch.no_grad():
        out = _compiled(model, channels_last=True)(x.clone())
        expected = model(x.clone())
    for got, want in zip(out, expected):
        _assert_like_eager(got, want)
    graph = _graph()
    assert not graph.rewrites.get("channels_last")
    (reason,) = graph.rewrites["channels_last_left_alone"]
    assert why in reason, reason


class WritesItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        self.conv.weight.mul_(0.5)  # the graph writes its own weight
        return y


def test_a_weight_the_graph_writes_is_read_as_it_is():
    # A copy refreshed before the call would miss the call's own write: the conv reads the
    # parameter (cuDNN converts it), with the reason.
    torch.manual_seed(4)
    model, reference = WritesItsWeight().eval(), WritesItsWeight().eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(1, 3, 6, 6)
    compiled = _compiled(model, channels_last=True)
    with torch.no_grad():
        for _ in range(3):
            _assert_like_eager(compiled(x), reference(x))
    graph = _graph()
    assert len(graph.rewrites["channels_last"]) == 1, graph.rewrites
    assert any("written by the graph itself" in r
               for r in graph.rewrites["channels_last_left_alone"])  # fmt: skip


class UNetBlock(nn.Module):
    """A diffusion UNet's pieces: GroupNorm + SiLU between convs, nearest upsampling, a
    chunk and padding, a concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(F.silu(self.norm(self.a(x))), scale_factor=2.0, mode="nearest")
        first, second = self.b(y).chunk(2, dim=1)
        return torch.cat([F.pad(first, (1, 1, 1, 1)), F.pad(second[:, :, 1:], (1, 1, 2, 1))], 1)


def test_group_norm_upsampling_and_padding_read_channels_last_as_it_is(fused_graphs):
    # They read any layout: no copy back to NCHW before them, only at the output
    torch.manual_seed(5)
    model = UNetBlock().eval()
    x = torch.randn(2, 4, 6, 5)
    with torch.no_grad():
        _assert_like_eager(_compiled(model, channels_last=True)(x), model(x))
    graph = _graph()
    _ran_fused(graph)
    assert len(graph.rewrites["channels_last"]) == 2, graph.rewrites
    fused = fused_graphs[0].graph
    restores = [n for n in fused.nodes if n.target == "contiguous" and not n.kwargs]
    assert [r.next.op for r in restores] == ["output"], fused


class Unfolded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.unfold(self.conv(x), 2)  # an op the pass does not know


def test_a_channels_last_model_keeps_its_layout_before_unknown_readers():
    # The user's model and input are channels-last already: nothing changes layout, so the
    # unknown reader needs no restore and the graph is not refused
    torch.manual_seed(6)
    model = Unfolded().eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 7).to(memory_format=torch.channels_last)
    with torch.no_grad():
        _assert_like_eager(_compiled(model, channels_last=True)(x), model(x))
    graph = _graph()
    assert graph.rewrites["channels_last"] == ["conv2d"], graph.rewrites
    assert not graph.rewrites.get("channels_last_left_alone"), graph.rewrites
