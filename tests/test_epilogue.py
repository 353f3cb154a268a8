"""A matmul group's activation as a function written by the row codegen (kernels/epilogue.py).

The function is applied here by a small kernel to a block of values, as the matmul kernel
applies it to an output tile, and compared with eager's activation of the same values at an
odd size in three dtypes (values rounded to the dtype first, as the matmul kernel rounds
its products). The matmul group tests (tests/test_matmul_kernel.py) run the same functions
inside the matmul kernel.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl
from helpers import EAGER_ACTIVATIONS, assert_close

from fusebackend.kernels import matmul_triton
from fusebackend.kernels.epilogue import (
    activation_program,
    epilogue_function,
    evaluate,
    generate_epilogue_source,
)
from fusebackend.kernels.ir import (
    ACTIVATIONS,
    Const,
    InputRef,
    Instr,
    KernelOptions,
    Reduce,
    RowProgram,
)

pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402

EAGER = {**EAGER_ACTIVATIONS, "gelu_new": ACT2FN["gelu_new"]}


@triton.jit
def _apply(x_ptr, out_ptr, n, EPILOGUE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    x = tl.load(x_ptr + offsets, mask=keep, other=0.0)
    y = EPILOGUE(x.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, y, mask=keep)


def _run(name: str, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    block = 128
    function = epilogue_function(activation_program(name, x.dtype))
    _apply[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), EPILOGUE=function, BLOCK=block)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_function_equals_eager(name, dtype):
    torch.manual_seed(0)
    x = (torch.randn(333) * 3).to(dtype)  # tails of the tanh and erf included
    x[:4] = torch.tensor([0.0, -0.0, 1e-3, -6.5])
    got = _run(name, x)
    assert got.dtype == dtype
    assert_close(got, EAGER[name](x))


def test_nan_stays_nan_through_relu_and_the_gelus():
    x = torch.tensor([float("nan"), 1.0, -1.0], dtype=torch.float16)
    for name in ("relu", "gelu", "gelu_new", "silu"):
        assert torch.isnan(_run(name, x)[0]), name


def test_gelu_new_in_fp16_is_eagers_to_the_bit():
    # NewGELU's 8 ops, each rounded to fp16 where eager rounds it: on 20000 values every
    # output equals eager's (one rounding left out changed 4% of them)
    torch.manual_seed(0)
    x = (torch.randn(20000) * 3).to(torch.float16)
    assert len(activation_program("gelu_new", torch.float16).instrs) == 8
    assert torch.equal(_run("gelu_new", x), ACT2FN["gelu_new"](x))


def test_an_epilogue_is_elementwise_with_one_output():
    x = InputRef(0)
    options = KernelOptions()
    reduced = RowProgram((torch.float32,), (), (Reduce("sum", x, torch.float32),), (0,))
    with pytest.raises(ValueError, match="elementwise"):
        generate_epilogue_source(reduced, options)
    two = RowProgram((torch.float32,), (), (Instr("relu", (x,), torch.float32),), (0, 0))
    with pytest.raises(ValueError, match="one output"):
        generate_epilogue_source(two, options)
    with pytest.raises(ValueError, match="activation must be one of"):
        activation_program("swish", torch.float16)


def test_the_matmul_kernel_writes_no_activation_math_of_its_own():
    # issue 38: activation math lives in one place (kernels/expressions.py)
    source = inspect.getsource(matmul_triton)
    for spelling in ("tl.sigmoid", "tl.erf", "tanh", "0.7978845608028654", "0.044715"):
        assert spelling not in source, spelling


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_the_torch_reference_of_a_program_is_eagers_to_the_bit(name, dtype):
    # kernels/matmul_reference.py runs a group's elementwise tail through evaluate()
    torch.manual_seed(1)
    x = (torch.randn(257) * 3).to(dtype)
    got = evaluate(activation_program(name, dtype), x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, EAGER[name](x), rtol=0, atol=0)


def test_the_torch_reference_reads_infinite_constants():
    x = InputRef(0)
    clamp = Instr("clamp", (x, Const.of(float("-inf")), Const.of(2.0)), torch.float32)
    program = RowProgram((torch.float32,), (), (clamp,), (0,))
    values = torch.tensor([-(2.0**100), 1.0, 5.0])
    assert evaluate(program, values).tolist() == [-(2.0**100), 1.0, 2.0]
