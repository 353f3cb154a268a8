"""Concatenations read by a row group (passes/concatenation.py, ``kernels/ir.Concat``).

The kernel reads each part of a ``torch.cat`` where it lies instead of a copy: along a row
dim (ViT's class token before the patches, GhostNet's and DenseNet's channels in NCHW) and
along the columns (channels of channels-last images, a last-dim cat). Each test proves the
``cat`` is a member of a fused group (no ``cat`` kernel left) and compares with eager at odd
sizes; the refusals say why. Slices that keep every element are dropped first
(``drop_identity_slices``: GhostNet's ``out[:, :out_chs]``).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, check, eager, run_fused, single_group, timm_fp16_replayed

import fusebackend
from fusebackend.kernels.ir import Concat, InputRef, Instr, RowProgram, ValueRef
from fusebackend.kernels.launch import row_kernel
from fusebackend.passes.concatenation import MAX_PARTS, drop_identity_slices

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cat_group(report):
    group = single_group(report)
    assert group.moves and set(group.moves) <= set(group.nodes), str(report)  # the cat
    assert "concat([" in group.source, group.source
    return group


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_class_token_position_add_and_layer_norm(dtype):
    """ViT's ``cat([cls_token.expand(B, -1, -1), x], 1) + pos_embed`` and the LayerNorm of the
    first block: one kernel; the class token is read through a stride-0 batch dim."""
    torch.manual_seed(0)
    cls = torch.randn(1, 1, 24, dtype=dtype)
    x = torch.randn(3, 13, 24, dtype=dtype)
    pos = torch.randn(1, 14, 24, dtype=dtype)
    w, b = torch.randn(24, dtype=dtype), torch.randn(24, dtype=dtype)

    def vit_stem(cls, x, pos, w, b):
        y = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1) + pos
        return y, F.layer_norm(y, (24,), w, b, 1e-6)

    report = check(vit_stem, cls, x, pos, w, b, floor_dtype=dtype)
    group = _cat_group(report)
    assert "layer_norm" in group.nodes, str(report)


class GhostTail(nn.Module):
    """GhostNet's second ghost module: BatchNorms folded into the two convolutions, their
    outputs concatenated, cut to every channel, plus the shortcut."""

    def __init__(self, inp: int = 6, init: int = 5) -> None:
        super().__init__()
        self.primary = nn.Sequential(nn.Conv2d(inp, init, 1, bias=False), nn.BatchNorm2d(init))
        self.cheap = nn.Sequential(nn.Conv2d(init, init, 3, padding=1, groups=init, bias=False),
                                   nn.BatchNorm2d(init))  # fmt: skip
        for bn in (self.primary[1], self.cheap[1]):
            bn.running_mean.uniform_(-1.0, 1.0)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor, shortcut: torch.Tensor) -> torch.Tensor:
        x1 = self.primary(x)
        x2 = self.cheap(x1)
        out = torch.cat([x1, x2], dim=1)
        return out[:, : x1.shape[1] * 2] + shortcut


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_ghost_module_cat_and_shortcut_add_are_one_kernel(channels_last):
    """NCHW: a cat along a row dim; channels-last: the group walks channels as its columns,
    so the cat is along the columns. The identity slice is dropped, the cat and the add are
    one kernel, the result keeps eager's layout."""
    torch.manual_seed(1)
    model = GhostTail().eval()
    x, shortcut = torch.randn(2, 6, 5, 7), torch.randn(2, 10, 5, 7)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
        shortcut = shortcut.contiguous(memory_format=torch.channels_last)
    expected = eager(model, x, shortcut)
    actual, report = run_fused(model, x, shortcut)
    assert_close(actual, expected)
    assert actual.stride() == expected.stride()
    group = _cat_group(report)
    assert len(group.nodes) == 2, str(report)  # the cat and the add
    assert report.graphs[0].rewrites["identity_slices"], str(report)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_block_features_three_parts_then_scale_shift_relu(dtype):
    """DenseNet's concatenated features feeding its BatchNorm (eval: a scale and shift) and
    ReLU, three parts of odd channel counts, one of them a non-contiguous view."""
    torch.manual_seed(2)
    a = torch.randn(2, 3, 5, 6, dtype=dtype)
    b = torch.randn(2, 6, 6, 5, dtype=dtype).transpose(2, 3)[:, 1:6]  # 5 channels, strided
    c = torch.randn(2, 7, 5, 6, dtype=dtype)
    scale, shift = torch.randn(1, 15, 1, 1, dtype=dtype), torch.randn(1, 15, 1, 1, dtype=dtype)

    def features(a, b, c, scale, shift):
        return torch.relu(torch.cat([a, b, c], 1) * scale + shift)

    report = check(features, a, b, c, scale, shift, floor_dtype=dtype)
    assert len(_cat_group(report).nodes) == 4, str(report)


