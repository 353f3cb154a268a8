"""GroupNorms on the GPU (kernels/group_norm.py, passes/group_norms.py): the kernel against
``F.group_norm`` and the activation at BiT's and a diffusion UNet's shapes in every float
dtype, NCHW and channels-last, rows held whole and split into parts; timm's ResNet-V2 (BiT,
``pretrained=False``, fp16) runs every GroupNorm as the kernel with its ReLU, captured, and
replays equal eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import EAGER_ACTIVATIONS, rewrites_of
from test_batch_norm_folding_gpu import _eval_model, replayed

from fusebackend.kernels.group_norm import group_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (the activations of BiT and of a UNet, and none)
_ACTIVATIONS = ("", "relu", "silu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("shape", "groups"),
    [
        ((1, 256, 56, 56), 32),  # BiT's first stage at batch 1: 32 rows split into parts
        ((8, 2048, 7, 7), 32),  # its last stage at batch 8: rows held whole
        ((2, 320, 64, 64), 32),  # a UNet's first resolution
        ((3, 30, 17, 13), 5),  # odd sizes
    ],
)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("activation", _ACTIVATIONS)
def test_the_kernel_equals_eager_on_the_gpu(shape, groups, layout, dtype, activation):
    torch.manual_seed(0)
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.rand(shape[1], device="cuda") + 0.5).to(dtype)
    bias = torch.randn(shape[1], device="cuda").to(dtype)
    out = group_norm(x, groups, weight, bias, 1e-5, activation)
    expected = EAGER_ACTIVATIONS[activation](F.group_norm(x, groups, weight, bias, 1e-5))
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 2e-5}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def _a_constant(weight: torch.fx.Node) -> bool:
    """A parameter (the head's 1 x 1 classifier: channels-last in either layout), a derived
    constant the fused graph owns (``get_attr``), or a reshape of one (a standardised 1 x 1
    weight keeps the view after it): nothing computed in the call."""
    if weight.op == "call_method" and weight.target in ("reshape_as", "reshape", "view"):
        weight = weight.args[0]
    return weight.op in ("get_attr", "placeholder")


@pytest.mark.parametrize("name", ["resnetv2_50x1_bit"])
def test_bits_group_norms_run_as_the_kernel_and_replays_equal_eager(name, fused_graphs):
    pytest.importorskip("timm")
    model = _eval_model(name)
    x = torch.randn(2, 3, 96, 80, device="cuda", dtype=torch.float16)
    _, _, graphs = replayed(model, x)
    norms = sum(isinstance(m, torch.nn.GroupNorm) for m in model.modules())
    made = rewrites_of(graphs, "group_norms")
    assert len(made) == norms, made
    # every norm with its ReLU: the blocks' three and the head's (timm's GroupNormAct)
    assert sum("(+ " in m for m in made) == norms, made
    # no layout copy in the call: the image made channels-last once, the norms written
    # channels-last for their convolutions, the standardised weights channels-last constants
    (fused,) = [gm for gm in fused_graphs if gm is not None]
    copies = [n.name for n in fused.graph.nodes if n.target == "contiguous"]
    assert len(copies) == 1, copies
    convs = [n for n in fused.graph.nodes if n.target in (torch.conv2d, F.conv2d)]
    computed = [conv.args[1] for conv in convs if not _a_constant(conv.args[1])]
    assert convs and not computed, [w.format_node() for w in computed]
    assert not rewrites_of(graphs, "channels_last_left_alone")
