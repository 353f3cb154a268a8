"""Values computed twice from the same operands, computed once (passes/common_values.py).

Each test compares with eager and reads the report's ``values_shared``: a merge proves the
pass ran, a refusal that it kept apart what must stay apart.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, eager, run_fused

import fusebackend


def _shared() -> list[str]:
    return fusebackend.last_report().graphs[-1].rewrites.get("values_shared", [])


def gptj_rotary_tables(q, k, sin, cos):
    """GPT-J's attention repeats the tables once for the query and once for the key."""
    q = q * torch.repeat_interleave(cos, 2, dim=-1) + q.flip(-1) * torch.repeat_interleave(
        sin, 2, dim=-1
    )
    k = k * torch.repeat_interleave(cos, 2, dim=-1) + k.flip(-1) * torch.repeat_interleave(
        sin, 2, dim=-1
    )
    return q, k


def test_the_tables_repeated_twice_are_repeated_once():
    torch.manual_seed(0)
    q, k = torch.randn(2, 7, 3, 10), torch.randn(2, 7, 3, 10)
    sin, cos = torch.randn(1, 7, 1, 5), torch.randn(1, 7, 1, 5)
    out, report = run_fused(gptj_rotary_tables, q, k, sin, cos)
    assert_close(out, eager(gptj_rotary_tables, q, k, sin, cos))
    merged = _shared()
    assert len(merged) == 2, report  # the key's cos and sin repeats
    launches = report.graphs[-1].rewrites
    assert all(name not in str(g.nodes) for g in report.groups for name in merged), launches


def test_a_value_whose_operand_is_written_between_is_computed_again():
    # x.cos() before and after x is doubled in place are two values.
    def fn(x):
        before = x.cos() * 3
        x.mul_(2)
        after = x.cos() * 3
        return before + after

    x = torch.randn(5, 9)
    expected = eager(fn, x.clone())
    out, _ = run_fused(fn, x)
    assert_close(out, expected)
    assert _shared() == []


def test_two_equal_outputs_stay_two_tensors():
    def fn(x):
        return x.sin() + 1, x.sin() + 1

    x = torch.randn(4, 6)
    (a, b), _ = run_fused(fn, x)
    assert_close(a, eager(fn, x)[0])
    assert a.data_ptr() != b.data_ptr()  # eager gives two: writing one leaves the other
    assert not any(name.startswith("add") for name in _shared()), _shared()


def test_random_values_are_drawn_twice():
    def fn(x):
        return (x + torch.rand_like(x)) - (x + torch.rand_like(x)) * 1.0

    x = torch.randn(64, 33)
    out, _ = run_fused(fn, x, expect_fused=False)
    assert out.abs().max() > 0  # merged, the two draws would cancel
    assert not any("rand" in name for name in _shared()), _shared()


def test_a_collective_issued_twice_is_issued_twice():
    # Each rank must issue every collective it traced; the op itself is looked up by its
    # namespace (no process group is needed to build the graph).
    from fusebackend.passes.common_values import share_equal_values

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    reduce = torch.ops._c10d_functional.all_reduce.default
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.randn(4)
    outs = []
    for _ in range(2):
        node = graph.call_function(reduce, (x, "sum", "0"))
        node.meta["example_value"] = torch.randn(4)
        outs.append(graph.call_function(torch.neg, (node,)))
        outs[-1].meta["example_value"] = torch.randn(4)
    total = graph.call_function(torch.add, tuple(outs))
    total.meta["example_value"] = torch.randn(4)
    graph.output(total)
    assert share_equal_values(graph) == []
    assert sum(n.target is reduce for n in graph.nodes) == 2
