"""Eval BatchNorm folded into the convolution before it (passes/batch_norm_folding.py).

Blocks written the way timm and torchvision write them (conv without bias + BatchNorm + ReLU,
a bottleneck's residual add, a depthwise conv, a 1-d conv, a BatchNorm without affine), in eval
mode with non-trivial running statistics: outputs equal eager's, the report lists every
BatchNorm as folded and the fused graph holds none; an in-place edit of a weight or a
statistic and a ``load_state_dict()`` after compiling give eager's new result; what cannot fold
is left with its reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import FakeGraph, graphs_since

import fusebackend

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}


def _randomize_statistics(model: nn.Module, seed: int = 0) -> nn.Module:
    """BatchNorms with running statistics and affine parameters far from 0 and 1."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            n = module.num_features
            module.running_mean.copy_(torch.randn(n, generator=generator))
            module.running_var.copy_(torch.rand(n, generator=generator) * 2 + 0.2)
            if module.affine:
                module.weight.data.copy_(torch.randn(n, generator=generator))
                module.bias.data.copy_(torch.randn(n, generator=generator))
    return model.eval()


class Bottleneck(nn.Module):
    """A ResNet bottleneck: three conv + BN, ReLUs, a projected shortcut, the residual add."""

    def __init__(self, cin: int = 6, mid: int = 4, cout: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=1, bias=False),
                                  nn.BatchNorm2d(cout))  # fmt: skip
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn1(self.conv1(x)))
        y = self.act(self.bn2(self.conv2(y)))
        return self.act(self.bn3(self.conv3(y)) + self.down(x))


