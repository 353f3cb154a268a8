"""Integer values and prefix sums in row groups (passes/integers.py, ``kernels/ir.Scan``).

RoBERTa's, XLM-R's and MPNet's position ids (``ne``, ``int``, ``cumsum``, ``type_as``,
``* mask``, ``long``, ``+ pad``: seven aten kernels in eager) become one kernel, computed in
int64 and wrapped to each value's dtype as eager's integer ops wrap; BLOOM's ALiBi positions
(``cumsum`` of the mask, then float math) too; boolean mask logic (``&``, ``|``, ``~``)
joins groups. Each test proves the group fused (its source holds the scan or the int64
math) and compares with eager exactly for integers, at odd sizes; refusals say why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, eager, run_fused, single_group
from model_zoo import build, inputs

import fusebackend
from fusebackend.kernels import configs


def _reasons(report) -> list[str]:
    return [r.reason for r in report.rejections]


def roberta_position_ids(input_ids: torch.Tensor, padding_idx: int = 1) -> torch.Tensor:
    """transformers' ``create_position_ids_from_input_ids`` (RoBERTa, XLM-R, MPNet)."""
    mask = input_ids.ne(padding_idx).int()
    incremental = (torch.cumsum(mask, dim=1).type_as(mask) + 0) * mask
    return incremental.long() + padding_idx


