"""``fx_util.evaluate``'s shortcut for elementwise ops on symbolic sizes: the value it gives
without running the op (an empty tensor of the operands' layout) has the layout, sizes and
dtype the op's own fake run gives, and the shortcut declines where eager's layout could
differ (mixed layouts, a dim of 1, an operand broadcast over two dims)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)

from fusebackend.passes import fx_util

CL = torch.channels_last


def _symbolic(mode: FakeTensorMode, real: torch.Tensor, dynamic: tuple[bool, ...]) -> torch.Tensor:
    sizes = [DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic]
    return mode.from_tensor(real, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))


def _node(target, args, kwargs=None, method=False):
    """A call node whose arguments are placeholders holding the given values, its traced
    value the op's own fake run."""
    graph = torch.fx.Graph()
    nodes = []
    for k, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            p = graph.placeholder(f"x{k}")
            p.meta["example_value"] = value
            nodes.append(p)
        else:
            nodes.append(value)
    kwargs = kwargs or {}
    if method:
        node = graph.call_method(target, tuple(nodes), kwargs)
        traced = getattr(args[0], target)(*args[1:], **kwargs)
    else:
        node = graph.call_function(target, tuple(nodes), kwargs)
        traced = target(*args, **kwargs)
    node.meta["example_value"] = traced
    return node, traced


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    exprs = fx_util._same_sizes
    return a.dtype == b.dtype and exprs(a.shape, b.shape) and exprs(a.stride(), b.stride())


@pytest.fixture
def mode():
    return FakeTensorMode(shape_env=ShapeEnv())


def _cases(mode):
    torch.manual_seed(0)
    x_cl = _symbolic(mode, torch.randn(3, 5, 7, 9).to(memory_format=CL), (True,) * 4)
    y_cl = _symbolic(mode, torch.randn(3, 5, 7, 9).to(memory_format=CL), (True,) * 4)
    x_c = _symbolic(mode, torch.randn(3, 5, 7, 9), (True,) * 4)
    bias = _symbolic(mode, torch.randn(1, 5, 1, 1), (False, True, False, False))
    half = _symbolic(mode, torch.randn(3, 5, 7, 9).to(memory_format=CL).half(), (True,) * 4)
    plane = _symbolic(mode, torch.randn(1, 1, 7, 9), (False, False, True, True))
    ones = _symbolic(mode, torch.randn(3, 5, 1, 9).to(memory_format=CL), (True, True, False, True))
    taken = {
        "hardswish": (F.hardswish, (x_cl,), {}, False),
        "add cl": (torch.add, (x_cl, y_cl), {}, False),
        "add bias first": (operator.add, (bias, x_cl), {}, False),
        "mul scalar": (operator.mul, (x_c, 0.5), {}, False),
        "sigmoid method": ("sigmoid", (x_cl,), {}, True),
        "promote": (operator.mul, (half, x_cl), {}, False),
        "compare": (operator.gt, (x_cl, bias), {}, False),
    }
    declined = {
        "mixed layouts": (operator.add, (x_cl, x_c), {}, False),
        "two dims broadcast": (operator.add, (x_cl, plane), {}, False),
        "a dim of 1": (F.relu, (ones,), {}, False),
        "transposed": (F.relu, (x_cl.transpose(2, 3),), {}, False),
        "cast": ("to", (x_cl, torch.float16), {}, True),
    }
    return taken, declined


def test_the_shortcut_gives_the_ops_own_layout_and_dtype(mode):
    taken, declined = _cases(mode)
    for name, (target, args, kwargs, method) in {**taken, **declined}.items():
        with mode:
            node, traced = _node(target, args, kwargs, method)
            quick = fx_util.elementwise_on_one_layout(node.op, node.target, args, kwargs, traced)
            value = fx_util.evaluate(node)
        assert (quick is not None) == (name in taken), name
        assert _same(value, traced), (name, value.stride(), traced.stride())
        if quick is not None:
            assert _same(quick, traced), name
            assert all(quick.untyped_storage() is not a.untyped_storage()
                       for a in args if isinstance(a, torch.Tensor)), name  # fmt: skip


def test_static_sizes_run_the_op(mode):
    x = _symbolic(mode, torch.randn(3, 5, 7, 9).to(memory_format=CL), (False,) * 4)
    with mode:
        node, traced = _node(F.hardswish, (x,))
        assert fx_util.elementwise_on_one_layout(node.op, node.target, (x,), {}, traced) is None
        assert _same(fx_util.evaluate(node), traced)


def test_an_in_place_ops_value_takes_its_operands_dtype_or_none(mode):
    """out_of_place.py asks for an in-place op's out-of-place value in the written tensor's
    dtype: the shortcut answers only where no operand promotes it and the op is arithmetic."""
    x = _symbolic(mode, torch.randn(3, 5, 7, 9).to(memory_format=CL).half(), (True,) * 4)
    y = _symbolic(mode, torch.randn(3, 5, 7, 9).to(memory_format=CL), (True,) * 4)
    with mode:
        x * y  # (as Dynamo's trace does: the two tensors' sizes become the same symbols)
        relu = fx_util.elementwise_on_one_layout("call_function", F.relu, (x,), {}, x,
                                                 operands_dtype=True)  # fmt: skip
        assert relu is not None and _same(relu, F.relu(x))
        for target, args in ((operator.mul, (x, y)), (operator.gt, (x, x))):
            quick = fx_util.elementwise_on_one_layout("call_function", target, args, {}, x,
                                                      operands_dtype=True)  # fmt: skip
            assert quick is None, target