class MixedBlock(nn.Module):
    """A depthwise conv with bias, a BatchNorm without affine, SiLU; a 1-d conv + BN1d."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(5, 5, 3, padding=1, groups=5)
        self.bn = nn.BatchNorm2d(5, affine=False)
        self.conv1d, self.bn1d = nn.Conv1d(5, 7, 3), nn.BatchNorm1d(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.silu(self.bn(self.dw(x)))
        return self.bn1d(self.conv1d(y.mean(dim=2)))


_BEFORE: list = []


def _compiled(model: nn.Module):
    torch._dynamo.reset()
    fusebackend.clear_cache()
    _BEFORE[:] = [fusebackend.reports()]
    return torch.compile(model, backend="infinifuse")


def _graph():
    """The one graph compiled since the last ``_compiled``."""
    graphs = graphs_since(_BEFORE[0])
    assert len(graphs) == 1, graphs
    return graphs[0]


def _batch_norms(graph_module: torch.fx.GraphModule) -> list[str]:
    return [
        n.name
        for n in graph_module.graph.nodes
        if n.op == "call_function" and n.target is torch.nn.functional.batch_norm
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [Bottleneck, MixedBlock])
def test_every_eval_batch_norm_folds_and_outputs_equal_eager(block, dtype):
    model = _randomize_statistics(block()).to(dtype)
    x = torch.randn(2, model.dw.in_channels if block is MixedBlock else 6, 7, 9, dtype=dtype)
    expected_folds = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    compiled = _compiled(model)
    with torch.no_grad():
        expected = model(x)
        out = compiled(x)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    graph = _graph()
    assert graph.path == "fused", graph.path
    assert len(graph.rewrites.get("batch_norms_folded", [])) == expected_folds, graph.rewrites
    assert not graph.rewrites.get("batch_norms_left_alone"), graph.rewrites


def test_the_fused_graph_has_no_batch_norm_left(monkeypatch):
    # The graph the runtime runs fused: the folded conv reads the derived constants and no
    # batch_norm node is left; the unfused reference graph keeps every BatchNorm.
    from fusebackend import fusion

    made = []
    real = fusion.fuse

    def keep(*args, **kwargs):
        fused = real(*args, **kwargs)
        made.append((args[0], fused.graph))
        return fused

    monkeypatch.setattr(fusion, "fuse", keep)
    model = _randomize_statistics(Bottleneck())
    with torch.no_grad():
        _compiled(model)(torch.randn(1, 6, 5, 5))
    ((unfused, fused),) = made
    assert fused is not None
    assert _batch_norms(fused) == [], fused.code
    assert len(_batch_norms(unfused)) == 4, unfused.code
    folded = [n for n in fused.graph.nodes if n.op == "get_attr" and "_folded_" in n.target]
    assert len(folded) == 8  # a weight and a bias per fold


def test_half_precision_keeps_the_weights_and_scales_after_the_conv(fused_graphs):
    # Folding into bf16/fp16 weights rounds W * scale in every layer (a ResNet-50 in fp16 then
    # left validation's 1%); the conv reads the user's weight and the scale and shift run in
    # float32 after it, fused with the ReLU.
    model = _randomize_statistics(Bottleneck()).to(torch.bfloat16)
    x = torch.randn(2, 6, 5, 7, dtype=torch.bfloat16)
    compiled = _compiled(model)
    with torch.no_grad():
        out = compiled(x)
        model.bn2.running_mean.add_(0.5)  # a statistic edited in place reaches the scale/shift
        torch.testing.assert_close(compiled(x), model(x), rtol=3e-2, atol=3e-2)
    assert out.dtype == torch.bfloat16
    fused = fused_graphs[0]
    attrs = sorted(n.target for n in fused.graph.nodes if n.op == "get_attr")
    assert len(attrs) == 12, attrs  # center, scale and shift per BatchNorm
    assert all(a.endswith(("_center", "_scale", "_bias")) for a in attrs), attrs
    convs = [n for n in fused.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    assert all(c.args[1].op == "placeholder" for c in convs)  # the user's weights
    assert all(len(c.args) < 3 or c.args[2] is None for c in convs)


def test_an_in_place_edit_after_compiling_gives_eagers_new_result():
    model = _randomize_statistics(Bottleneck())
    compiled = _compiled(model)
    x = torch.randn(2, 6, 7, 9)
    with torch.no_grad():
        compiled(x)
        model.conv2.weight.mul_(1.5)  # a weight edited in place
        model.bn3.running_var.add_(0.7)  # a statistic edited in place
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_load_state_dict_after_compiling_gives_eagers_new_result():
    model = _randomize_statistics(Bottleneck(), seed=1)
    other = _randomize_statistics(Bottleneck(), seed=2)
    compiled = _compiled(model)
    x = torch.randn(1, 6, 6, 6)
    with torch.no_grad():
        before = compiled(x)
        model.load_state_dict(other.state_dict())
        after = compiled(x)
        torch.testing.assert_close(after, other(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("through", ["eager", "compiled"])
def test_running_statistics_a_training_step_updated_are_seen(through):
    # A train-mode forward updates the running statistics inside aten's batch norm without
    # moving their version counters (the schema does not mark them written); the module's
    # num_batches_tracked counts the step. BatchNorm calibration, or a training loop whose
    # evaluation calls the same compiled model.
    model = _randomize_statistics(Bottleneck(), seed=3)
    compiled = _compiled(model)
    x = torch.randn(2, 6, 5, 7)
    with torch.no_grad():
        before = compiled(x)
        versions = model.bn2.running_var._version
        model.train()
        (model if through == "eager" else compiled)(x * 3 + 1)
        model.eval()
        assert model.bn2.running_var._version == versions  # (why the counter is watched)
        after = compiled(x)
        torch.testing.assert_close(after, model(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("found_by", ["Dynamo's sources", "the garbage collector"])
def test_the_batch_counters_are_found_once_and_watched_after_a_recompile(monkeypatch, found_by):
    # num_batches_tracked is found where Dynamo read each running mean from (the module's
    # buffer dict, in the traced frame); where that cannot be told, one garbage-collector
    # scan (0.3 s with big libraries loaded) finds it. Either way once per running mean: a
    # recompile at a new batch size watches the counters all the same.
    import fusebackend.passes.batch_norm_folding as folding

    scans = []
    real = folding.gc.get_referrers
    monkeypatch.setattr(folding.gc, "get_referrers", lambda *a: scans.append(a) or real(*a))
    looked_up = []
    holder_of = folding.holder_of
    monkeypatch.setattr(folding, "holder_of", lambda node: looked_up.append(node) or (
        holder_of(node) if found_by == "Dynamo's sources" else None))  # fmt: skip
    model = _randomize_statistics(Bottleneck(), seed=4)
    compiled = _compiled(model)
    with torch.no_grad():
        compiled(torch.randn(1, 6, 5, 7))
        assert len(looked_up) == 4  # (the bottleneck's four BatchNorms)
        assert len(scans) == (0 if found_by == "Dynamo's sources" else 1)
        x = torch.randn(3, 6, 5, 7)  # a new batch size: Dynamo traces again
        before = compiled(x)
        assert len(looked_up) == 4 and len(scans) <= 1, "the recompile looked again"
        model.train()
        model(x * 3 + 1)  # a training step moves the statistics and the counters only
        model.eval()
        after = compiled(x)
        torch.testing.assert_close(after, model(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_a_traced_inputs_holder_is_found_in_the_traced_frame():
    from fusebackend.passes.traced_sources import holder_of

    model = _randomize_statistics(Bottleneck(), seed=5).eval()
    found = {}

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                found[node.name] = holder_of(node)
        return gm.forward

    outside = torch.fx.symbolic_trace(model)  # no Dynamo frame: nothing to be told
    assert all(holder_of(n) is None for n in outside.graph.nodes if n.op == "placeholder")
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(1, 6, 5, 7))
    means = {name: holder for name, holder in found.items() if "running_mean" in name}
    norms = (model.bn1, model.bn2, model.bn3, model.down[1])
    assert sorted(map(id, means.values())) == sorted(id(bn._buffers) for bn in norms)
    weights = [h for name, h in found.items() if name.endswith("conv1_parameters_weight_")]
    assert weights == [model.conv1._parameters]
    image = [h for name, h in found.items() if "buffers" not in name and "parameters" not in name]
    assert image == [None]  # (the image is a local: no holder to walk to)


def test_refresh_derives_only_the_folds_whose_sources_changed():
    from fusebackend.passes.batch_norm_folding import Fold, Refresh

    sources = [torch.randn(3, 2, 1), None, torch.randn(3), torch.rand(3) + 0.5, None, None]
    inputs = [t for t in sources if t is not None]
    fold = Fold("bn", (0, None, 1, 2, None, None), 1e-5, bias=torch.empty(3),
                weight=torch.empty(3, 2, 1))  # fmt: skip
    fold.derive(inputs)
    refresh = Refresh([fold], inputs)
    refresh(inputs)
    assert refresh.derivations == 0
    inputs[2].mul_(2.0)  # an in-place write: the version counter moves
    refresh(inputs)
    assert refresh.derivations == 1
    scale = torch.rsqrt(inputs[2] + 1e-5)
    torch.testing.assert_close(fold.weight, inputs[0] * scale[:, None, None])
    torch.testing.assert_close(fold.bias, -inputs[1] * scale)
    swapped = [inputs[0].clone(), inputs[1], inputs[2]]  # another tensor object, same values
    refresh(swapped)
    assert refresh.derivations == 2


def test_refresh_of_several_folds_sharing_a_source():
    """Two folds sharing one statistic and a channels-last-like copy of the first weight: an
    edit derives exactly the folds that read the edited tensor, a shared one both."""
    from fusebackend.passes.batch_norm_folding import Fold, Refresh

    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(3, 2, 1, generator=g), torch.randn(3, generator=g),
              torch.rand(3, generator=g) + 0.5, torch.randn(3, 4, 1, generator=g),
              torch.randn(3, generator=g)]  # fmt: skip
    first = Fold("bn1", (0, None, 1, 2, None, None), 1e-5, bias=torch.empty(3),
                 weight=torch.empty(3, 2, 1))  # fmt: skip
    second = Fold("bn2", (3, None, 4, 2, None, None), 1e-3, bias=torch.empty(3),
                  weight=torch.empty(3, 4, 1))  # fmt: skip
    copies = []

    class Copy:  # the protocol channels_last.WeightCopy follows
        sources, eps_source = (0,), None

        def derive(self, given):
            copies.append(given[0].clone())

    folds = [first, second, Copy()]
    for fold in folds:
        fold.derive(inputs)
    refresh = Refresh(folds, inputs)
    derived = {id(f): 0 for f in folds}
    for fold in folds:
        fold.derive = (lambda f, d: lambda given: (derived.__setitem__(id(f), derived[id(f)] + 1),
                                                   d(given)))(fold, fold.derive)  # fmt: skip

    def counts():
        return [derived[id(f)] for f in folds]

    refresh(inputs)
    assert counts() == [0, 0, 0]
    inputs[4].add_(1.0)  # the second fold's mean only
    refresh(inputs)
    assert counts() == [0, 1, 0]
    inputs[2].mul_(2.0)  # the shared variance
    refresh(inputs)
    assert counts() == [1, 2, 0]
    inputs[0].data = inputs[0].data * -1.0  # new data under the same object: the pointer
    refresh(inputs)
    assert counts() == [2, 2, 1]
    torch.testing.assert_close(copies[-1], inputs[0])
    scale = torch.rsqrt(inputs[2] + 1e-3)
    torch.testing.assert_close(second.weight, inputs[3] * scale[:, None, None])
    torch.testing.assert_close(second.bias, -inputs[4] * scale)
    refresh(inputs)
    assert counts() == [2, 2, 1] and refresh.derivations == 5


class Shared(nn.Module):
    """A conv whose output is also read elsewhere, a BN after a non-conv op: neither can fold
    into a convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)
        self.bn_after_add = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y, self.bn_after_add(x + 1.0)


