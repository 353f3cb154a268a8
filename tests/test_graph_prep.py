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


# ------------------------------------------------------------------ constants (constants.py)


def _mask_model(ids, table):
    # As Mistral/Gemma2 build their masks: constants from Python values on the input's device.
    zero = torch.tensor(0.0, device=ids.device, dtype=table.dtype)
    big = torch.full((), -1e4, device=ids.device, dtype=table.dtype)
    steps = torch.arange(5, device=ids.device) * 2 + 1
    x = torch.nn.functional.embedding(ids, table) * 2.0
    return torch.where(x > zero, x, big) + steps[: x.shape[-1]].to(x.dtype)


def test_constants_are_built_once_and_leave_the_graph():
    g = torch.Generator().manual_seed(3)
    ids, table = rand_ids(9, (2, 3), g=g), rand_table(9, 5, g=g)
    compiled = torch.compile(_mask_model, backend="infinifuse", fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            assert_close(compiled(ids, table), _mask_model(ids, table))
    graph = fusebackend.last_report().graphs[0]
    assert len(graph.constants) >= 4, graph.constants  # tensor, full, arange, mul, add, ...
    gm = graph.runtime._unfused  # the graph the runtime runs
    factories = {torch.tensor, torch.full, torch.arange, torch.scalar_tensor}
    assert not [n for n in gm.graph.nodes if n.target in factories], gm.code
    assert any(n.op == "get_attr" for n in gm.graph.nodes), gm.code
    assert "constants built once" in str(fusebackend.last_report())


def test_returned_or_mutated_constants_are_not_shared_between_calls():
    def fn(x):
        fresh = torch.zeros(3)  # returned: each call must get its own tensor
        acc = torch.ones(3)  # mutated in place inside the graph
        acc.add_(x)
        return fresh, acc * 2

    compiled = torch.compile(fn, backend="infinifuse", fullgraph=True)
    x = torch.randn(3)
    with torch.no_grad():
        first_fresh, first = compiled(x)
        first_fresh.add_(5)  # the caller writes into what it got
        second_fresh, second = compiled(x)
    assert_close(second_fresh, torch.zeros(3))
    assert_close(second, first)
    assert fusebackend.last_report().graphs[0].constants == []


def test_symbolic_and_random_values_are_not_folded():
    def fn(x):
        noise = torch.rand(3)
        ramp = torch.arange(x.shape[0])
        return x + ramp, noise

    compiled = torch.compile(fn, backend="infinifuse", dynamic=True)
    with torch.no_grad():
        a, n1 = compiled(torch.zeros(4))
        b, n2 = compiled(torch.zeros(6))
    assert_close(a, torch.arange(4.0)) and assert_close(b, torch.arange(6.0))
    assert not torch.equal(n1, n2)
    assert fusebackend.last_report().graphs[0].constants == []


# ------------------------------------------------------------ host work (host_inputs.py)


def _fake_cuda(mode, shape, dtype=torch.float32):
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device("cuda", 0))


def test_host_nodes_are_cpu_work_on_cpu_inputs_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusebackend.passes.host_inputs import host_nodes

    mode = FakeTensorMode()
    with mode:
        counter_v = torch.zeros((), dtype=torch.int64)
        x_v = _fake_cuda(mode, (4,))
    graph = torch.fx.Graph()
    counter, x = graph.placeholder("counter"), graph.placeholder("x")
    nodes = {}

    def add(name, op, target, args, value):
        node = getattr(graph, op)(target, args)
        node.name = name
        node.meta["example_value"] = value
        nodes[name] = node
        return node

    with mode:
        pos_v = counter_v + 1
        posc_v = _fake_cuda(mode, (), torch.int64)
        y_v = x_v * posc_v
        z_v = torch.empty(4)  # y.cpu(): a device -> host copy
    counter.meta["example_value"], x.meta["example_value"] = counter_v, x_v
    pos = add("pos", "call_function", operator.add, (counter, 1), pos_v)
    add("bump", "call_method", "add_", (counter, 1), counter_v)
    posc = add("posc", "call_method", "to", (pos, "cuda"), posc_v)
    y = add("y", "call_function", operator.mul, (x, posc), y_v)
    z = add("z", "call_method", "cpu", (y,), z_v)
    w = add("w", "call_function", operator.add, (z, 1), z_v)
    after = add("after", "call_function", operator.add, (counter, 2), pos_v)
    graph.output((y, w, after))
    assert [n.name for n in host_nodes(graph, lambda v: v.device.type == "cpu")] == [
        "pos",
        "bump",
        "after",
    ]


def _counter_model(counter, x):
    before = counter.view(1)  # an alias read by the "device" part before the host write
    y = x * before.to(x.dtype)
    pos = counter + 2
    counter.add_(x.shape[-1])
    return y * pos.to(x.dtype), pos, counter * 1


def test_split_graph_runs_host_part_then_device_part_like_eager():
    """The split on the CPU, with int64 values playing the host and floats the device."""
    from fusebackend.passes.host_inputs import split_host

    counter = torch.tensor(3)
    x = torch.randn(2, 5)
    gm = _graph_of(_counter_model, counter.clone(), x)
    split = split_host(gm, lambda v: v.dtype == torch.int64)
    assert split is not None
    assert split.nodes == ["before", "pos", "add_", "mul_2"], split.nodes
    device_ops = {n.target for n in split.device.graph.nodes if n.op != "placeholder"}
    assert "add_" not in device_ops  # the host write happens once, in the host part
    run = split.bind(split.device)
    expected_counter = counter.clone()
    for _ in range(3):
        out = run(counter, x)
        expected = _counter_model(expected_counter, x)
        assert_close(list(out), list(expected))
        assert_close(counter, expected_counter)


def test_split_needs_both_parts():
    from fusebackend.passes.host_inputs import split_host

    gm = _graph_of(lambda c: c + 1, torch.tensor(1))
    assert split_host(gm, lambda v: True) is None
    assert split_host(gm, lambda v: False) is None
