"""Graph preparation: mutated inputs through every alias (passes/mutations.py).

Each alias test compiles a function that looks up an embedding (so there is a fused graph
and a new signature runs both the fused and the unfused graph for validation) and advances
a counter through one kind of alias. Before storage identity, a missed alias made the first
call of a signature apply the mutation twice (once per graph), as transformers' StaticCache
did with ``c = counter.to(counter.device); c.add_(16)``.
"""

from __future__ import annotations

import inspect
import operator

import pytest
import torch
import torch.fx
import torch.utils._pytree as pytree

import fusebackend
from fusebackend.passes.batching import batch_scalar_updates, batch_state_sums
from fusebackend.passes.constants import fold_constants, fold_list_indices
from fusebackend.passes.graph import example_value, is_mutation
from fusebackend.passes.mutations import mutated_placeholders, written_args
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


def _via_foreach_list(c):  # the written tensor is inside a list argument
    torch._foreach_add_([c[:2], c[2:]], 3.0)


def _via_aten_overload(c):  # an OpOverload: its name ends in ".Tensor", not "_"
    torch.ops.aten.add_.Tensor(c, 3.0)


def _via_aten_packet(c):
    torch.ops.aten.mul_(c.detach(), 2.0)


def _via_inplace_by_position(c):  # F.threshold(x, threshold, value, inplace)
    torch.nn.functional.threshold(c, 1.5, -1.0, True)


def _via_out_tuple(c):
    torch.sort(c.detach() * -1, out=(c, torch.empty(4, dtype=torch.long)))


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
    "foreach_list": _via_foreach_list,
    "aten_overload": _via_aten_overload,
    "aten_packet": _via_aten_packet,
    "inplace_by_position": _via_inplace_by_position,
    "out_tuple": _via_out_tuple,
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


def test_written_args_of_every_kind_of_write():
    def fn(x, a, b, v, i, c, d, e):
        torch.sort(x, out=(v, i))  # out= tuple
        torch._foreach_mul_([a, b], 2.0)  # list first argument
        torch.nn.functional.relu(c, True)  # inplace=True by position
        torch.ops.aten.index_put_.default(d, (torch.tensor([0]),), torch.tensor(5.0))
        e[1] = 7.0  # setitem
        return x + 1  # pure

    args = [torch.randn(5), torch.randn(3), torch.randn(3), torch.empty(5)]
    args += [torch.empty(5, dtype=torch.long), torch.randn(3), torch.randn(3), torch.randn(3)]
    gm = _graph_of(fn, *args)
    written = {n.name: [a.name for a in written_args(n)] for n in gm.graph.nodes if written_args(n)}
    assert sorted(written.values()) == [
        ["l_a_", "l_b_"], ["l_c_"], ["l_d_"], ["l_e_"], ["l_v_", "l_i_"]
    ], written  # fmt: skip
    for node in gm.graph.nodes:
        assert is_mutation(node) == bool(written_args(node)), node.format_node()
    names = [p.name for p in mutated_placeholders(gm.graph)]
    assert names == ["l_v_", "l_i_", "l_a_", "l_b_", "l_c_", "l_d_", "l_e_"], names


def test_mutated_placeholders_without_example_values_count_every_source():
    # Hand-built: no example values, so a write counts for every input it is computed from.
    graph = torch.fx.Graph()
    a, b, c = graph.placeholder("a"), graph.placeholder("b"), graph.placeholder("c")
    view = graph.call_method("view", (a, -1))
    graph.call_method("add_", (view, 1))
    total = graph.call_function(operator.add, (b, 1))
    graph.call_function(torch._foreach_mul_, ([total],), {})
    graph.output(graph.call_function(operator.getitem, (c, slice(1, None))))
    assert [p.name for p in mutated_placeholders(graph)] == ["a", "b"]


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


def test_a_constant_written_through_a_list_argument_is_not_folded():
    def fn(x):
        acc = torch.zeros(3)
        torch._foreach_add_([acc], 1.0)  # once folded, each call added 1 to one buffer
        return x + acc

    compiled = torch.compile(fn, backend="infinifuse", fullgraph=True)
    x = torch.randn(3)
    with torch.no_grad():
        for _ in range(3):
            assert_close(compiled(x), x + 1)
    assert fusebackend.last_report().graphs[0].constants == []