def test_last_dim_cat_of_a_part_one_column_wide():
    """Columns: parts 3, 5 and 1 wide (a part of width 1 is read over its column, not once
    per row as a narrow operand)."""
    torch.manual_seed(3)
    a, b, c = torch.randn(4, 6, 3), torch.randn(4, 6, 5), torch.randn(4, 6, 1)

    def f(a, b, c):
        return torch.sigmoid(torch.cat([a, b, c], -1) * 2.0)

    _cat_group(check(f, a, b, c))


def test_cat_read_in_a_chunked_row_loop():
    """A softmax over rows too wide for one block (the chunked layout reloads the parts in
    each of its loops): 2 x 3000 columns from two parts along the columns."""
    torch.manual_seed(4)
    a, b = torch.randn(3, 1700), torch.randn(3, 1300)

    def f(a, b):
        return torch.softmax(torch.cat([a, b], -1) * 0.5, dim=-1)

    _cat_group(check(f, a, b))


def test_part_computed_in_the_group_stays_a_cat():
    """A part that is a value of the group cannot be read from memory: the cat is left as
    traced, with the reason, and the result is eager's (a softmax after it: an elementwise
    consumer would run on the parts instead, passes/concat_writes.py)."""
    torch.manual_seed(5)
    x = torch.randn(3, 8)

    def f(x):
        t = x.sin()
        u = t * 2.0
        return torch.softmax(torch.cat([t, u], -1), -1)

    report = check(f, x)
    reasons = [r.reason for r in report.rejections]
    assert any("a concatenation of t, a value computed in the group" in r for r in reasons), (
        str(report))  # fmt: skip
    first, second = report.groups
    assert first.nodes == ("t", "u") and not first.moves, str(report)
    assert second.moves == ("cat",), str(report)


def test_more_parts_than_fused_stays_a_cat():
    parts = [torch.randn(2, 3) for _ in range(MAX_PARTS + 1)]

    def f(*parts):
        return torch.cat(parts, 0) * 2.0 + 1.0

    report = check(f, *parts)
    assert not any(g.moves for g in report.groups), str(report)


def test_symbolic_length_stays_a_cat():
    """Under dynamic shapes a part's size along the dim is symbolic: the offsets would not
    be constants of the kernel, so the cat runs as traced; every length equals eager."""
    torch.manual_seed(6)
    compiled = torch.compile(
        lambda a, b: torch.cat([a, b], 1) * 2.0 + 1.0,
        backend="infinifuse", dynamic=True, options={"validate": False},
    )  # fmt: skip
    for length in (3, 5, 9):
        a, b = torch.randn(2, length, 4), torch.randn(2, 2, 4)
        with torch.no_grad():
            assert_close(compiled(a, b), torch.cat([a, b], 1) * 2.0 + 1.0)


