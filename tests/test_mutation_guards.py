"""Behaviour the rest of the suite left open, found by planting bugs (tools/mutation_check.py).

Each test states what a user expects (the fused result equals eager PyTorch's on random
non-zero data at odd shapes, a pass leaves alone what it cannot rewrite exactly, the runtime
never hands back an unchecked wrong result); the mutation it was written against is named
in its docstring. The row kernels run through Triton's interpreter on the CPU.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx
from helpers import assert_close, eager, free_port, run_fused

import fusebackend
from fusebackend.config import FusionConfig
from fusebackend.kernels.cache_write import write_cache_pair
from fusebackend.runtime.graph_cache import EAGER, GraphCache

# ---- row kernels: a row max over padded columns (softmax_max_padding_is_zero)


def _softmax(x):
    return (x * 0.5).softmax(-1)


def _log_softmax(x):
    return torch.log_softmax(x * 0.5, dim=-1)


def _minus_row_max(x):
    y = x * 0.5
    return y - y.amax(-1, keepdim=True)


ROW_MAX_FORMS = {"softmax": _softmax, "log_softmax": _log_softmax, "minus_amax": _minus_row_max}


@pytest.mark.parametrize("width", [7, 127])  # not powers of two: the kernel pads the row
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("form", sorted(ROW_MAX_FORMS))
def test_row_max_of_rows_whose_every_value_is_negative(form, dtype, width):
    """Log-probabilities, scores far below zero: the row max is negative, and a softmax of
    such rows underflows to 0 / 0 unless it subtracts the true max. Guards a row max that
    lets the padded columns count (as 0)."""
    fn = ROW_MAX_FORMS[form]
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(2, 3, width, generator=g) - 400.0).to(dtype)
    actual, _ = run_fused(fn, x)
    assert_close(actual, eager(fn, x))


def test_softmax_of_negative_rows_in_the_chunked_layout():
    """Rows wider than the persistent limit loop over chunks: the running max must start
    below every value, not at 0 (softmax_max_padding_is_zero)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 8193, generator=g) - 400.0
    actual, report = run_fused(_softmax, x)
    assert "layout: chunked" in report.groups[0].source
    assert_close(actual, eager(_softmax, x))


# ---- KV-cache write pair: a prefill of several rows (cache_write_head_from_wrong_axis)


@pytest.mark.parametrize("heads, rows", [(4, 2), (2, 6), (8, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cache_pair_writes_a_prefill_of_several_rows_per_head(heads, rows, dtype):
    """A prefill writes T > 1 rows per head; with a power-of-two number of heads (every
    Llama) T and H share factors. Exactly ``index_copy_``'s result, both caches. Guards a
    program -> (batch, head, row) split that is right only when T and H are coprime (the
    other cache-write tests use 3 heads and 2 rows)."""
    g = torch.Generator().manual_seed(heads * 10 + rows)
    batch, slots, width = 2, 11, 20
    k_cache = torch.randn(batch, heads, slots, width, generator=g).to(dtype)
    v_cache = torch.randn(batch, heads, slots, width, generator=g).to(dtype)
    k = torch.randn(batch, heads, rows, width, generator=g).to(dtype)
    v = torch.randn(batch, rows, heads, width, generator=g).to(dtype).transpose(1, 2)
    index = torch.randperm(slots, generator=g)[:rows]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.index_copy_(2, index, k)
    want_v.index_copy_(2, index, v)
    write_cache_pair(k_cache, v_cache, index, k, v, True)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


# ---- partition: reductions over several dims (partition_multi_dim_reduction_as_last_dim)


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


# ---- host inputs: a move that also casts (host_inputs_hoist_a_dtype_changing_move)


def test_a_host_input_moved_with_a_cast_is_not_staged_as_a_plain_copy():
    """``ids.to("cuda", torch.float16)`` both moves and casts: staging the CPU tensor as the
    graph's device input would copy it unconverted (int64 where the graph computes fp16).
    The pass leaves that move in the graph and stages nothing."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from fusebackend.passes.host_inputs import hoist_host_to_device

    mode = FakeTensorMode()

    def cuda(shape, dtype):
        return FakeTensor(
            mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device("cuda", 0)
        )

    graph = torch.fx.Graph()
    ids = graph.placeholder("ids")
    w = graph.placeholder("w")
    moved = graph.call_method("to", (ids, "cuda", torch.float16))
    out = graph.call_function(operator.mul, (moved, w))
    graph.output((out,))
    with mode:
        ids.meta["example_value"] = torch.zeros(5, dtype=torch.int64)
    w.meta["example_value"] = cuda((5,), torch.float16)
    moved.meta["example_value"] = cuda((5,), torch.float16)
    out.meta["example_value"] = cuda((5,), torch.float16)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    assert hoist_host_to_device(gm, [torch.arange(5), None]) == {}
    assert moved in gm.graph.nodes and out.args[0] is moved


# ---- collectives: a reader of x before x.copy_(all_reduce(x))
# (collectives_drop_copy_despite_earlier_reader)


@pytest.fixture
def mesh():
    """A one-rank CPU mesh over a gloo group of this process."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is absent")
def test_a_copy_whose_target_is_read_before_the_copy_stays(mesh):
    """``before`` reads y's partial sum, between the all-reduce and the copy that writes the
    sum into y: handing it the reduced tensor instead would give it the sum over ranks. The
    copy stays (on one rank the values agree, so the report says it), and the results are
    eager's."""
    functional = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name

    def f(x, w):
        y = x @ w
        reduced = functional.wait_tensor(functional.all_reduce(y, "sum", group))
        before = y * 2.0 + 1.0
        y.copy_(reduced)
        return before, y - 3.0

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 5, generator=g), torch.randn(5, 7, generator=g)
    compiled = torch.compile(f, backend="infinifuse")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w), f(x, w))
    assert fusebackend.last_report().graphs[0].reduce_copies == []


# ---- runtime: validation classes (failed_validation_class_marked_validated)


def test_after_a_mismatch_the_next_shape_of_its_class_is_compared_again():
    """A fused graph that is wrong at one shape may be wrong at the next: a validation class
    counts as checked only once a comparison matched, so each new shape here is compared,
    falls back, and every call returns the unfused graph's result."""
    cache = GraphCache(
        unfused=lambda x, y: (x * y + 1,),
        fused=lambda x, y: (x * y + 1.25,),
        config=FusionConfig(capture_on_call=1),
        device=None,
        name="t",
    )
    g = torch.Generator().manual_seed(3)
    for n in (3, 5, 11):
        x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
        (out,) = cache(x, y)
        torch.testing.assert_close(out, x * y + 1)
        assert cache.mode_for(x, y) == EAGER
    s = fusebackend.stats()
    assert (s["validations"], s["fusion_successes"], s["fusion_fallbacks"]) == (3, 0, 3)