def test_what_cannot_fold_into_a_conv_becomes_a_scale_and_shift_with_its_reason(fused_graphs):
    model = _randomize_statistics(Shared())
    compiled = _compiled(model)
    x = torch.randn(2, 3, 4, 5)
    with torch.no_grad():
        out = compiled(x)
        expected = model(x)
    torch.testing.assert_close(out, expected)
    folded = " | ".join(_graph().rewrites.get("batch_norms_folded", []))
    assert "a scale and shift: the convolution's output has other readers" in folded, folded
    assert "a scale and shift: its input is not a convolution" in folded, folded
    assert not _graph().rewrites.get("batch_norms_left_alone")
    assert _batch_norms(fused_graphs[-1]) == [], fused_graphs[-1].code
    assert {e["mode"] for e in _graph().runtime_modes()} == {"fusion"}


class RepVGGBlock(nn.Module):
    """timm's RepVGG block at inference before reparameterization: a 3x3 conv + BN, a 1x1
    conv + BN and an identity BatchNorm, summed, then ReLU."""

    def __init__(self, channels: int = 6) -> None:
        super().__init__()
        self.identity = nn.BatchNorm2d(channels)
        self.conv_kxk = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(channels))  # fmt: skip
        self.conv_1x1 = nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False),
                                      nn.BatchNorm2d(channels))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv_kxk(x) + self.conv_1x1(x) + self.identity(x))