def test_symbolic_rows_with_a_static_cat_dim_are_fused():
    """A cat along the columns of parts whose row count is symbolic (Llama's
    ``cat((freqs, freqs), -1)`` under dynamic shapes): the offsets are constants, the rows
    are read by strides; every length equals eager and the cat is in the group."""
    import fusebackend

    def f(a, b):
        return torch.cat([a, b], -1).cos() * 2.0

    compiled = torch.compile(f, backend="infinifuse", options={"validate": False})
    for length in (3, 5, 9):
        a, b = torch.randn(length, 3), torch.randn(length, 5)
        torch._dynamo.mark_dynamic(a, 0)
        torch._dynamo.mark_dynamic(b, 0)
        with torch.no_grad():
            assert_close(compiled(a, b), f(a, b))
    assert any(g.moves for g in fusebackend.last_report().groups), str(fusebackend.last_report())


def test_launch_reads_each_part_at_its_own_strides():
    """The kernel alone: a row-dim cat of a broadcast part (stride 0 over the batch), a
    transposed part and a contiguous one, times an operand of the whole shape; each part's
    rows and the merged row dims of the launch addressed right."""
    torch.manual_seed(7)
    program = RowProgram(
        (torch.float32,) * 4,
        (),
        (
            Concat((InputRef(0), InputRef(1), InputRef(2)), -2, (1, 4, 2), torch.float32),
            Instr("mul", (ValueRef(0), InputRef(3)), torch.float32),
        ),
        (1,),
    )
    first = torch.randn(1, 1, 5).expand(3, 1, 5)
    second = torch.randn(3, 5, 4).transpose(1, 2)
    third = torch.randn(3, 2, 5)
    other = torch.randn(3, 7, 5)
    (out,) = row_kernel(program, [first, second, third, other])
    assert_close(out, torch.cat([first, second, third], 1) * other)


def test_program_sizes_must_match_the_parts():
    program = RowProgram(
        (torch.float32,) * 2, (), (Concat((InputRef(0), InputRef(1)), -1, (3, 4), torch.float32),),
        (0,),
    )  # fmt: skip
    with pytest.raises(ValueError, match="concatenation along dim -1 of sizes"):
        row_kernel(program, [torch.randn(2, 3), torch.randn(2, 5)])


@pytest.mark.parametrize(
    ("index", "dropped"),
    [
        ((slice(None), slice(None, 5)), True),
        ((slice(None), slice(0, 9)), True),  # a stop past the end keeps everything
        ((Ellipsis, slice(None, 7)), True),
        ((slice(None), slice(None, 4)), False),
        ((slice(None), slice(1, None)), False),
        ((slice(None), slice(None, None, 2)), False),
        ((slice(None), slice(None, -1)), False),
        ((slice(None), 0), False),
    ],
)
def test_identity_slices(index, dropped):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(3, 5, 7)
    item = graph.call_function(operator.getitem, (x, index))
    doubled = graph.call_function(operator.mul, (item, 2.0))
    graph.output(doubled)
    removed = drop_identity_slices(graph)
    assert bool(removed) == dropped
    assert (doubled.args[0] is x) == dropped


