"""Fusion of embedding chains through the compiled backend: chains x dtypes x index dtypes x
odd shapes. Each case proves the group exists with the expected lookups and nodes, and that
the fused outputs equal eager PyTorch's on the same random inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    assert_close,
    check,
    compile_fused,
    eager,
    rand_ids,
    rand_table,
    run_fused,
    single_group,
)

import fusebackend

V = 37  # vocabulary size: odd on purpose
P = 16  # max positions


def _embedding(rows: int, dim: int, dtype: torch.dtype) -> nn.Embedding:
    emb = nn.Embedding(rows, dim, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(rand_table(rows, dim, dtype))
    return emb


# --- chains over one index tensor ---------------------------------------------------------


class Single(nn.Module):
    """One op after the lookup."""

    LOOKUPS, NODES, OUTPUTS = 1, 2, 1

    def __init__(self, dim, dtype):
        super().__init__()
        self.emb = _embedding(V, dim, dtype)

    def forward(self, ids):
        return self.emb(ids) * 3.0


class Long(nn.Module):
    """Eight elementwise ops of different kinds after the lookup."""

    LOOKUPS, NODES, OUTPUTS = 1, 9, 1

    def __init__(self, dim, dtype):
        super().__init__()
        self.emb = _embedding(V, dim, dtype)

    def forward(self, ids):
        x = self.emb(ids)
        x = x * 1.5
        x = x + 0.25
        x = torch.sigmoid(x)
        x = x - 0.5
        x = torch.tanh(x * 4.0)
        x = F.silu(x)
        return x / 1.3


class GemmaTensor(nn.Module):
    """Gemma's input scaling: ``emb * torch.tensor(sqrt(d), dtype=emb.dtype)``."""

    LOOKUPS, NODES, OUTPUTS = 1, 2, 1

    def __init__(self, dim, dtype):
        super().__init__()
        self.dim = dim
        self.emb = _embedding(V, dim, dtype)

    def forward(self, ids):
        x = self.emb(ids)
        normalizer = torch.tensor(self.dim**0.5, dtype=x.dtype)
        return x * normalizer


class GemmaScalar(nn.Module):
    """``emb * math.sqrt(d)`` with a Python float."""

    LOOKUPS, NODES, OUTPUTS = 1, 2, 1

    def __init__(self, dim, dtype):
        super().__init__()
        self.dim = dim
        self.emb = _embedding(V, dim, dtype)

    def forward(self, ids):
        return self.emb(ids) * math.sqrt(self.dim)


class MultiOutput(nn.Module):
    """An intermediate is returned too: the kernel writes two outputs."""

    LOOKUPS, NODES, OUTPUTS = 1, 4, 2

    def __init__(self, dim, dtype):
        super().__init__()
        self.emb = _embedding(V, dim, dtype)

    def forward(self, ids):
        x = self.emb(ids) * 0.7
        y = F.gelu(x) + 1.0
        return y, x


class MultiReduction(nn.Module):
    """An intermediate feeds a reduction outside the group: it becomes an extra output.

    The reduction is amax, not sum: a max of values each within tolerance is within
    tolerance, while a bf16 sum would add up the per-element rounding differences (see
    helpers.TOLERANCES)."""

    LOOKUPS, NODES, OUTPUTS = 1, 4, 2

    def __init__(self, dim, dtype):
        super().__init__()
        self.emb = _embedding(V, dim, dtype)
        self.bias = nn.Parameter(rand_table(1, dim, dtype)[0])

    def forward(self, ids):
        x = self.emb(ids) + self.bias
        y = torch.relu(x) * 2.0
        return y, x.amax(-1)


ONE_INDEX_CHAINS = [Single, Long, GemmaTensor, GemmaScalar, MultiOutput, MultiReduction]


def _check_group(report, chain, *, reduction: bool = False):
    group = single_group(report)
    assert len(group.lookups) == chain.LOOKUPS, str(report)
    assert len(group.nodes) == chain.NODES, str(report)
    assert len(group.outputs) == chain.OUTPUTS, str(report)
    assert set(group.lookups) <= set(group.nodes)
    if reduction:
        assert any("without keepdim=True" in r.reason for r in report.rejections), str(report)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("chain", ONE_INDEX_CHAINS, ids=lambda c: c.__name__)
def test_chain_dtypes(chain, dtype, index_dtype):
    torch.manual_seed(0)
    model = chain(33, dtype)
    ids = rand_ids(V, (3, 7), index_dtype)
    report = check(model, ids)
    _check_group(report, chain, reduction=chain is MultiReduction)