class DenseLayer(nn.Module):
    """DenseNet's pre-activation layer (BN + ReLU + conv after a concatenation) and a
    BatchNorm1d after a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.conv = nn.BatchNorm2d(7), nn.Conv2d(7, 3, 1, bias=False)
        self.fc, self.bn1d = nn.Linear(10, 5), nn.BatchNorm1d(5)

    def forward(self, a: torch.Tensor, b: torch.Tensor, v: torch.Tensor) -> tuple:
        y = self.conv(torch.relu(self.norm(torch.cat([a, b], dim=1))))
        return y, torch.sigmoid(self.bn1d(self.fc(v)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_batch_norms_not_after_a_conv_fuse_with_their_neighbours(dtype, fused_graphs):
    model = _randomize_statistics(RepVGGBlock()).to(dtype)
    # Seeded: in bf16 three O(1) terms cancel before the ReLU, and Triton's interpreter
    # truncates to bf16 where eager rounds, so on about 1 input in 12 one element of a row
    # near zero is 2 ulps off and validation's element bound (5% of that row's largest) sends
    # the graph to eager (seeds 0-11 of the global generator: only 5); the GPU rounds as eager.
    x = torch.randn(3, 6, 5, 7, dtype=dtype, generator=torch.Generator().manual_seed(0))
    compiled = _compiled(model)
    with torch.no_grad():
        expected = model(x)
        out = compiled(x)
    rtol, atol = TOLERANCES.get(dtype, (1e-9, 1e-9))
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    graph = _graph()
    folded = graph.rewrites.get("batch_norms_folded", [])
    assert len(folded) == 3, folded
    assert sum("a scale and shift: its input is not a convolution" in f for f in folded) == 1
    assert _batch_norms(fused_graphs[-1]) == [], fused_graphs[-1].code
    # the identity's scale and shift, the other two's (bf16) and the sum and ReLU: one group
    assert len(graph.groups) == 1, graph.rewrites
    assert {e["mode"] for e in graph.runtime_modes()} == {"fusion"}


def test_a_batch_norm_after_a_concatenation_or_a_linear_and_its_edits(fused_graphs):
    model = _randomize_statistics(DenseLayer())
    inputs = (torch.randn(2, 3, 4, 5), torch.randn(2, 4, 4, 5), torch.randn(3, 10))
    compiled = _compiled(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
        model.norm.running_var.mul_(3.0)  # an in-place edit after compiling
        model.bn1d.weight.add_(1.0)
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
    folded = _graph().rewrites.get("batch_norms_folded", [])
    assert len(folded) == 2 and all("its input is not a convolution" in f for f in folded)
    assert _batch_norms(fused_graphs[-1]) == [], fused_graphs[-1].code
    assert {e["mode"] for e in _graph().runtime_modes()} == {"fusion"}


def test_a_training_mode_batch_norm_is_not_folded():
    model = _randomize_statistics(Bottleneck()).train()
    reference = copy.deepcopy(model)
    compiled = _compiled(model)
    x = torch.randn(2, 6, 5, 5)
    with torch.no_grad():
        out = compiled(x)
        expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    reasons = " | ".join(_graph().rewrites.get("batch_norms_left_alone", []))
    assert "training mode" in reasons, reasons


def test_new_data_under_the_same_parameter_object_is_seen():
    # param.data = t keeps the object and its version counter; the data pointer moves
    model = _randomize_statistics(Bottleneck())
    compiled = _compiled(model)
    x = torch.randn(1, 6, 5, 5)
    with torch.no_grad():
        compiled(x)
        model.conv2.weight.data = model.conv2.weight.data * -1.0
        model.bn1.running_mean.data = model.bn1.running_mean.data + 1.0
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_an_unbatched_conv_and_inference_parameters_are_not_folded_with_reasons():
    torch.manual_seed(3)
    unbatched = _randomize_statistics(nn.Sequential(nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4)))
    x = torch.randn(3, 4)  # (channels, length): BatchNorm1d reads dim 1 (length 4) as channels
    compiled = _compiled(unbatched)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), unbatched(x), rtol=1e-5, atol=1e-5)
    # not folded into the convolution: a scale and shift of the conv's (4, 4) output, whose
    # dim 1 BatchNorm1d reads as channels
    folded = _graph().rewrites.get("batch_norms_folded", [])
    assert len(folded) == 1 and "a scale and shift: an unbatched convolution" in folded[0], folded
    with torch.inference_mode():  # inference tensors keep no version counter
        model = _randomize_statistics(Bottleneck())
        x = torch.randn(1, 6, 5, 5)
        compiled = _compiled(model)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    left = _graph().rewrites.get("batch_norms_left_alone", [])
    assert left and all("inference tensor" in r for r in left), left


def test_dynamic_shapes_fold_with_eps_as_an_input_and_follow_its_change():
    # dynamic=True passes a module's float (BatchNorm's eps) as a 0-d tensor input
    model = _randomize_statistics(Bottleneck())
    torch._dynamo.reset()
    fusebackend.clear_cache()
    before = fusebackend.reports()
    compiled = torch.compile(model, backend="infinifuse", dynamic=True)
    with torch.no_grad():
        for n in (2, 3):
            x = torch.randn(n, 6, 5 + n, 7)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        model.bn2.eps = 0.5  # the next call passes the new value
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    graphs = graphs_since(before)
    assert sum(len(g.rewrites.get("batch_norms_folded", [])) for g in graphs) >= 4
    assert not any(g.rewrites.get("batch_norms_left_alone") for g in graphs)


def test_refresh_derives_again_when_an_eps_input_changes_value():
    from fusebackend.passes.batch_norm_folding import Fold, Refresh

    inputs = [torch.randn(3, 2, 1), torch.randn(3), torch.rand(3) + 0.5, torch.tensor(1e-5)]
    fold = Fold("bn", (0, None, 1, 2, None, None), 1e-5, bias=torch.empty(3),
                weight=torch.empty(3, 2, 1), eps_source=3)  # fmt: skip
    fold.derive(inputs)
    refresh = Refresh([fold], inputs)
    refresh([*inputs[:3], torch.tensor(1e-5)])  # a new 0-d tensor, the same value
    assert refresh.derivations == 0
    refresh([*inputs[:3], torch.tensor(0.5)])
    assert refresh.derivations == 1 and fold.eps == 0.5
    scale = torch.rsqrt(inputs[2] + 0.5)
    torch.testing.assert_close(fold.weight, inputs[0] * scale[:, None, None])


def test_a_scale_and_shift_subtracts_the_mean_first():
    # Features near 1e4 with a spread of about 1: x * scale + (beta - mean * scale) cancels
    # two terms of 1e4 (about 50x eager's error against fp64); (x - mean) * scale + beta
    # subtracts first, as eager does.
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(5)).eval()
    with torch.no_grad():
        model[0].running_mean.fill_(1e4)
        model[0].running_var.fill_(2.0)
    x = torch.randn(7, 5) + 1e4
    compiled = _compiled(model)
    with torch.no_grad():
        out = compiled(x)
        eager_error = (model(x).double() - model.double()(x.double())).abs().max()
        fused_error = (out.double() - model(x.double())).abs().max()
    assert fused_error <= 2 * eager_error + 1e-6, (fused_error, eager_error)
    assert _graph().rewrites.get("batch_norms_folded"), _graph().rewrites
    assert {e["mode"] for e in _graph().runtime_modes()} == {"fusion"}


class _ScaledBottleneck(nn.Module):
    """A Bottleneck whose output the graph scales by a parameter it reads itself."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Bottleneck()
        self.scale = nn.Parameter(torch.randn(10, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) * self.scale


def _fake_captured(monkeypatch, model: nn.Module, unread: set[int]):
    """``model`` compiled with its graphs captured through ``FakeGraph`` on the CPU;
    ``unread`` collects the inputs each captured graph does not read."""
    from fusebackend.runtime import capture as cap
    from fusebackend.runtime.recording import unread_inputs

    def fake_capture(fn, inputs, *, device, warmup_iterations):
        graph = FakeGraph(fn, inputs)
        unread.update(unread_inputs(fn))
        return graph, graph.outputs

    monkeypatch.setattr(cap, "capture_graph", fake_capture)
    fake_cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fusebackend.backend, "_graph_device", lambda inputs: fake_cuda)
    torch._dynamo.reset()
    fusebackend.clear_cache()
    return torch.compile(model, backend="infinifuse", options={"cudagraphs": True})


