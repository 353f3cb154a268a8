"""Graph preparation: mutated inputs through every alias (passes/mutations.py).

Each alias test compiles a function that looks up an embedding (so there is a fused graph
and a new signature runs both the fused and the unfused graph for validation) and advances
a counter through one kind of alias. Before storage identity, a missed alias made the first
call of a signature apply the mutation twice (once per graph), as transformers' StaticCache
did with ``c = counter.to(counter.device); c.add_(16)``.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

import fusebackend
from fusebackend.passes.mutations import mutated_placeholders
from tests.helpers import assert_close, rand_ids, rand_table


def _via_to_same_device(c):
    a = c.to(c.device)
    a.add_(3)


def _via_to_same_dtype(c):
    a = c.to(torch.float32)
    a.add_(3)


def _via_detach(c):
    a = c.detach()
    a.add_(3)


def _via_view(c):
    a = c.view(-1)
    a.add_(3)


def _via_slice(c):
    a = c[1:]
    a.add_(3)


def _via_contiguous(c):
    a = c.contiguous()
    a.mul_(2)


def _via_copy_into_slice(c):
    c[1:].copy_(c[:-1] + 1)


def _via_setitem_slice(c):
    a = c.detach()
    a[1:] = a[:-1] + 1


def _via_out(c):
    a = c.detach()
    torch.add(a, 3, out=a)


def _via_chain(c):
    a = c.to(c.device).detach()[0:]
    a.sub_(1)


ALIASES = {
    "to_same_device": _via_to_same_device,
    "to_same_dtype": _via_to_same_dtype,
    "detach": _via_detach,
    "view": _via_view,
    "slice": _via_slice,
    "contiguous": _via_contiguous,
    "copy_into_slice": _via_copy_into_slice,
    "setitem_slice": _via_setitem_slice,
    "out": _via_out,
    "chain": _via_chain,
}


@pytest.mark.parametrize("alias", list(ALIASES))
def test_counter_mutated_through_an_alias_advances_once_per_call(alias):
    mutate = ALIASES[alias]

    def step(ids, table, counter):
        mutate(counter)
        return torch.nn.functional.embedding(ids, table) * 2.0 + 1.0

    g = torch.Generator().manual_seed(0)
    table = rand_table(11, 5, g=g)
    ids = rand_ids(11, (3,), g=g)
    counter = torch.rand(4, generator=g) + 1.0
    expected_counter = counter.clone()
    compiled = torch.compile(step, backend="infinifuse", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(ids, table, counter)
            expected = step(ids, table, expected_counter)
            assert_close(out, expected)
            assert_close(counter, expected_counter)
    report = fusebackend.last_report()
    assert report.graphs[0].path == "fused", str(report)
    assert report.graphs[0].mutated_inputs == ["l_counter_"], str(report)


def _graph_of(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def test_mutated_placeholders_sees_aliases_and_not_copies():
    def fn(c, x, y):
        c.to(c.device).add_(1)  # alias: mutates c
        y.to(torch.float64).add_(1)  # a new tensor (dtype change): y is not mutated
        x.clone().add_(1)  # a copy: x is not mutated
        return x + 1

    gm = _graph_of(fn, torch.zeros(3), torch.zeros(3), torch.zeros(3))
    assert [p.name for p in mutated_placeholders(gm.graph)] == ["l_c_"]


def test_mutated_placeholders_without_example_values_follow_views_by_name():
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    view = graph.call_method("view", (a, -1))
    graph.call_method("add_", (view, 1))
    part = graph.call_function(operator.getitem, (b, slice(1, None)))
    graph.output(part)
    assert [p.name for p in mutated_placeholders(graph)] == ["a"]