def _binomial(x):
    return x + torch.binomial(torch.full((64,), 100.0), torch.full((64,), 0.5))


def _standard_gamma(x):
    return x + torch._standard_gamma(torch.full((64,), 2.0))


def _sample_dirichlet(x):
    return x + torch._sample_dirichlet(torch.full((64,), 2.0))


def _native_dropout(x):
    return x + torch.native_dropout(torch.ones(64), 0.5, True)[0]


@pytest.mark.parametrize("fn", [_binomial, _standard_gamma, _sample_dirichlet, _native_dropout])
def test_random_ops_outside_the_name_list_are_not_folded(fn):
    compiled = torch.compile(fn, backend="infinifuse", fullgraph=True)
    x = torch.zeros(64)
    with torch.no_grad():
        torch.manual_seed(5)
        first = compiled(x)  # compiles: evaluating the op must not draw from the generator
        second = compiled(x)
        torch.manual_seed(5)
        expected_first, expected_second = fn(x), fn(x)
    assert_close(first, expected_first)
    assert_close(second, expected_second)
    assert not torch.equal(first, second)
    constants = fusebackend.last_report().graphs[0].constants
    assert {name.rstrip("_0123456789") for name in constants} <= {"full", "ones"}, constants


@torch.library.custom_op("fusebackend_tests::noisy", mutates_args=())
def _noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand(x.shape)  # random, but neither named nor tagged as such


@_noisy.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_op_that_moves_the_generator_is_not_folded_and_draws_nothing_at_compile():
    def fn(x):
        return x + _noisy(torch.zeros(16))

    compiled = torch.compile(fn, backend="infinifuse", fullgraph=True)
    x = torch.zeros(16)
    with torch.no_grad():
        torch.manual_seed(9)
        first = compiled(x)
        second = compiled(x)
        torch.manual_seed(9)
        expected_first, expected_second = fn(x), fn(x)
    assert_close(first, expected_first)
    assert_close(second, expected_second)
    assert fusebackend.last_report().graphs[0].constants == ["zeros"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_constant_product_under_autocast_keeps_the_autocast_dtype(dtype):
    # Folding evaluates the product outside the autocast region, in fp32 (5.72 here), where
    # eager rounds it to the autocast dtype (5.71875 in bf16): the value must not be folded
    def fn(x):
        with torch.autocast("cpu", dtype=dtype):
            m = torch.full((2, 3), 1.1) @ torch.full((3, 2), 1.7333)
        return x + m

    x = torch.randn(2, 2)
    compiled = torch.compile(fn, backend="infinifuse", fullgraph=True)
    with torch.no_grad():
        expected = fn(x)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    assert fusebackend.last_report().graphs[0].constants == ["full", "full_1"]  # not m


def test_folded_dtype_shape_and_layout_changes_equal_eager():
    # Casts, views, a transpose and an expand of constants fold into buffers equal to what
    # eager computes at each call
    def fn(x):
        ramp = torch.arange(6).to(torch.float16).reshape(2, 3).t() * 0.3
        scale = torch.tensor([1.5, -2.25]).to(torch.bfloat16).float().expand(3, 2)
        return x * ramp.type_as(x) + scale, ramp

    x = torch.randn(3, 2)
    compiled = torch.compile(fn, backend="infinifuse", fullgraph=True)
    with torch.no_grad():
        expected = fn(x)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    constants = fusebackend.last_report().graphs[0].constants
    assert {"to", "reshape", "t", "to_1", "float_1", "scale"} <= set(constants), constants
    assert "ramp" not in constants, constants  # returned: each call gets its own tensor


def test_symbolic_and_random_values_are_not_folded():
    def fn(x):
        noise = torch.rand(3)
        ramp = torch.arange(x.shape[0])
        return x + ramp, noise

    compiled = torch.compile(fn, backend="infinifuse", dynamic=True)
    x4, x6 = torch.randn(4), torch.randn(6)
    with torch.no_grad():
        a, n1 = compiled(x4)
        b, n2 = compiled(x6)
    assert_close(a, x4 + torch.arange(4.0))
    assert_close(b, x6 + torch.arange(6.0))
    assert not torch.equal(n1, n2)
    assert fusebackend.last_report().graphs[0].constants == []


# ------------------------------------------------------------ host work (host_inputs.py)


def _fake_cuda(mode, shape, dtype=torch.float32):
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device("cuda", 0))