def _padded_ids(rows: int, length: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    ids = torch.randint(2, 50, (rows, length))
    ids[0, length - 4 :] = 1  # right padding
    if rows > 1:
        ids[1, :3] = 1  # left padding: positions restart after it
    return ids


@pytest.mark.parametrize("shape", [(3, 37), (1, 5), (4, 130)], ids=str)
def test_roberta_position_ids_are_one_kernel(shape):
    ids = _padded_ids(*shape, seed=shape[1])
    report = check(roberta_position_ids, ids)
    group = single_group(report)
    assert len(group.nodes) == 8, str(report)  # ne, int, cumsum, type_as, add, mul, long, add
    assert "tl.cumsum(" in group.source and "tl.int64" in group.source, group.source


def test_ids_beyond_fp32s_mantissa_stay_exact():
    # Ids above 2**24 differ from their neighbours only in int64: a kernel that computed
    # integers in fp32 would round (2**40 + 1) to 2**40 and compare it equal to the pad.
    pad = 2**40
    ids = torch.full((2, 9), pad + 1, dtype=torch.int64)
    ids[:, ::2] += torch.arange(5) * 3
    ids[1, 4] = pad

    def fn(ids):
        keep = ids.ne(pad)
        return (ids + 7) * keep, torch.cumsum(ids * keep, dim=-1)

    check(fn, ids)


def test_int32_arithmetic_wraps_as_eager():
    # int32 products past 2**31 wrap in eager; the kernel's int64 math must wrap each value
    # back to int32 (the round after every integer op), not only the stored output.
    ids = torch.randint(1, 50, (3, 11), dtype=torch.int32)

    def fn(ids):
        big = ids * 100_000 * 100_000  # wraps twice on the way
        return (big - ids).long() * 3

    report = check(fn, ids)
    assert "tl.int32" in single_group(report).source


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_float_cumsum_with_a_norm(dtype):
    torch.manual_seed(3)
    x = torch.randn(5, 7, 45, dtype=dtype)
    w = torch.randn(45, dtype=dtype)

    def fn(x, w):
        s = torch.cumsum(x * 0.5, dim=-1)
        return F.layer_norm(s + x, (45,), w), s.amax(-1, keepdim=True)

    # bf16 rows: a sum of another order rounds to a neighbouring bf16 (1 ulp at ~8), which
    # the norm scales up where the row's spread is small
    loose = {"atol": 4e-2, "rtol": 4e-2} if dtype == torch.bfloat16 else {}
    report = check(fn, x, w, **loose)
    assert "tl.cumsum(" in single_group(report).source


def test_chunked_rows_carry_the_running_sum(monkeypatch):
    # Rows wider than a persistent program are walked in chunks: each chunk's prefix sums
    # start from the sum of the chunks before it. Small limits make 37-wide rows chunked.
    monkeypatch.setattr(configs, "MAX_PERSISTENT_D", 16)
    monkeypatch.setattr(configs, "CHUNK_D", 8)
    ids = _padded_ids(3, 37, seed=5)
    torch.manual_seed(5)
    x = torch.randn(3, 37)

    def fn(ids, x):
        pos = roberta_position_ids(ids)
        s = torch.cumsum(x, dim=-1)
        return pos, s - s.mean(-1, keepdim=True), torch.cumsum(s, -1)

    report = check(fn, ids, x)
    assert len(report.groups) == 2, str(report)  # the ids' group and x's
    for group in report.groups:
        assert "layout: chunked" in group.source and "carry" in group.source, group.source


def test_alibi_positions_from_the_mask():
    # BLOOM: ((mask.cumsum(-1) - 1) * mask)[:, None, :] * slopes, in float.
    mask = torch.ones(3, 13, dtype=torch.int64)
    mask[0, :4] = 0
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(1, 4, 1)

    def fn(mask, slopes):
        positions = ((mask.cumsum(dim=-1) - 1) * mask)[:, None, :]
        return slopes * positions

    report = check(fn, mask, slopes)
    assert any("tl.cumsum(" in g.source for g in report.groups), str(report)


def test_mask_logic_joins_the_group():
    torch.manual_seed(7)
    x = torch.randn(4, 19)
    ids = torch.randint(0, 5, (4, 19))

    def fn(x, ids):
        keep = (x > -0.5) & ids.ne(0) | ~(x < 1.0)
        return torch.where(keep, x * 2.0, float("-inf")).softmax(-1)

    report = check(fn, x, ids)
    group = single_group(report)
    assert len(group.nodes) >= 7, str(report)


def test_integer_operands_of_float_math_are_promoted():
    torch.manual_seed(8)
    x = torch.randn(3, 10, dtype=torch.float16)
    counts = torch.randint(-3, 9, (3, 10), dtype=torch.int32)

    def fn(x, counts):
        return torch.exp(x * 0.1) * counts + (counts > 2)

    check(fn, x, counts)


def test_indices_computed_in_a_group_stay_a_lookup_input():
    # A decode step's position (ids of width 1) + an offset: the lookup never joins the
    # group that computes its indices (it reads them from memory), and both still fuse.
    torch.manual_seed(9)
    table = torch.randn(40, 16)
    ids = torch.randint(0, 20, (3, 1))

    def fn(ids, table):
        positions = (ids.ne(0).long() * 2 + ids) + 3
        return F.embedding(positions, table) * 0.5 + 1.0

    out, report = run_fused(fn, ids, table)
    assert_close(out, eager(fn, ids, table))
    for group in report.groups:
        if group.lookups:
            assert "tl.cumsum(" not in group.source and " + 3" not in group.source


@pytest.mark.parametrize(
    "fn, reason",
    [
        (lambda ids: torch.amax(ids * 2 + 1, -1, keepdim=True), "result dtype torch.int64"),
        (lambda ids: torch.add(ids * 2 + 1, ids, alpha=3), "add with alpha=3 of integers"),
        (lambda ids: torch.cumsum(ids * 2 + 1, dim=0), "reduces over dim=0"),
    ],
    ids=["integer-reduction", "integer-alpha", "cumsum-over-rows"],
)
def test_integer_refusals_say_why(fn, reason):
    # (a group of the two ops before it records why the third stays out)
    ids = torch.randint(0, 9, (4, 6))
    out, report = run_fused(fn, ids, expect_fused=False)
    assert any(reason in r for r in _reasons(report)), str(report)
    assert_close(out, eager(fn, ids))


@pytest.mark.parametrize("family", ["roberta", "mpnet", "bloom"])
def test_zoo_position_ids_fuse(family):
    # transformers' own code (tests/model_zoo.py, padded mask): the cumsum is in a kernel
    torch.manual_seed(0)
    model = build(family)
    kwargs = inputs(family)
    report = fusebackend.explain(model, **kwargs)
    sources = [g.source for graph in report.graphs for g in graph.groups]
    assert any("tl.cumsum(" in s for s in sources), str(report)
    with torch.no_grad():
        expected = model(**kwargs).last_hidden_state
        out = torch.compile(model, backend="infinifuse")(**kwargs).last_hidden_state
    assert_close(out, expected)
