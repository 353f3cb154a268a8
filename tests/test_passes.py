"""The fusion pass through the backend: what is not fused and why (rejections with reasons),
extra outputs, mutations, the fusion=False option, and option errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import (
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

V, D = 31, 12


def _reasons(report) -> list[str]:
    return [r.reason for r in report.rejections]


def _has_reason(report, *parts: str) -> bool:
    return any(all(p in reason for p in parts) for reason in _reasons(report))


def _tables(n: int = 1, dim: int = D):
    return [rand_table(V, dim) for _ in range(n)]


# --- rejections -------------------------------------------------------------------------


def test_max_norm_is_rejected_and_still_renormalises_the_weight():
    torch.manual_seed(0)
    emb = nn.Embedding(V, D, max_norm=1.0)
    with torch.no_grad():
        emb.weight.copy_(rand_table(V, D) * 3)  # every row's norm is above 1
    reference = nn.Embedding(V, D, max_norm=1.0)
    reference.load_state_dict(emb.state_dict())
    ids = rand_ids(V, (3, 5))

    out, report = run_fused(lambda ids: emb(ids) * 2.0, ids, expect_fused=False)
    expected = eager(lambda ids: reference(ids) * 2.0, ids)
    assert report.groups == []
    assert _has_reason(report, "max_norm mutates the weight"), str(report)
    assert_close(out, expected)
    assert_close(emb.weight, reference.weight)  # rows renormalised in place, as in eager
    assert not torch.equal(emb.weight, rand_table(V, D))


def test_reduction_consumer_is_rejected_with_the_reason():
    torch.manual_seed(1)
    (table,) = _tables()
    ids = rand_ids(V, (2, 4))

    def fn(ids, table):
        return F.embedding(ids, table).sum(-1)

    out, report = run_fused(fn, ids, table, expect_fused=False)
    assert report.groups == []
    assert report.graphs[0].path == "unfused (nothing to fuse)"
    assert _has_reason(report, "no fusible consumer", "without keepdim=True"), str(report)
    assert_close(out, eager(fn, ids, table))


def test_ops_inside_vmap_stay_out_of_groups():
    # Dynamo inlines torch.vmap: the ops between _add_batch_dim and _remove_batch_dim read
    # functorch batched tensors, which no kernel can read (transformers' Mamba scan on the
    # CPU: every fused run raised "Cannot access storage of BatchedTensorImpl", 2026-11-30)
    torch.manual_seed(2)
    a, b = torch.randn(5, 7), torch.randn(5, 7)

    def fn(a, b):
        combined = torch.vmap(lambda x, y: x * y + torch.sin(x) * 2.0)(a, b)
        return torch.relu(combined * 3.0 + 1.0) - 0.5

    compiled = compile_fused(fn)
    with torch.no_grad():
        assert_close(compiled(a, b), fn(a, b))
    report = fusebackend.last_report()
    assert report.graphs[-1].path == "fused", str(report)
    outside = [("mul_2", "add_1", "relu", "sub")]  # after the vmap: its ops are in no group
    assert [tuple(g.nodes) for g in report.groups] == outside, str(report)
    assert fusebackend.stats()["fallback_reasons"] == {}  # the fused run raised before


def test_a_linear_inside_vmap_is_no_matmul_group():
    # torch.func-style model ensembles: one linear per member, vmapped over the members
    torch.manual_seed(3)
    weights, x = torch.randn(3, 16, 8), torch.randn(1, 8)

    def fn(weights, x):
        return torch.vmap(lambda w: F.linear(x, w))(weights) + 1.0

    compiled = compile_fused(fn)
    with torch.no_grad():
        assert_close(compiled(weights, x), fn(weights, x))
    assert fusebackend.last_report().graphs[-1].rewrites.get("matmul_groups", []) == []
    assert fusebackend.stats()["fallback_reasons"] == {}


def test_operand_computed_from_the_group_is_rejected():
    torch.manual_seed(2)
    (table,) = _tables()
    ids = rand_ids(V, (2, 4))

    square = rand_table(D, D)

    def fn(ids, table, square):
        x = F.embedding(ids, table) * 2.0
        return x + x @ square  # the matmul reads the group and feeds it

    # matmul groups off: with them, `x @ square` is a group of its own (a [K, N] weight, the
    # residual add its epilogue) and no row group meets the matmul
    out, report = run_fused(fn, ids, table, square, options={"matmul_groups": False})
    assert single_group(report).nodes == ("embedding", "x")
    assert _has_reason(report, "computed from the group's own values"), str(report)
    assert _has_reason(report, "not an op in the table (matmul)"), str(report)
    assert_close(out, eager(fn, ids, table, square))


def test_lone_embedding_is_reported():
    torch.manual_seed(3)
    (table,) = _tables()
    ids = rand_ids(V, (2, 4))
    fn = lambda ids, table: F.embedding(ids, table)  # noqa: E731
    out, report = run_fused(fn, ids, table, expect_fused=False)
    assert report.groups == []
    assert _has_reason(report, "no fusible consumer"), str(report)
    assert_close(out, eager(fn, ids, table))


def test_non_elementwise_consumer_is_reported():
    torch.manual_seed(4)
    (table,) = _tables()
    proj = rand_table(D, 5)
    ids = rand_ids(V, (2, 4))

    def fn(ids, table, proj):
        return F.embedding(ids, table) @ proj

    out, report = run_fused(fn, ids, table, proj, expect_fused=False)
    assert _has_reason(report, "not an op in the table"), str(report)
    assert_close(out, eager(fn, ids, table, proj))


@pytest.mark.parametrize(
    "name, fn, reason",
    [
        (
            "div-rounding-mode",
            lambda x, ids: torch.div(x, 0.3, rounding_mode="floor"),
            "div with rounding_mode='floor' is not fused",
        ),
        (
            "pow-tensor-exponent",
            lambda x, ids: torch.pow(x, ids.unsqueeze(-1).float()),
            "pow with a tensor exponent",
        ),
        ("reflected-pow", lambda x, ids: 2.0**x, "pow with a tensor exponent"),
    ],
)
def test_unsupported_consumers_are_rejected_with_reasons(name, fn, reason):
    torch.manual_seed(5)
    (table,) = _tables()
    ids = rand_ids(V, (2, 4))

    def f(ids, table):
        return fn(F.embedding(ids, table), ids)

    out, report = run_fused(f, ids, table, expect_fused=False)
    assert report.groups == []
    assert _has_reason(report, reason), str(report)
    assert_close(out, eager(f, ids, table))


def test_rejected_consumer_stops_growth_but_keeps_the_group():
    # The group keeps the ops before the rejected one and hands its value to it.
    torch.manual_seed(6)
    (table,) = _tables()
    ids = rand_ids(V, (3, 4))

    def fn(ids, table):
        x = F.embedding(ids, table) * 2.0 + 1.0
        return torch.div(x, 0.7, rounding_mode="trunc")

    report = check(fn, ids, table)
    group = single_group(report)
    assert len(group.nodes) == 3
    assert _has_reason(report, "rounding_mode='trunc'"), str(report)


# --- extra outputs ----------------------------------------------------------------------


def test_value_used_outside_the_group_becomes_an_extra_output():
    torch.manual_seed(7)
    (table,) = _tables()
    ids = rand_ids(V, (3, 5))

    def fn(ids, table):
        x = F.embedding(ids, table) * 1.5
        y = torch.sigmoid(x) - 0.5
        return y, torch.logsumexp(x, dim=-1)  # x is read by logsumexp, outside the group

    report = check(fn, ids, table)
    group = single_group(report)
    assert len(group.outputs) == 2, str(report)
    assert len(group.nodes) == 4
    assert _has_reason(report, "is a reduction not fused yet (logsumexp)"), str(report)


def test_a_row_reduction_joins_the_group_of_its_lookups():
    # Both lookups, the row sum between them and the add: one row kernel (before row
    # programs this was two groups, the reduction outside both).
    torch.manual_seed(8)
    t1, t2 = _tables(2)
    ids = rand_ids(V, (2, 6))

    def fn(ids, t1, t2):
        a = F.embedding(ids, t1) * 2.0
        s = a.sum(-1, keepdim=True)
        return F.embedding(ids.flip(0), t2) + s

    report = check(fn, ids, t1, t2)
    group = single_group(report)
    assert len(group.lookups) == 2 and group.reductions == ("s",), str(report)


@pytest.mark.parametrize("alias", ["to-device", "same-dtype", "eval-dropout"])
def test_a_lookup_read_through_an_alias_is_gathered_by_the_group(alias):
    # GPT-2 adds its position rows as ``wpe(pos).to(inputs_embeds.device)``: a same-device
    # cast, which eager returns as its input. The group gathers that lookup too; a tensor
    # from outside reached through the same alias stays an operand, not a copy.
    torch.manual_seed(9)
    t1, t2 = _tables(2)
    ids = rand_ids(V, (2, 6))
    through = {
        "to-device": lambda x: x.to(t1.device),
        "same-dtype": lambda x: x.to(t1.dtype),
        "eval-dropout": lambda x: F.dropout(x, 0.1, training=False),
    }[alias]

    def fn(ids, t1, t2, outside):
        tokens = F.embedding(ids, t1)  # first: the group starts here, as GPT-2's does
        positions = through(F.embedding(ids.flip(1), t2))
        return F.layer_norm(tokens + positions, (t1.shape[1],)) + through(outside)

    outside = torch.randn(2, 6, t1.shape[1])
    report = check(fn, ids, t1, t2, outside)
    group = single_group(report)
    # inputs: both index tensors, both tables and `outside` (read as it is, no copy)
    assert len(group.lookups) == 2 and len(group.inputs) == 5, str(report)


def test_lookup_feeding_a_reduction_that_feeds_the_other_group():
    # emb1's value feeds a reduction that another group reads; emb1 must not join that
    # group later as an operand (it would make the fused node depend on itself).
    torch.manual_seed(9)
    t1, t2 = _tables(2)
    ids = rand_ids(V, (2, 3))

    def fn(ids, t1, t2):
        a = F.embedding(ids, t1)
        s = a.sum(-1, keepdim=True)
        b = F.embedding(ids, t2) * s
        return a + b

    expected = eager(fn, ids, t1, t2)
    out, report = run_fused(fn, ids, t1, t2)
    assert_close(out, expected)


def test_group_reading_its_own_row_reduction():
    # z = emb2 * amax(y): the reduction of y joins y's group, and emb2 joins as an operand.
    torch.manual_seed(20)
    t1, t2 = _tables(2)
    ids = rand_ids(V, (2, 3))

    def fn(ids, t1, t2):
        y = F.embedding(ids, t1) * 2.0
        s = y.amax(-1, keepdim=True)
        z = F.embedding(ids, t2) * s
        return y + z

    report = check(fn, ids, t1, t2)
    group = single_group(report)  # both lookups, the row max between them: one kernel
    assert len(group.nodes) == 6 and group.reductions == ("s",), str(report)


# --- mutation ---------------------------------------------------------------------------


def test_inplace_op_inside_the_group_span_is_not_fused_across():
    torch.manual_seed(10)
    (table,) = _tables()
    ids = rand_ids(V, (2, 4))
    x = rand_table(8, D).reshape(2, 4, D)

    def fn(ids, table, x):
        e = F.embedding(ids, table)
        x.mul_(2.0)
        return e + x

    x_eager = x.clone()
    expected = eager(fn, ids, table, x_eager)
    out, report = run_fused(fn, ids, table, x, expect_fused=False)
    assert report.groups == []
    assert _has_reason(report, "the in-place op", "lies inside the group"), str(report)
    assert_close(out, expected)
    assert_close(x, x_eager)  # mutated exactly once


def test_inplace_op_on_the_lookup_is_not_read_stale():
    # The mul_ (through a view, so passes/out_of_place.py leaves it in place) lies between the
    # lookup and the add: fusing the add would read e before the multiplication.
    torch.manual_seed(11)
    (table,) = _tables()
    ids = rand_ids(V, (2, 4))

    def fn(ids, table):
        e = F.embedding(ids, table)
        e[..., :3].mul_(2.0)
        return e + 1.0

    out, report = run_fused(fn, ids, table, expect_fused=False)
    assert_close(out, eager(fn, ids, table))
    assert _has_reason(report, "in-place op"), str(report)


def test_inplace_op_after_the_group_mutates_its_output():
    torch.manual_seed(12)
    (table,) = _tables()
    ids = rand_ids(V, (2, 4))

    def fn(ids, table):
        e = F.embedding(ids, table) * 2.0
        f = e - 0.5
        e[..., :3].add_(1.0)  # through a view: stays in place, after the group that makes e
        return e, f

    report = check(fn, ids, table)
    assert len(single_group(report).nodes) == 3
    left = [r for g in report.graphs for r in g.rewrites.get("in_place_left_alone", [])]
    assert any("shares its storage" in reason for reason in left), left


def test_mutated_float_input_is_still_mutated_and_reported():
    torch.manual_seed(13)
    (table,) = _tables()
    ids = rand_ids(V, (2, 4))
    x = rand_table(8, D).reshape(2, 4, D)

    def fn(ids, table, x):
        x.mul_(2.0)
        return F.embedding(ids, table) + x

    x_eager = x.clone()
    expected = eager(fn, ids, table, x_eager)
    out, report = run_fused(fn, ids, table, x)
    assert_close(out, expected)
    assert_close(x, x_eager)  # exactly once: x * 2, not x * 4
    assert len(report.graphs[0].mutated_inputs) == 1, str(report)
    assert "x" in report.graphs[0].mutated_inputs[0]
    assert "mutated inputs:" in str(report)


def test_mutated_index_input_is_reported():
    torch.manual_seed(14)
    (table,) = _tables()
    ids = rand_ids(V - 1, (2, 4))

    def fn(ids, table):
        ids.add_(1)
        return F.embedding(ids, table) * 3.0

    ids_eager = ids.clone()
    expected = eager(fn, ids_eager, table)
    out, report = run_fused(fn, ids, table)
    assert_close(out, expected)
    assert torch.equal(ids, ids_eager)
    assert len(report.graphs[0].mutated_inputs) == 1 and "ids" in report.graphs[0].mutated_inputs[0]


def test_table_mutated_before_and_after_the_group():
    torch.manual_seed(15)
    t1, t2 = _tables(2)
    ids = rand_ids(V, (2, 4))

    def fn(ids, t1, t2):
        t1.mul_(0.5)  # before: the group must read the new values
        y = F.embedding(ids, t1) + F.embedding(ids, t2)
        t2.add_(1.0)  # after: the group must have read the old values
        return y

    t1_eager, t2_eager = t1.clone(), t2.clone()
    expected = eager(fn, ids, t1_eager, t2_eager)
    out, report = run_fused(fn, ids, t1, t2)
    assert_close(out, expected)
    assert_close(t1, t1_eager)
    assert_close(t2, t2_eager)
    assert len(single_group(report).lookups) == 2
    assert len(report.graphs[0].mutated_inputs) == 2


@pytest.mark.parametrize(
    "cast",
    [
        pytest.param(lambda y: y.float(), id="float"),
        pytest.param(lambda y: y.to(torch.float32), id="to"),
        pytest.param(lambda y: y.type_as(y), id="type_as"),
    ],
)
def test_noop_cast_alias_mutated_later(cast):
    # On an fp32 tensor .float() / .to(float32) / .type_as(same dtype) return the tensor
    # itself, so an in-place op on the result also changes the original. A group that
    # writes the cast result to its own buffer breaks that.
    torch.manual_seed(21)
    (table,) = _tables()
    ids = rand_ids(V, (2, 3))

    def fn(ids, table):
        y = F.embedding(ids, table)
        z = cast(y)
        z.mul_(2.0)
        return y + 1.0

    out, report = run_fused(fn, ids, table, expect_fused=False)
    assert_close(out, eager(fn, ids, table))


# --- options ------------------------------------------------------------------------------


def test_fusion_false_gives_no_groups_and_correct_results():
    torch.manual_seed(16)
    t1, t2 = _tables(2)
    ids = rand_ids(V, (3, 4))

    def fn(ids, t1, t2):
        return F.gelu(F.embedding(ids, t1) + F.embedding(ids, t2)) * 2.0

    expected = eager(fn, ids, t1, t2)
    out, report = run_fused(fn, ids, t1, t2, options={"fusion": False}, expect_fused=False)
    assert report.groups == [] and report.rejections == []
    assert report.graphs[0].path == "unfused (option fusion=False)"
    assert [e["mode"] for e in report.graphs[0].runtime_modes()] == ["eager"]
    assert_close(out, expected)


def test_explain_passes_options_through():
    torch.manual_seed(17)
    (table,) = _tables()
    ids = rand_ids(V, (2, 2))
    fn = lambda ids, t: F.embedding(ids, t) * 2.0  # noqa: E731
    with torch.no_grad():
        assert fusebackend.explain(fn, ids, table, options={"fusion": False}).groups == []
        torch._dynamo.reset()
        assert len(fusebackend.explain(fn, ids, table).groups) == 1


@pytest.mark.parametrize(
    "options, match",
    [
        ({"fuse": False}, r"unknown infinifuse option\(s\) \['fuse'\]"),
        ({"index_checks": "no"}, "'index_checks' must be a bool"),
        ({"batch_buckets": [4, 2]}, "'batch_buckets' must be a strictly increasing"),
    ],
)
def test_bad_options_name_the_option(options, match):
    compiled = compile_fused(lambda ids, t: F.embedding(ids, t) * 2.0, options)
    with pytest.raises(Exception, match=match):
        with torch.no_grad():
            compiled(rand_ids(V, (2,)), rand_table(V, D))


def test_index_checks_false_still_fuses_and_is_correct():
    torch.manual_seed(18)
    (table,) = _tables()
    ids = rand_ids(V, (2, 5))
    report = check(
        lambda ids, t: F.embedding(ids, t) - 1.0, ids, table, options={"index_checks": False}
    )
    assert "@triton.jit(debug=False," in single_group(report).source


def test_out_of_range_index_raises_index_error_through_the_backend():
    (table,) = _tables()
    ids = rand_ids(V, (2, 5))
    compiled = compile_fused(lambda ids, t: F.embedding(ids, t) * 2.0)
    with torch.no_grad():
        compiled(ids, table)
        ids[1, 1] = V
        with pytest.raises(IndexError):
            compiled(ids, table)


def test_index_mutated_between_two_lookups_of_it():
    # The second lookup reads the incremented ids; it must not join the first group (which
    # runs before the add_), but it can start a group of its own after it.
    torch.manual_seed(19)
    (table,) = _tables()
    ids = rand_ids(V - 1, (2, 4))

    def fn(ids, table):
        y = F.embedding(ids, table) * 2.0
        ids.add_(1)
        return y + F.embedding(ids, table)

    ids_eager = ids.clone()
    expected = eager(fn, ids_eager, table)
    out, report = run_fused(fn, ids, table)
    assert_close(out, expected)
    assert torch.equal(ids, ids_eager)
    assert len(report.groups) == 2, str(report)
    assert _has_reason(report, "the in-place op", "lies inside the group"), str(report)


# --- regressions found on transformers models -------------------------------------------


def test_bitwise_and_or_are_not_mistaken_for_in_place_ops():
    # Llama's causal mask has `result & to`: operator.and_ ends in "_" like an in-place op
    torch.manual_seed(30)
    (table,) = _tables()
    ids = rand_ids(V, (2, 5))
    mask_a = torch.rand(2, 5, 1) > 0.3
    mask_b = torch.rand(2, 5, 1) > 0.3

    def fn(ids, table, mask_a, mask_b):
        x = F.embedding(ids, table) * 2.0
        keep = (mask_a & mask_b) | (mask_a ^ mask_b)
        return x + 1.0, keep

    out, report = run_fused(fn, ids, table, mask_a, mask_b)
    (group,) = [g for g in report.groups if g.lookups]
    assert len(group.nodes) == 3, str(report)  # (the mask's & and | are a group of their own)
    assert not _has_reason(report, "in-place"), str(report)
    assert_close(out, eager(fn, ids, table, mask_a, mask_b))


def test_same_dtype_cast_is_an_alias_and_fuses_beside_a_mutation():
    # `inputs_embeds.to(torch.float32)` on an fp32 model, in a graph that also updates a
    # cache in place: the cast returns its input in eager, and the group keeps it so
    torch.manual_seed(31)
    (table,) = _tables()
    ids = rand_ids(V, (2, 5))
    cache = torch.randn(2, 5)

    def fn(ids, table, cache):
        x = F.embedding(ids, table)
        h = x.to(torch.float32)
        y = h * 0.5 + 1.0
        cache.add_(1.0)
        return x, h, y

    eager_cache = cache.clone()
    expected = eager(fn, ids, table, eager_cache)
    out, report = run_fused(fn, ids, table, cache)
    group = single_group(report)
    assert "h" in group.nodes and "y" in group.nodes, str(report)
    assert_close(out, expected)
    assert_close(cache, eager_cache)  # the mutation happened once


def test_a_consumer_is_never_claimed_by_two_groups():
    # GPT-2: `a + b.to(a.device)` where a and b are lookups; b's cast is an alias
    torch.manual_seed(32)
    wte, wpe = _tables(2)
    ids = rand_ids(V, (1, 8))

    def fn(ids, wte, wpe):
        pos = torch.arange(ids.shape[1])[None]
        a = F.embedding(ids, wte)
        b = F.embedding(pos, wpe)
        return a + b.to(a.device)

    out, report = run_fused(fn, ids, wte, wpe)
    owners = [g.name for g in report.groups for node in g.nodes if node == "add"]
    assert len(owners) == 1, str(report)
    assert_close(out, eager(fn, ids, wte, wpe))


# --- reductions over several dims: not a row reduction


def _centred_mean(x, w):
    y = x * w
    return y - y.mean(dim=(-1, -2), keepdim=True)


def _scaled_sum(x, w):
    y = x * w
    return y / y.sum(dim=(2, 0), keepdim=True)


def _minus_amax(x, w):
    y = x + w
    return y - y.amax(dim=[-1, 1], keepdim=True)


@pytest.mark.parametrize("fn", [_centred_mean, _scaled_sum, _minus_amax], ids=lambda f: f.__name__)
def test_a_reduction_over_several_dims_starting_with_the_last_equals_eager(fn):
    """``mean(dim=(-1, -2))`` reduces two dims: a row kernel reduces only the last, so the
    chain must not be fused around it as if it were a row reduction."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 5, 7, generator=g), torch.randn(7, generator=g) + 2.0
    actual, _ = run_fused(fn, x, w, expect_fused=False)
    assert_close(actual, eager(fn, x, w))