def _is_list(x):
    return isinstance(x, list)


def test_list_indices_become_index_tensors_of_the_indexed_device():
    def falcon_split(qkv, y):
        q, k = qkv[..., :-2, :], qkv[..., [-2], :]
        y[[0, 2]] = 1.0
        return q * 2, k + 1, y * 3, qkv[[1, -1]]

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    qkv, y = torch.randn(2, 5, 6, 3), torch.randn(4, 3)
    torch._dynamo.reset()
    torch.compile(falcon_split, backend=keep)(qkv, y.clone())
    (gm,) = graphs
    assert len(fold_list_indices(gm)) == 3
    indexing = [n for n in gm.graph.nodes if n.target in (operator.getitem, operator.setitem)]
    parts = [p for n in indexing for p in pytree.tree_leaves(n.args[1], is_leaf=_is_list)]
    assert not any(isinstance(p, list) for p in parts), parts
    got_y, want_y = y.clone(), y.clone()
    got = gm(qkv, got_y)
    want = falcon_split(qkv, want_y)
    for a, e in zip([*got, got_y], [*want, want_y], strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    torch._dynamo.reset()  # and through the backend, where explain lists them
    torch.compile(falcon_split, backend="infinifuse")(qkv, y.clone())
    assert "list indices as index tensors on the device: " in str(fusebackend.last_report())


def _dynamo_graph(fn, *args):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=keep)(*args)
    (gm,) = graphs
    return gm


def _layers_with_counters(x, c0, c1, c2, c3):
    out = x
    for c in (c0, c1, c2):  # a StaticCache layer: read its counter, then advance it
        out = out + c
        c.add_(1)
    c3.to(c3.device).add_(2)  # a lone update of another number: left alone
    return out * 2


def test_scalar_updates_batch_into_one_foreach_and_run_once():
    counters = [torch.tensor(5), torch.tensor(7), torch.tensor(9), torch.tensor(1)]
    x = torch.randn(3)
    gm = _dynamo_graph(_layers_with_counters, x, *[c.clone() for c in counters])
    assert len(batch_scalar_updates(gm, _placeholders(gm))) == 3
    foreach = [n for n in gm.graph.nodes if n.target is torch._foreach_add_]
    assert len(foreach) == 1 and len(foreach[0].args[0]) == 3
    got, want = [c.clone() for c in counters], [c.clone() for c in counters]
    assert_close(gm(x, *got)[0], _layers_with_counters(x, *want))
    assert got == want  # each advanced once, the lone one too


def _read_after_update(x, c0, c1):
    y = x + c0
    c0.add_(1)
    view = c1.view(1)
    c1.add_(1)
    return y + c0 + view  # c0 read after its update; c1 read through an alias after its update


def test_an_update_read_later_through_itself_or_an_alias_stays_in_place():
    c0, c1, x = torch.tensor(2.0), torch.tensor(3.0), torch.randn(4)
    gm = _dynamo_graph(_read_after_update, x, c0.clone(), c1.clone())
    assert batch_scalar_updates(gm, _placeholders(gm)) == []
    got, want = [c0.clone(), c1.clone()], [c0.clone(), c1.clone()]
    assert_close(gm(x, *got)[0], _read_after_update(x, *want))


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def test_batched_updates_are_reported_and_exactly_once_through_the_backend():
    counters = [torch.tensor(5), torch.tensor(7), torch.tensor(9), torch.tensor(1)]
    for c in counters:
        torch._dynamo.mark_static_address(c)  # as StaticCache marks its counters
    x = torch.randn(3)
    torch._dynamo.reset()
    compiled = torch.compile(_layers_with_counters, backend="infinifuse")
    eager_counters = [c.clone() for c in counters]
    for _ in range(3):
        assert_close(compiled(x, *counters), _layers_with_counters(x, *eager_counters))
        assert counters == eager_counters
    report = fusebackend.last_report().graphs[-1]
    assert len(report.batched_updates) == 3, report.batched_updates
    assert "batched into foreach ops" in str(fusebackend.last_report())


def _positions_per_layer(x, c0, c1, c2):
    out = x
    for c in (c0, c1, c2):  # StaticCache: each layer reads its counter, then advances it
        position = torch.arange(1) + c
        out = out * 2 + position
        c.add_(1)
    return out


