"""GroupNorms with their activation as one kernel (passes/group_norms.py,
kernels/group_norm.py).

The kernel (Triton's interpreter) against ``F.group_norm`` then the activation, at odd
shapes, every layout it reads (NCHW, channels-last, ``[N, C, L]``, ``[N, C]``), an output
layout other than the input's, rows held whole and rows split into parts (one launch and
two), every activation and dtype, a mean far from zero; the pass through the backend on
blocks written as timm and diffusers write them (BiT's pre-activation bottleneck with
weight-standardised convolutions, a UNet ResNet block with SiLU; transformers' Wav2Vec2
feature encoder, a group per channel then GELU): which norms it takes, with
which activation, outputs equal to eager's, weights edited after compiling; what it leaves
(a norm read twice keeps its activation apart, another device type, a strided view).
The pass takes CUDA graphs only; these tests add the CPU (``DEVICE_TYPES``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import EAGER_ACTIVATIONS, KERNEL_TOLERANCES, graphs_since

import fusebackend
from fusebackend.kernels import group_norm as group_norm_module
from fusebackend.kernels.group_norm import group_norm
from fusebackend.passes import group_norms

# The launcher reads several channels-last groups a program from images of 256 KiB
# (``_GROUPED_FROM_IMAGE_BYTES``); the tests' small tensors take that pair at any size, so
# that Triton's interpreter runs both pairs, except where a test says otherwise.
_GROUPED_FROM_IMAGE_BYTES = group_norm_module._GROUPED_FROM_IMAGE_BYTES


@pytest.fixture(autouse=True)
def grouped_at_any_size(monkeypatch):
    monkeypatch.setattr(group_norm_module, "_GROUPED_FROM_IMAGE_BYTES", 0)


def _expected(x, groups, weight, bias, eps, activation):
    """Eager's value: the norm in fp32 rounded to x's dtype, then the activation on it."""
    y = F.group_norm(x.float(), groups, weight, bias, eps).to(x.dtype)
    return EAGER_ACTIVATIONS[activation](y.float()).to(x.dtype)


def _launch_split(x, groups, weight, bias, eps, activation, parts):
    """The kernels run as ``parts`` parts a row (the launcher's choice overridden)."""
    out = torch.empty_like(x)
    for kernel, grid, args, meta in group_norm_module._launches(
        x, groups, weight, bias, eps, activation, out, parts=parts
    ):
        kernel[grid](*args, **meta)
    return out


@pytest.mark.parametrize(
    ("shape", "groups", "layout"),
    [
        ((2, 12, 5, 7), 3, "nchw"),  # rows of 140: held whole
        ((2, 12, 5, 7), 4, "channels_last"),  # 3 channels a group: several groups a program
        ((2, 16, 9, 11), 2, "channels_last"),  # 8 fp32 channels (32 bytes): a group a program
        ((1, 16, 45, 23), 2, "channels_last"),  # the same, rows of 8280 read in parts
        ((1, 10, 45, 23), 2, "nchw"),  # rows of 5175: read twice, in parts
        ((1, 10, 45, 23), 5, "channels_last"),  # two channels a group, positions outer
        ((3, 9, 11), 3, "nchw"),  # [N, C, L]
        ((5, 6), 2, "nchw"),  # [N, C]: one position
        ((2, 7, 4, 3), 1, "channels_last"),  # one group (timm's GroupNorm1)
        ((2, 8, 3, 5), 8, "channels_last"),  # one channel a group (InstanceNorm-like)
    ],
)
@pytest.mark.parametrize("affine", [True, False])
def test_the_kernel_equals_eagers_group_norm(shape, groups, layout, affine):
    torch.manual_seed(0)
    x = torch.randn(shape) * 2 + 0.5
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = (torch.randn(shape[1]), torch.randn(shape[1])) if affine else (None, None)
    out = group_norm(x, groups, weight, bias, 1e-5, "silu")
    assert out.stride() == x.stride()
    torch.testing.assert_close(out, _expected(x, groups, weight, bias, 1e-5, "silu"),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_rows_split_into_parts_give_the_same_value(parts, layout):
    # 1: one launch reads the row twice; more: a launch of partial sums, then the normalise
    torch.manual_seed(1)
    x = torch.randn(2, 6, 45, 53) * 3 - 1  # rows of 7155: up to 7 parts of 1024 (_BLOCK)
    assert len(group_norm_module._launches(x, 3, None, None, 1e-6, "", x, parts=parts)) == (
        1 if parts == 1 else 2
    )
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = torch.rand(6) + 0.5, torch.randn(6)
    out = _launch_split(x, 3, weight, bias, 1e-6, "relu", parts)
    torch.testing.assert_close(out, _expected(x, 3, weight, bias, 1e-6, "relu"),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_the_launcher_splits_few_wide_rows_and_holds_narrow_ones_whole():
    narrow = torch.randn(4, 32, 8, 8)  # 4 x 8 rows of 64
    wide = torch.randn(1, 256, 56, 56)  # BiT's first stage at batch 1: 32 rows of 25088
    kinds = {}
    for name, x in (("narrow", narrow), ("wide", wide)):
        launches = group_norm_module._launches(x, 32 if name == "wide" else 8, None, None,
                                               1e-5, "", torch.empty_like(x))  # fmt: skip
        kinds[name] = [(grid, meta.get("WHOLE_ROW")) for _, grid, _, meta in launches]
    assert kinds["narrow"] == [((32, 1), True)]
    (stats, _), (apply, whole) = kinds["wide"]
    assert stats == apply and stats[0] == 32 and stats[1] > 1 and whole is False


def test_channels_last_groups_of_few_bytes_in_large_images_are_read_several_a_program(
    monkeypatch,
):
    monkeypatch.setattr(group_norm_module, "_GROUPED_FROM_IMAGE_BYTES", _GROUPED_FROM_IMAGE_BYTES)
    kinds = {}
    for name, shape, dtype in (("bit", (1, 256, 56, 56), torch.float16),  # 16 bytes a group
                               ("wide", (1, 512, 28, 28), torch.float16),  # 32 bytes
                               ("unet", (2, 320, 64, 64), torch.float16),  # 20 bytes
                               ("small image", (2, 64, 16, 16), torch.float16),  # 32 KiB
                               ("few positions", (2, 8192, 4, 4), torch.float16)):  # fmt: skip
        x = torch.empty(shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
        launches = group_norm_module._launches(x, 32 if name != "few positions" else 4096,
                                               None, None, 1e-5, "", x)  # fmt: skip
        kinds[name] = [(k.fn.__name__ if hasattr(k, "fn") else k.__name__, meta.get("GPP"),
                        meta.get("WHOLE_ROW"))  # fmt: skip
                       for k, _, _, meta in launches]  # fmt: skip
    # 16 groups of 8 fp16 channels: 256 bytes of each position (_GROUPED_SPAN_BYTES)
    assert kinds["bit"] == [("_grouped_stats", 16, None), ("_grouped_apply", 16, False)], kinds
    assert [k for k, _, _ in kinds["wide"]] == ["_group_norm_stats", "_group_norm_apply"]
    assert [k for k, _, _ in kinds["unet"]] == ["_grouped_stats", "_grouped_apply"], kinds
    assert kinds["small image"] == [("_group_norm_apply", None, True)], kinds
    # 64 groups of 2 channels a program, 16 positions: each program's tile held whole
    assert kinds["few positions"] == [("_grouped_apply", 64, True)], kinds


@pytest.mark.parametrize("activation", sorted(EAGER_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_activation_and_dtype(activation, dtype):
    torch.manual_seed(2)
    x = (torch.randn(2, 12, 7, 6) * 2).to(dtype).contiguous(memory_format=torch.channels_last)
    weight, bias = (torch.rand(12) + 0.5).to(dtype), torch.randn(12).to(dtype)
    out = group_norm(x, 4, weight, bias, 1e-5, activation)
    assert out.dtype == dtype
    rtol, atol = KERNEL_TOLERANCES[dtype]
    expected = _expected(x, 4, weight.float(), bias.float(), 1e-5, activation)
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("parts", [None, 1, 4])
def test_a_mean_far_from_zero_keeps_the_variance(parts):
    # a plain sum of squares in fp32 loses the variance of 1000 + N(0, 1) (cancellation);
    # the kernel sums around one of the row's own elements
    torch.manual_seed(3)
    x = torch.randn(2, 4, 40, 30) + 1000.0
    weight, bias = torch.ones(4), torch.zeros(4)
    if parts is None:
        out = group_norm(x, 2, weight, bias, 1e-5)
    else:
        out = _launch_split(x, 2, weight, bias, 1e-5, "", parts)
    expected = F.group_norm(x.double(), 2, weight.double(), bias.double(), 1e-5).float()
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("parts", [None, 3])
def test_the_output_may_have_another_layout_than_the_input(parts):
    # aten's CUDA GroupNorm makes a channels-last input contiguous: the pass asks for the
    # traced layout
    torch.manual_seed(4)
    x = torch.randn(2, 6, 31, 37).contiguous(memory_format=torch.channels_last)
    contiguous = torch.empty(x.shape).stride()
    if parts is None:
        out = group_norm(x, 3, None, None, 1e-5, "gelu", contiguous)
    else:
        out = torch.empty(x.shape)
        launches = group_norm_module._launches(x, 3, None, None, 1e-5, "gelu", out, parts=3)
        for kernel, grid, args, meta in launches:
            kernel[grid](*args, **meta)
    assert out.is_contiguous()
    torch.testing.assert_close(out, _expected(x, 3, None, None, 1e-5, "gelu"),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_a_view_the_kernel_does_not_read_gets_atens_value():
    x = torch.randn(2, 6, 9, 10)[:, :, ::2, 1:]  # positions not one strided dim
    assert not group_norm_module.takes(x)
    out = group_norm(x, 2, None, None, 1e-5, "relu")
    torch.testing.assert_close(out, F.relu(F.group_norm(x, 2)))


def test_bad_arguments_get_clear_errors():
    x = torch.randn(2, 6, 4, 4)
    with pytest.raises(ValueError, match="4 groups do not divide"):
        group_norm(x, 4, None, None, 1e-5)
    with pytest.raises(ValueError, match="6 contiguous elements"):
        group_norm(x, 3, torch.ones(5), None, 1e-5)
    with pytest.raises(ValueError, match="activation must be one of"):
        group_norm(x, 3, None, None, 1e-5, "swish")
    with pytest.raises(ValueError, match="strides"):
        group_norm(x, 3, None, None, 1e-5, "", (1, 2))


# --- the pass, through the backend ---------------------------------------------------------


class StdConv2d(nn.Conv2d):
    """timm's weight-standardised convolution (BiT): the weight normalised per output
    channel by a batch_norm in training mode, then the convolution."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.weight.reshape(1, self.out_channels, -1)
        weight = F.batch_norm(flat, None, None, training=True, momentum=0.0, eps=1e-6)
        return F.conv2d(x, weight.reshape_as(self.weight), self.bias, self.stride,
                        self.padding, self.dilation, self.groups)  # fmt: skip


class GroupNormAct(nn.GroupNorm):
    """timm's GroupNormAct: ``F.group_norm``, then the activation (in place, as timm's)."""

    def __init__(self, channels: int, groups: int = 4, act: bool = True) -> None:
        super().__init__(groups, channels, eps=1e-5)
        self.act = nn.ReLU(inplace=True) if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class PreActBottleneck(nn.Module):
    """BiT's block (timm's ``PreActBottleneck``): norm + ReLU before each convolution, the
    shortcut from the block's input."""

    def __init__(self, channels: int = 12, mid: int = 8) -> None:
        super().__init__()
        self.norm1, self.conv1 = GroupNormAct(channels), StdConv2d(channels, mid, 1, bias=False)
        self.norm2, self.conv2 = GroupNormAct(mid), StdConv2d(mid, mid, 3, padding=1, bias=False)
        self.norm3, self.conv3 = GroupNormAct(mid), StdConv2d(mid, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(self.norm1(x))
        return self.conv3(self.norm3(self.conv2(self.norm2(y)))) + x


class UNetResBlock(nn.Module):
    """A diffusion UNet's ResNet block: GroupNorm + SiLU, conv, a time embedding added,
    GroupNorm + SiLU, conv, the shortcut."""

    def __init__(self, channels: int = 8, temb: int = 5) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(4, channels, eps=1e-6)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.time = nn.Linear(temb, channels)
        self.norm2 = nn.GroupNorm(4, channels, eps=1e-6)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(F.silu(t))[:, :, None, None]
        return x + self.conv2(F.silu(self.norm2(h)))


class SharedNorm(nn.Module):
    """A GroupNorm whose value is read twice: the activation is not the kernel's."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return F.gelu(y) + y


@pytest.fixture
def cpu_gates(monkeypatch):
    monkeypatch.setattr(group_norms, "DEVICE_TYPES", {"cuda", "cpu"})


def _randomize(model: nn.Module) -> nn.Module:
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.3, 0.8)
    return model.eval()


def _run(model: nn.Module, *inputs: torch.Tensor, dtype: torch.dtype = torch.float32):
    torch._dynamo.reset()
    fusebackend.clear_cache()
    model = model.to(dtype)
    inputs = tuple(t.to(dtype) for t in inputs)
    before = fusebackend.reports()
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        for _ in range(2):
            out = compiled(*inputs)
        expected = model(*inputs)
    (graph,) = graphs_since(before)
    assert {e["mode"] for e in graph.runtime_modes()} == {"fusion"}
    return out, expected, graph, compiled


def _calls(fused_graphs) -> list[torch.fx.Node]:
    return [n for n in fused_graphs[-1].graph.nodes if n.target is group_norm]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bits_block_runs_each_norm_and_relu_as_one_kernel(dtype, cpu_gates, fused_graphs):
    model = _randomize(PreActBottleneck())
    x = torch.randn(2, 12, 9, 7)
    out, expected, graph, _ = _run(model, x, dtype=dtype)
    rtol, atol = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2),
                  torch.bfloat16: (5e-2, 5e-2)}[dtype]  # fmt: skip
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)
    made = graph.rewrites["group_norms"]
    assert len(made) == 3 and all("(+ " in m for m in made), made
    calls = _calls(fused_graphs)
    assert [c.args[5] for c in calls] == ["relu"] * 3
    graph_nodes = fused_graphs[-1].graph.nodes
    assert not [n for n in graph_nodes if n.target in (F.group_norm, F.relu, torch.relu)]


def test_a_unet_block_runs_its_norms_with_silu(cpu_gates, fused_graphs):
    model = _randomize(UNetResBlock())
    out, expected, graph, _ = _run(model, torch.randn(2, 8, 10, 9), torch.randn(2, 5))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert len(graph.rewrites["group_norms"]) == 2, graph.rewrites
    assert sorted(c.args[5] for c in _calls(fused_graphs)) == ["silu", "silu"]


def test_weights_edited_after_compiling_give_eagers_new_result(cpu_gates):
    model = _randomize(PreActBottleneck())
    x = torch.randn(2, 12, 6, 5)
    _, _, graph, compiled = _run(model, x)
    assert graph.rewrites["group_norms"]
    with torch.no_grad():
        model.norm2.weight.mul_(-1.5)
        model.norm1.bias.add_(0.7)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        state = {k: v * 0.5 + 0.25 for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_a_norm_read_twice_keeps_its_activation_apart(cpu_gates, fused_graphs):
    out, expected, graph, _ = _run(_randomize(SharedNorm()), torch.randn(3, 6, 5, 4))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    (made,) = graph.rewrites["group_norms"]
    assert "(+" not in made, made
    (call,) = _calls(fused_graphs)
    assert call.args[5] == ""


def test_left_to_aten_on_a_device_type_the_pass_does_not_take(fused_graphs):
    # (the gate as shipped: CUDA only; the CPU without the fixture)
    out, expected, graph, _ = _run(_randomize(PreActBottleneck()), torch.randn(2, 12, 5, 5))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not graph.rewrites.get("group_norms")
    assert not _calls(fused_graphs)


class NormThenConvs(nn.Module):
    """A norm + ReLU read by two convolutions (BiT's first norm of a block feeds the block's
    convolution and its shortcut's), or by a convolution and a mean (``shared_with_add``)."""

    def __init__(self, shared_with_add: bool = False) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 6)
        self.conv = nn.Conv2d(6, 4, 3, padding=1)
        self.shortcut = nn.Conv2d(6, 4, 1)
        self.shared_with_add = shared_with_add

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (functional calls: torch.fx.symbolic_trace keeps modules as calls of their own)
        norm, conv, shortcut = self.norm, self.conv, self.shortcut
        y = F.relu(F.group_norm(x, 2, norm.weight, norm.bias, norm.eps))
        z = F.conv2d(y, conv.weight, conv.bias, 1, 1)
        if self.shared_with_add:  # (a mean's value has one layout whatever y's is)
            return z + y.mean((2, 3))[:, :4, None, None]
        return z + F.conv2d(y, shortcut.weight, shortcut.bias)


def _traced_as_on_cuda(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    """``model`` traced with fake example values, its GroupNorm's and ReLU's values contiguous
    as aten's CUDA GroupNorm gives them for a channels-last input (the CPU keeps the input's
    layout), the convolutions' weights channels-last as passes/channels_last.py makes them,
    and their values channels-last as cuDNN gives them for such weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = torch.fx.symbolic_trace(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = dict(gm.named_parameters())
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example_value"] = mode.from_tensor(x)
        elif node.op == "get_attr":
            value = params[node.target]
            if value.dim() == 4:
                value = value.contiguous(memory_format=torch.channels_last)
            node.meta["example_value"] = mode.from_tensor(value)
        elif node.op != "output":
            node.meta["example_value"] = group_norms.evaluate(node)
            value = node.meta["example_value"]
            if node.target in (F.group_norm, F.relu):
                node.meta["example_value"] = value.contiguous()
            elif node.target is F.conv2d:  # (cuDNN's, for a channels-last weight)
                node.meta["example_value"] = value.contiguous(memory_format=torch.channels_last)
    return gm


def _convolutions_read_a_channels_last_copy(gm: torch.fx.GraphModule) -> None:
    """The convolutions read the ReLU's value through one channels-last copy, as
    passes/channels_last.py has them read a value whose traced layout is not channels-last
    (which runs before the GroupNorm pass)."""
    (relu,) = [n for n in gm.graph.nodes if n.target is F.relu]
    convs = [n for n in relu.users if n.target is F.conv2d]
    with gm.graph.inserting_after(relu):
        copy = gm.graph.call_method("contiguous", (relu,), {"memory_format": torch.channels_last})
    value = relu.meta["example_value"]
    with value.fake_mode:
        copy.meta["example_value"] = value.contiguous(memory_format=torch.channels_last)
    for conv in convs:
        conv.replace_input_with(relu, copy)


@pytest.mark.parametrize("readers", ["convolutions", "a channels-last copy", "a mean too"])
def test_a_norm_read_by_convolutions_alone_stays_channels_last(readers, cpu_gates):
    torch.manual_seed(6)
    model = _randomize(NormThenConvs(shared_with_add=readers == "a mean too"))
    x = torch.randn(2, 6, 9, 7).contiguous(memory_format=torch.channels_last)
    gm = _traced_as_on_cuda(model, x)
    if readers == "a channels-last copy":
        _convolutions_read_a_channels_last_copy(gm)
    (made,) = group_norms.use_group_norms(gm.graph, group_norm)
    assert "(+ " in made, made
    (call,) = [n for n in gm.graph.nodes if n.target is group_norm]
    written = call.meta["example_value"]
    if readers == "a mean too":  # the traced (contiguous) layout
        assert call.args[6] == (378, 63, 7, 1) and written.is_contiguous()
    else:  # only convolutions: the input's channels-last layout, no transpose before them
        assert call.args[6] == x.stride()
        assert written.is_contiguous(memory_format=torch.channels_last)
        assert not written.is_contiguous()
        assert all(user.target is F.conv2d for user in call.users), list(call.users)
    gm.recompile()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_launch_given_the_wrong_arguments_names_its_kernel():
    # Triton's C launcher names no kernel in its TypeError; a fused graph's fallback reason
    # is that message (a kernel launched through another's launcher on an H200, 2026-12-01)
    from fusebackend.kernels.launch import run_on_device

    x = torch.randn(2, 6, 5, 5)
    ((kernel, grid, args, meta),) = group_norm_module._launches(x, 3, None, None, 1e-5, "",
                                                               torch.empty_like(x))  # fmt: skip
    with pytest.raises(TypeError, match=r"launching _group_norm_apply with 14 arguments"):
        run_on_device(kernel, grid, args[:-1], meta, x.device)


def test_wav2vec2s_feature_encoder_runs_its_norm_and_gelu_as_one_kernel(cpu_gates, fused_graphs):
    # transformers' Wav2Vec2 (and HuBERT's, WavLM's) first feature convolution: a GroupNorm
    # with a group per channel over [N, C, L], then GELU
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
        conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), feat_extract_norm="group",
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    torch.manual_seed(7)
    model = transformers.Wav2Vec2Model(config).eval()
    torch._dynamo.reset()
    before = fusebackend.reports()
    compiled = torch.compile(model, backend="infinifuse")
    x = torch.randn(2, 403)
    with torch.no_grad():
        for _ in range(2):
            out = compiled(x).last_hidden_state
        expected = model(x).last_hidden_state
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    made = [m for graph in graphs_since(before) for m in graph.rewrites.get("group_norms", [])]
    assert len(made) == 1 and "(+ " in made[0], made
    (call,) = [n for g in fused_graphs if g is not None for n in g.graph.nodes
               if n.target is group_norm]  # fmt: skip
    assert call.args[1] == 16 and call.args[5] == "gelu"  # a group per channel