def test_an_identity_slice_returned_by_the_graph_stays():
    """A graph output stays the view eager returns (the runtime keeps outputs apart from
    its inputs' buffers by what it returns)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(3, 5)
    item = graph.call_function(operator.getitem, (x, (slice(None), slice(None, 5))))
    graph.output(item)
    assert drop_identity_slices(graph) == []


def _rotary_with_an_empty_pass(q, k, v, then):
    """Phi-3's ``cat([rotated, q[..., rotary_dim:]], -1)`` with a rotary dim of the whole
    head: the second part is empty. ``q`` is a transposed view, so the rotated part keeps
    that layout and the cat's result is contiguous (but where the cat is written: there both
    are contiguous, and only the write keeps the cat)."""
    q = q.transpose(1, 2) if then != "written" else q
    q_embed = torch.cat([q * 0.5 + 1.0, q[..., q.shape[-1] :]], dim=-1)
    if then == "attention":
        return F.scaled_dot_product_attention(q_embed, k, v)
    if then == "view":  # a view needs the cat's own (contiguous) strides
        return q_embed.view(q_embed.shape[0], -1) * 3.0
    if then == "unsqueezed":  # a view of either strides: the reader would see other ones
        return q_embed.unsqueeze(0) * 3.0
    if then == "repeated":  # repeat_kv: the reshape copies either way, into one layout
        b, heads, length, d = q_embed.shape
        repeated = q_embed[:, :, None].expand(b, heads, 2, length, d)
        return repeated.reshape(b, heads * 2, length, d) * 3.0
    q_embed[..., 0] = 5.0  # written after the cat: the cat's copy, not q's values
    return q_embed * 3.0 + q


@pytest.mark.parametrize(("then", "dropped"), [("attention", True), ("view", False),
                                                ("written", False), ("repeated", True),
                                                ("unsqueezed", False)])  # fmt: skip
def test_a_cat_with_empty_parts_reads_its_one_part_where_its_readers_allow(then, dropped):
    torch.manual_seed(0)
    q = torch.randn(2, 5, 3, 8)  # (batch, length, heads, head dim), read transposed
    k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    expected = eager(_rotary_with_an_empty_pass, q, k, v, then)
    torch._dynamo.reset()
    actual, report = run_fused(_rotary_with_an_empty_pass, q, k, v, then, expect_fused=False)
    assert_close(actual, expected)
    cats = [n for n in report.graphs[-1].rewrites.get("identity_slices", []) if "embed" in n]
    assert bool(cats) == dropped, str(report)


# -- on a GPU ------------------------------------------------------------------------------

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_gpu_ghost_module_and_class_token(dtype, channels_last):
    """The row-dim and column cats compiled for the GPU (Triton proves other alignments
    there than the interpreter needs), replayed from a captured graph, equal eager."""
    torch.manual_seed(8)
    model = GhostTail(6, 13).eval().to("cuda", dtype)
    x = torch.randn(3, 6, 9, 11, device="cuda", dtype=dtype)
    shortcut = torch.randn(3, 26, 9, 11, device="cuda", dtype=dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x, shortcut = (t.contiguous(memory_format=torch.channels_last) for t in (x, shortcut))
    compiled = torch.compile(model, backend="infinifuse", options={"validate": False})
    with torch.no_grad():
        expected = model(x, shortcut)
        for _ in range(3):  # the 2nd call captures, the 3rd replays
            out = compiled(x, shortcut)
    assert_close(out, expected, floor_dtype=dtype)
    assert _no_cat_left(fusebackend.last_report())

    cls = torch.randn(1, 1, 40, device="cuda", dtype=dtype)
    tokens = torch.randn(5, 49, 40, device="cuda", dtype=dtype)
    pos = torch.randn(1, 50, 40, device="cuda", dtype=dtype)

    def stem(cls, tokens, pos):
        y = torch.cat([cls.expand(tokens.shape[0], -1, -1), tokens], dim=1) + pos
        return y, F.layer_norm(y, (40,), eps=1e-6)

    compiled_stem = torch.compile(stem, backend="infinifuse", options={"validate": False})
    with torch.no_grad():
        for _ in range(3):
            got = compiled_stem(cls, tokens, pos)
    assert_close(got, stem(cls, tokens, pos), floor_dtype=dtype)


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("name", ["ghostnet_100", "vit_small_patch16_224", "densenet121"])
def test_gpu_timm_models_with_concatenations_equal_eager(name):
    timm_fp16_replayed(name, 224 if name.startswith("vit") else 96, seed=9)
    assert _no_cat_left(fusebackend.last_report())


def _no_cat_left(report) -> bool:
    """Every cat of the report's graphs read by a group or written in place by the groups of
    its parts. In half precision a BatchNorm is not folded into its convolution but is a
    group after it (passes/batch_norm_folding.py), so GhostNet's cats are all of group
    outputs: written in place (passes/concat_writes.py) rather than read as a concat."""
    read = any(g.moves for g in report.groups)
    written = any(graph.rewrites.get("concatenations_written") for graph in report.graphs)
    return read or written