def _sum_after_a_write(x, c0, c1):
    p0 = torch.arange(1) + c0
    c1.mul_(2)  # p1 reads c1 after this write: it keeps its place
    p1 = torch.arange(1) + c1
    return x + p0 + p1


def _fused_graph_of_last_compile(monkeypatch):
    graphs = []
    real = fusebackend.prepare.batch_state_sums

    def keep(gm, static_address, device):
        names = real(gm, static_address, device)
        graphs.append(gm)
        return names

    monkeypatch.setattr(fusebackend.prepare, "batch_state_sums", keep)
    return graphs


def _constant_read_before_the_sums(x, c0, c1):
    position = torch.arange(1)
    y = x + position  # an earlier reader of the constant the sums share
    return y, position + c0, position + c1


CASES = {
    "layers": (_positions_per_layer, 3, 1),
    "write between": (_sum_after_a_write, 2, 0),
    "constant read earlier": (_constant_read_before_the_sums, 2, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sums_of_state_batch_into_one_foreach_and_keep_values(monkeypatch, case):
    fn, n, foreach_ops = CASES[case]
    counters = [torch.tensor(4 + k) for k in range(n)]
    for c in counters:
        torch._dynamo.mark_static_address(c)
    graphs = _fused_graph_of_last_compile(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="infinifuse")
    x, eager_counters = torch.randn(3), [c.clone() for c in counters]
    for _ in range(3):
        assert_close(compiled(x, *counters), fn(x, *eager_counters))
        assert counters == eager_counters
    (gm,) = graphs
    foreach = [node for node in gm.graph.nodes if node.target is torch._foreach_add]
    assert len(foreach) == foreach_ops  # "write between": one sum on each side, no batch
    if case == "layers":
        assert len(foreach[0].args[0]) == 3
        batched = fusebackend.last_report().graphs[-1].batched_updates
        assert sum(name.startswith("position") for name in batched) == 3, batched


def test_sums_on_the_cpu_beside_cuda_work_stay_host_work():
    # a CPU counter of a CUDA graph is host work (split_host); a batched foreach would land
    # in the captured part
    counters = [torch.tensor(4), torch.tensor(5), torch.tensor(6)]
    gm = _dynamo_graph(_positions_per_layer, torch.randn(3), *counters)
    fold_constants(gm)  # the aranges become get_attr constants, as in the backend
    assert batch_state_sums(gm, _placeholders(gm), torch.device("cuda", 0)) == []
    assert len(batch_state_sums(gm, _placeholders(gm), torch.device("cpu"))) == 3


def _update_then_read_other(c0, c1, d, x):
    c0.add_(1)
    y = x + c1
    d.add_(1)
    return y * 2


def test_updates_of_unmarked_inputs_stay_in_place_as_inputs_may_alias_later():
    # Traced with distinct inputs, then called with c0 and c1 views of one buffer: Dynamo
    # does not recompile, and c1 must see c0's update (a batched write would lose it).
    torch._dynamo.reset()
    compiled = torch.compile(_update_then_read_other, backend="infinifuse")
    x = torch.randn(4)
    compiled(torch.zeros(1), torch.zeros(1), torch.zeros(1), x)
    assert fusebackend.last_report().graphs[-1].batched_updates == []
    buf, want_buf = torch.zeros(2), torch.zeros(2)
    got = compiled(buf[0:1], buf[0:1], torch.zeros(1), x)
    want = _update_then_read_other(want_buf[0:1], want_buf[0:1], torch.zeros(1), x)
    assert_close(got, want)
    assert_close(buf, want_buf)


def test_minus_zero_and_zero_updates_are_not_one_batch():
    def fn(a, b, x):
        a.add_(0)
        b.add_(-0.0)
        return x * 2

    a, b = torch.tensor(-0.0), torch.tensor(-0.0)
    gm = _dynamo_graph(fn, a.clone(), b.clone(), torch.randn(2))
    assert batch_scalar_updates(gm, _placeholders(gm)) == []


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


def test_numbers_only_returned_run_on_the_host_and_leave_the_device_part():
    """transformers' sliding-window cache layers pass ``cumulative_length_int`` and get
    ``+ 1`` back for the next step. Left in the device part, the int is an input whose value
    keys a new capture on every decode step; computed on the host, the device part never
    sees it."""
    from fusebackend.passes.host_inputs import split_host

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x, n):
        return x * 2, n + 1

    compiled = torch.compile(step, backend=capture, dynamic=True, fullgraph=True)
    compiled(torch.randn(3), 5)
    compiled(torch.randn(3), 6)  # the second call makes n a symbolic input
    gm = graphs[-1]
    split = split_host(gm, lambda v: v.device.type == "cpu" and v.dtype == torch.int64)
    assert split is not None and split.nodes == ["add"], split and split.nodes
    device_inputs = [n.name for n in split.device.graph.nodes if n.op == "placeholder"]
    assert device_inputs == ["l_x_"], device_inputs  # neither n nor its size symbol
    x = torch.randn(4)
    run = split.bind(split.device)
    for n in (7, 8):
        out, nxt = run(4, x, n)
        assert_close(out, x * 2)
        assert nxt == n + 1


def test_split_needs_both_parts():
    from fusebackend.passes.host_inputs import split_host

    gm = _graph_of(lambda c: c + 1, torch.tensor(1))
    assert split_host(gm, lambda v: True) is None
    assert split_host(gm, lambda v: False) is None


def _fake_graph(mode, build):
    """A hand-built graph whose nodes carry fake example values: ``build(graph, add)``."""
    graph = torch.fx.Graph()

    def add(op, target, args, value, name=None):
        node = (
            graph.placeholder(target) if op == "placeholder" else getattr(graph, op)(target, args)
        )
        if name:
            node.name = name
        node.meta["example_value"] = value
        return node

    build(graph, add)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_hoisted_input_that_the_graph_writes_is_written_through_a_clone():
    """``d = ids.to("cuda"); d.add_(1)``: eager writes a fresh copy, never the caller's ids."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusebackend.passes.host_inputs import hoist_host_to_device

    mode = FakeTensorMode()
    with mode:
        ids_v = torch.zeros(3, dtype=torch.int64)

    def build(graph, add):
        ids = add("placeholder", "ids", (), ids_v)
        w = add("placeholder", "w", (), _fake_cuda(mode, (10, 4)))
        d = add("call_method", "to", (ids, "cuda"), _fake_cuda(mode, (3,), torch.int64))
        add("call_method", "add_", (d, 1), example_value(d))
        e = add("call_method", "to", (ids, "cuda"), _fake_cuda(mode, (3,), torch.int64))
        first = add("call_function", operator.getitem, (w, d), _fake_cuda(mode, (3, 4)))
        second = add("call_function", operator.getitem, (w, e), _fake_cuda(mode, (3, 4)))
        graph.output((first, second))

    gm = _fake_graph(mode, build)
    assert hoist_host_to_device(gm, [torch.zeros(3, dtype=torch.int64), None]) == {
        0: torch.device("cuda", 0)
    }
    assert mutated_placeholders(gm.graph) == []  # so the runtime never writes ids back
    # The rewritten graph on real CPU tensors: the write lands on a copy, once.
    ids, w = torch.tensor([0, 4, 8]), torch.randn(10, 4)
    first, second = gm(ids, w)
    assert_close(first, w[ids + 1])
    assert_close(second, w[ids])
    assert ids.tolist() == [0, 4, 8]


def test_staged_host_scalars_are_host_inputs_of_the_device_part():
    """A 0-d host value read on the device is staged: it must be in ``host_inputs`` (the
    runtime copies it in; its value must not be part of the capture key)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusebackend.passes.host_inputs import split_host
    from fusebackend.prepare import _device_part_of

    mode = FakeTensorMode()
    with mode:
        counter_v = torch.zeros((), dtype=torch.int64)
        pos_v = counter_v + 1

    def build(graph, add):
        counter = add("placeholder", "counter", (), counter_v)
        x = add("placeholder", "x", (), _fake_cuda(mode, (4,)))
        pos = add("call_function", operator.add, (counter, 1), pos_v, "pos")
        y = add("call_function", operator.mul, (x, pos), _fake_cuda(mode, (4,)), "y")
        graph.output((y,))

    gm = _fake_graph(mode, build)
    split = split_host(gm, lambda v: v.device.type == "cpu")
    assert split is not None and split.nodes == ["pos"]
    cuda = torch.device("cuda", 0)
    part = _device_part_of(split, [torch.tensor(3), torch.zeros(4)], {}, cuda)
    assert part.host_inputs == {1: cuda}, part.graph.code  # x, then the staged pos
    assert list(part.original_indices) == [1]
    placeholders = [n for n in part.graph.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 2 and all(u.target is operator.mul for u in placeholders[1].users)


# Host/device splits on the CPU: int64 values play the host, floats the device.
def _int64(value) -> bool:
    return value.dtype == torch.int64


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _run_split_like_eager(fn, make_args, expected_host_nodes):
    from fusebackend.passes.host_inputs import split_host

    gm = _graph_of(fn, *make_args())
    split = split_host(gm, _int64)
    assert split is not None
    assert split.nodes == expected_host_nodes, split.nodes
    run = split.bind(split.device)
    # Dynamo orders its inputs by first use: l_<name>_ is the argument <name>.
    names = list(inspect.signature(fn).parameters)
    order = [names.index(n.name[2:-1]) for n in gm.graph.nodes if n.op == "placeholder"]
    args, expected_args = make_args(), make_args()
    for _ in range(3):
        out = run(*[args[i] for i in order])
        expected = fn(*expected_args)
        assert_close(list(out), list(expected))
        assert_close(list(args), list(expected_args))
    return split


def _read_then_write_out(counter, step, x):
    y = x * counter.to(x.dtype)  # a device read of the counter before the host write
    torch.add(step, counter, out=counter)  # host write through out= (args[0] is step)
    return y, counter * 1


def test_split_snapshots_a_value_written_later_through_out():
    def make_args():
        return torch.tensor(3), torch.tensor(2), torch.randn(2, generator=_seeded())

    _run_split_like_eager(_read_then_write_out, make_args, ["add", "mul_1"])


def _setitem_on_host(counter, x):
    y = x * counter.to(x.dtype)  # device read before the write
    counter[0] = counter[0] + 5  # setitem returns None: still host work
    return y, counter * 1


def test_setitem_on_host_values_runs_in_the_host_part():
    def make_args():
        return torch.tensor([3]), torch.randn(2, generator=_seeded())

    split = _run_split_like_eager(
        _setitem_on_host, make_args, ["getitem", "add", "setitem", "mul_1"]
    )
    device_ops = {n.target for n in split.device.graph.nodes if n.op == "call_function"}
    assert operator.setitem not in device_ops


def test_a_mutation_reading_a_number_input_runs_in_the_host_part():
    from fusebackend.passes.host_inputs import host_nodes

    graph = torch.fx.Graph()
    counter, length, x = (graph.placeholder(n) for n in ("counter", "length", "x"))
    counter.meta["example_value"] = torch.zeros((), dtype=torch.int64)
    length.meta["example_value"] = 7  # a dynamic length reaches the graph as a SymInt/int
    x.meta["example_value"] = torch.zeros(3)
    bump = graph.call_method("add_", (counter, length))
    bump.meta["example_value"] = counter.meta["example_value"]
    ramp = graph.call_function(torch.arange, (length,))
    ramp.meta["example_value"] = torch.zeros(7, dtype=torch.int64)
    scaled = graph.call_function(operator.mul, (x, 2.0))
    scaled.meta["example_value"] = torch.zeros(3)
    graph.output((scaled, ramp))
    assert host_nodes(graph, _int64) == [bump]  # arange(length) stays put (batch_buckets)


def test_no_split_when_a_device_node_writes_a_host_value():
    from fusebackend.passes.host_inputs import split_host

    def fn(counter, x):
        pos = counter + 1  # host work
        counter.copy_((x.sum() * 2).to(counter.dtype))  # a host value written from device data
        return x * pos.to(x.dtype)

    gm = _graph_of(fn, torch.tensor(3), torch.randn(2))
    assert split_host(gm, _int64) is None


# ------------------------------------------- what the backend hands the runtime (backend.py)

FAKE_CUDA = torch.device("cuda", 0)


def _backend_call(monkeypatch, fn, args, on_host=None, **kwargs):
    """Run ``infinifuse`` on ``fn``'s Dynamo graph as for a CUDA graph (no GPU needed: the
    runtime is only built, never called); return (GraphCache kwargs, report, placeholders)."""
    import fusebackend.backend as backend
    import fusebackend.prepare as prepare

    monkeypatch.setattr(backend, "_graph_device", lambda inputs: FAKE_CUDA)
    if on_host is not None:
        monkeypatch.setattr(prepare, "_on_host", on_host)
    seen = {}
    real = backend.GraphCache

    def spy(**cache_kwargs):
        seen.update(cache_kwargs)
        return real(**cache_kwargs)

    monkeypatch.setattr(backend, "GraphCache", spy)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    gm, example_inputs = graphs[0]
    with torch.no_grad():
        backend.infinifuse(gm, example_inputs, **kwargs)
    unfused = seen["unfused"]
    names = [n.name for n in unfused.graph.nodes if n.op == "placeholder"]
    return seen, fusebackend.last_report().graphs[-1], names


@pytest.mark.parametrize(
    "kwargs, split",
    [
        ({"options": {"cudagraphs": True}}, True),
        ({"options": {"cudagraphs": False}}, False),
        ({"mode": "max-autotune-no-cudagraphs"}, False),
    ],
)
def test_the_host_split_happens_only_when_cuda_graphs_capture(monkeypatch, kwargs, split):
    counter, x = torch.tensor(3), torch.randn(2, 5)
    seen, report, names = _backend_call(monkeypatch, _counter_model, (counter, x), _int64, **kwargs)
    assert report.mutated_inputs == ["l_counter_"]
    mutated = {names[i] for i in seen["mutated_input_indices"]}
    if split:
        assert report.host_nodes == ["before", "pos", "add_", "mul_2"], report.host_nodes
        assert mutated == set()  # the host part writes the counter, on the caller's tensor
    else:
        assert report.host_nodes == []
        assert "add_" in {n.target for n in seen["unfused"].graph.nodes}
        assert mutated == {"l_counter_"}


def _writes_counter_and_buffer(counter, buf, x):
    counter.add_(1)
    buf.mul_(2.0)
    return x * 2.0


def test_a_cpu_scalar_is_never_a_static_input_of_a_cuda_graph(monkeypatch):
    # A captured graph never re-reads a CPU scalar; the runtime keys it by value only when
    # it is not static. (On the fake-CUDA path every tensor is on the CPU; the 1-d buffer
    # stays in place as a device tensor would.)
    args = (torch.tensor(3.0), torch.randn(4), torch.randn(3))
    seen, report, names = _backend_call(
        monkeypatch, _writes_counter_and_buffer, args, options={"cudagraphs": True}
    )
    assert report.mutated_inputs == ["l_counter_", "l_buf_"]
    assert {names[i] for i in seen["static_input_indices"]} == {"l_buf_"}
    assert {names[i] for i in seen["mutated_input_indices"]} == {"l_counter_", "l_buf_"}


def test_a_cpu_graph_uses_its_mutated_scalars_in_place():
    compiled = torch.compile(_writes_counter_and_buffer, backend="infinifuse", fullgraph=True)
    counter, buf, x = torch.tensor(3.0), torch.randn(4), torch.randn(3)
    with torch.no_grad():
        compiled(counter, buf, x)
    assert fusebackend.last_report().graphs[0].static_inputs == ["l_counter_", "l_buf_"]


# ------------------------------------------------ host inputs: a move that also casts


def test_a_host_input_moved_with_a_cast_is_not_staged_as_a_plain_copy():
    """``ids.to("cuda", torch.float16)`` both moves and casts: staging the CPU tensor as the
    graph's device input would copy it unconverted (int64 where the graph computes fp16).
    The pass leaves that move in the graph and stages nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusebackend.passes.host_inputs import hoist_host_to_device

    mode = FakeTensorMode()

    graph = torch.fx.Graph()
    ids = graph.placeholder("ids")
    w = graph.placeholder("w")
    moved = graph.call_method("to", (ids, "cuda", torch.float16))
    out = graph.call_function(operator.mul, (moved, w))
    graph.output((out,))
    with mode:
        ids.meta["example_value"] = torch.zeros(5, dtype=torch.int64)
    w.meta["example_value"] = _fake_cuda(mode, (5,), torch.float16)
    moved.meta["example_value"] = _fake_cuda(mode, (5,), torch.float16)
    out.meta["example_value"] = _fake_cuda(mode, (5,), torch.float16)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    assert hoist_host_to_device(gm, [torch.arange(5), None]) == {}
    assert moved in gm.graph.nodes and out.args[0] is moved