def test_a_captured_graph_recaptures_when_a_parameter_it_reads_moves(monkeypatch):
    model = _ScaledBottleneck()
    _randomize_statistics(model)
    compiled = _fake_captured(monkeypatch, model, set())
    x = torch.randn(1, 6, 5, 5)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        model.scale.data = model.scale.data * -2.0  # read by the graph: a new address
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        assert fusebackend.stats()["rerecords"] == 1


def test_a_captured_graph_leaves_the_parameters_it_does_not_read_to_the_refresh(monkeypatch):
    # The fused graph reads the folded weights it owns, not the conv weights and BatchNorm
    # parameters they come from: new data under one of those is the refresh's to see (after
    # the replay's launch: the graph replays again), not a reason to capture anew.
    unread: set[int] = set()
    model = _randomize_statistics(Bottleneck())
    compiled = _fake_captured(monkeypatch, model, unread)
    x = torch.randn(1, 6, 5, 5)
    with torch.no_grad():
        for _ in range(3):  # captured at the second call, replayed at the third
            compiled(x)
        stats = fusebackend.stats()
        assert stats["recordings"] == 1 and stats["cache_hits"] == 2, stats
        # every conv weight and the 4 tensors of each of the 4 BatchNorms
        assert len(unread) >= 4 + 4 * 4, unread
        model.conv2.weight.data = model.conv2.weight.data * -1.0
        model.bn1.running_mean.data = model.bn1.running_mean.data + 1.0
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        stats = fusebackend.stats()
        assert stats["recordings"] == 1 and stats["rerecords"] == 0, stats
        assert stats["replays_on_stale_constants"] == 1, stats
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