def _index(kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "0d":
        return torch.tensor(5, dtype=dtype)
    if kind == "1d":
        return rand_ids(V, (9,), dtype)
    if kind == "3d":
        return rand_ids(V, (2, 3, 4), dtype)
    if kind == "transposed":
        ids = rand_ids(V, (6, 3), dtype).t()
        assert not ids.is_contiguous()
        return ids
    if kind == "sliced":
        ids = rand_ids(V, (3, 12), dtype)[:, 1::3]
        assert not ids.is_contiguous()
        return ids
    if kind == "empty":
        return rand_ids(V, (0,), dtype)
    if kind == "empty2d":
        return rand_ids(V, (2, 0), dtype)
    raise AssertionError(kind)


INDEX_KINDS = ["0d", "1d", "3d", "transposed", "sliced", "empty", "empty2d"]


@pytest.mark.parametrize("dim", [1, 3, 127])
@pytest.mark.parametrize("kind", INDEX_KINDS)
@pytest.mark.parametrize("chain", [Single, Long, MultiReduction], ids=lambda c: c.__name__)
def test_odd_shapes(chain, kind, dim):
    torch.manual_seed(1)
    dtype, index_dtype = (torch.float16, torch.int32) if dim == 3 else (torch.float32, torch.int64)
    model = chain(dim, dtype)
    ids = _index(kind, index_dtype)
    report = check(model, ids)
    _check_group(report, chain, reduction=chain is MultiReduction)


@pytest.mark.parametrize("chain", [Single, MultiOutput], ids=lambda c: c.__name__)
def test_wide_rows_d4097(chain):
    # 4097 = 4 * 1024 + 1: more than one column block, with a one-element tail.
    torch.manual_seed(2)
    model = chain(4097, torch.float32)
    ids = rand_ids(V, (3,), torch.int64)
    report = check(model, ids)
    _check_group(report, chain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_empty_indices_give_empty_outputs_of_the_right_shape(dtype):
    model = MultiOutput(5, dtype)
    ids = torch.empty(4, 0, dtype=torch.int64)
    (y, x), report = run_fused(model, ids)
    assert y.shape == (4, 0, 5) and x.shape == (4, 0, 5)
    assert y.dtype == dtype and x.dtype == dtype
    _check_group(report, MultiOutput)


# --- several tables in one group -------------------------------------------------------


class TokenPositionGelu(nn.Module):
    """GPT-2 style: token ids [B, T] + position ids [1, T] (built in forward), then gelu."""

    LOOKUPS, NODES, OUTPUTS = 2, 4, 1

    def __init__(self, dim, dtype):
        super().__init__()
        self.tok = _embedding(V, dim, dtype)
        self.pos = _embedding(P, dim, dtype)

    def forward(self, ids):
        positions = torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)
        return F.gelu(self.tok(ids) + self.pos(positions))


class TokenPositionInput(nn.Module):
    """Position ids passed in, of shape [1, T] against token ids [B, T], tanh gelu."""

    LOOKUPS, NODES, OUTPUTS = 2, 4, 1

    def __init__(self, dim, dtype):
        super().__init__()
        self.tok = _embedding(V, dim, dtype)
        self.pos = _embedding(P, dim, dtype)

    def forward(self, ids, positions):
        return F.gelu(self.pos(positions) + self.tok(ids), approximate="tanh")


class BertEmbeddings(nn.Module):
    """BERT: token + token-type + position embeddings, summed, then LayerNorm: one kernel
    (TensorRT's EmbLayerNorm plugin, generated)."""

    LOOKUPS, NODES, OUTPUTS = 3, 6, 1

    def __init__(self, dim, dtype):
        super().__init__()
        self.word = _embedding(V, dim, dtype)
        self.position = _embedding(P, dim, dtype)
        self.token_type = _embedding(2, dim, dtype)
        self.norm = nn.LayerNorm(dim, dtype=dtype)
        self.register_buffer("position_ids", torch.arange(P).unsqueeze(0), persistent=False)

    def forward(self, ids, token_types):
        positions = self.position_ids[:, : ids.shape[1]]
        x = self.word(ids) + self.token_type(token_types)
        x = x + self.position(positions)
        return self.norm(x)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("dim", [3, 64])
def test_token_plus_position_gelu(dim, dtype, index_dtype):
    torch.manual_seed(3)
    model = TokenPositionGelu(dim, dtype)
    ids = rand_ids(V, (3, 7), index_dtype)
    report = check(model, ids)
    _check_group(report, TokenPositionGelu)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_token_plus_position_input_broadcast(dtype, index_dtype):
    torch.manual_seed(4)
    model = TokenPositionInput(20, dtype)
    ids = rand_ids(V, (4, 6), index_dtype)
    positions = torch.randperm(P)[:6].unsqueeze(0).to(index_dtype)  # [1, T], not arange
    report = check(model, ids, positions)
    _check_group(report, TokenPositionInput)
    assert len(single_group(report).inputs) == 4  # two index tensors, two tables


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("dim", [1, 48])
def test_bert_three_tables_one_group(dim, dtype, index_dtype):
    torch.manual_seed(5)
    model = BertEmbeddings(dim, dtype)
    with torch.no_grad():  # LayerNorm's affine parameters away from the trivial 1 and 0
        model.norm.weight.copy_(rand_table(1, dim, dtype)[0])
        model.norm.bias.copy_(rand_table(1, dim, dtype)[0])
    ids = rand_ids(V, (2, 9), index_dtype)
    token_types = rand_ids(2, (2, 9), index_dtype)
    # dim=1: LayerNorm of one element is exactly its bias, so the check still holds.
    report = check(model, ids, token_types)
    _check_group(report, BertEmbeddings)
    assert single_group(report).reductions == ("layer_norm",), str(report)


def test_bert_non_contiguous_token_ids():
    torch.manual_seed(6)
    model = BertEmbeddings(16, torch.float32)
    ids = rand_ids(V, (9, 2)).t()
    token_types = rand_ids(2, (2, 18))[:, ::2]
    report = check(model, ids, token_types)
    _check_group(report, BertEmbeddings)


def test_functional_embedding_with_tables_as_inputs():
    # Tables that are plain graph inputs (not parameters), via F.embedding and padding_idx.
    torch.manual_seed(7)

    def fn(ids, table, other):
        a = F.embedding(ids, table, padding_idx=0)
        b = F.embedding(ids.flip(-1), other)
        return (a - b) * 0.5

    table, other = rand_table(V, 10), rand_table(V, 10)
    ids = rand_ids(V, (3, 5))
    report = check(fn, ids, table, other)
    group = single_group(report)
    assert len(group.lookups) == 2 and len(group.nodes) == 4


# --- re-use and re-compilation ----------------------------------------------------------


def test_second_call_and_new_shape_stay_fused():
    torch.manual_seed(8)
    model = TokenPositionGelu(12, torch.float32)
    compiled = compile_fused(model)
    with torch.no_grad():
        for shape in [(2, 5), (2, 5), (3, 7), (4, 2)]:
            ids = rand_ids(V, shape)
            assert_close(compiled(ids), eager(model, ids))
    # The later shapes recompiled with dynamic shapes; that graph was fused too.
    report = fusebackend.last_report()
    assert report.graphs[0].path == "fused", str(report)
    assert all(e["mode"] == "fusion" for e in report.graphs[0].runtime_modes())


def test_dynamic_shapes_fused():
    torch.manual_seed(9)
    model = BertEmbeddings(8, torch.float16)
    compiled = torch.compile(model, backend="infinifuse", dynamic=True, options={"validate": False})
    with torch.no_grad():
        for b, t in [(2, 3), (5, 11)]:
            ids, types = rand_ids(V, (b, t), torch.int32), rand_ids(2, (b, t), torch.int32)
            assert_close(compiled(ids, types), eager(model, ids, types))
    report = fusebackend.last_report()
    group = single_group(report)
    assert len(group.lookups) == 3
    assert all(e["mode"] == "fusion" for e in report.graphs[0].runtime_modes())


def test_default_options_validate_and_keep_fusion():
    # With the default validate=True the first run is compared with the unfused graph; a
    # correct kernel keeps the signature in "fusion".
    torch.manual_seed(10)
    model = Long(24, torch.float16)
    ids = rand_ids(V, (3, 4))
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        out = compiled(ids)
    assert_close(out, eager(model, ids))
    report = fusebackend.last_report()
    assert report.graphs[0].path == "fused"
    assert [e["mode"] for e in report.graphs[0].runtime_modes()] == ["fusion"]


def test_explain_reports_the_group():
    torch.manual_seed(11)
    model = TokenPositionGelu(8, torch.float32)
    with torch.no_grad():
        report = fusebackend.explain(model, rand_ids(V, (2, 3)))
    group = single_group(report)
    assert group.backend == "triton"
    assert len(group.lookups) == 2
    text = str(report)
    assert group.kernel_name in text and "fused" in text
    assert report.source.count("@triton.jit") == 1


@pytest.mark.parametrize(
    "name, lookup",
    [
        ("torch.embedding", lambda ids, w: torch.embedding(w, ids)),
        ("torch.embedding-padding", lambda ids, w: torch.embedding(w, ids, 3)),
        ("F.embedding-negative-padding", lambda ids, w: F.embedding(ids, w, padding_idx=-1)),
        ("F.embedding-sparse", lambda ids, w: F.embedding(ids, w, sparse=True)),
        ("column-slice-table", lambda ids, w: F.embedding(ids, w[:, 2:9])),
        ("transposed-table", lambda ids, w: F.embedding(ids, w.t().contiguous().t())),
    ],
)
def test_lookup_spellings_and_table_views(name, lookup):
    torch.manual_seed(12)
    table = rand_table(V, 11)
    ids = rand_ids(V, (3, 4))

    def fn(ids, w):
        return torch.tanh(lookup(ids, w)) * 2.0

    report = check(fn, ids, table)
    group = single_group(report)
    assert len(group.lookups) == 1 and len(group.nodes) == 3


def _pos_output(ids, tok, pos):
    p = F.embedding(torch.arange(ids.shape[1]), pos)  # [T, D]: an output smaller than [B, T, D]
    return F.gelu(F.embedding(ids, tok) + p), p


PATTERNS = [
    # (name, fn(ids, tok, pos), nodes, lookups, outputs)
    ("position-output", _pos_output, 4, 2, 2),
    (
        "attention-mask-where",
        lambda ids, tok, pos: torch.where((ids > 3)[..., None], F.embedding(ids, tok), 0.0) * 2,
        3,
        1,
        1,
    ),
    ("fp64-table", lambda ids, tok, pos: F.embedding(ids, tok.double()) * 1.1 + 1e-9, 3, 1, 1),
    (
        "width-1-table-times-width-D",
        lambda ids, tok, pos: F.embedding(ids, tok[:, :1]) * F.embedding(ids, pos),
        3,
        2,
        1,
    ),
    (
        "same-lookup-twice",  # one gather: the second is the first's value (common_values)
        lambda ids, tok, pos: F.embedding(ids, tok) * F.embedding(ids, tok) - 0.5,
        3,
        1,
        1,
    ),
    (
        "fp16-and-fp32-tables",
        lambda ids, tok, pos: F.embedding(ids, tok.half()) + F.embedding(ids, pos),
        3,
        2,
        1,
    ),
    (
        "expanded-index",
        lambda ids, tok, pos: F.embedding(ids[:, :1].expand(-1, 4), tok) + 1,
        2,
        1,
        1,
    ),
    (
        "output-returned-twice",
        lambda ids, tok, pos: (lambda x: (x, x, x + 1))(F.embedding(ids, tok) * 2),
        3,
        1,
        2,
    ),
]


@pytest.mark.parametrize(
    "name, fn, nodes, lookups, outputs", PATTERNS, ids=[p[0] for p in PATTERNS]
)
def test_patterns(name, fn, nodes, lookups, outputs):
    torch.manual_seed(13)
    tok, pos = rand_table(V, 8), rand_table(V, 8)
    ids = rand_ids(V, (2, 4))
    report = check(fn, ids, tok, pos)
    group = single_group(report)
    assert (len(group.nodes), len(group.lookups), len(group.outputs)) == (nodes, lookups, outputs)


def test_explain_collects_every_graph_of_a_graph_break():
    torch.manual_seed(14)
    table = rand_table(V, 6)
    ids = rand_ids(V, (2, 3))

    def fn(ids, table):
        a = F.embedding(ids, table) * 2.0
        torch._dynamo.graph_break()
        return F.gelu(F.embedding(ids, table) + a)

    with torch.no_grad():
        report = fusebackend.explain(fn, ids, table, options={"validate": False})
    assert len(report.graphs) == 2, str(report)
    assert [g.path for g in report.graphs] == ["fused", "fused"]
    assert [len(g.nodes) for g in report.groups] == [2, 3]
    assert report.source.count("@triton.jit") == 2
