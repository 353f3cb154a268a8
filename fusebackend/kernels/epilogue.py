"""A matmul group's activation as a RowProgram, run by a function the row codegen writes.

The activation math of every kernel family is the row kernels' own: each op's Triton
spelling is in ``kernels/expressions.py`` and ``kernels/codegen.py`` rounds each value as
eager does. A matmul group names its activation (``MatmulGroup.gate`` or ``.activation``,
``kernels.ir.ACTIVATIONS``); ``activation_program`` writes that name as the op-table ops eager
runs, and ``epilogue_function`` compiles the program into a ``@triton.jit`` function that the
matmul kernel takes as a constant argument and calls on its output tile
(``generate_epilogue_source``, a subclass of ``codegen.Writer``).

NewGELU ("gelu_new") is eight ops, each rounded to the dtype in eager, so its program is
eight instructions and the kernel rounds at the same places.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import torch

from fusebackend.kernels.codegen import Scope, Writer
from fusebackend.kernels.ir import (
    ACTIVATIONS,
    Const,
    InputRef,
    Instr,
    KernelOptions,
    RowProgram,
    ValueRef,
)
from fusebackend.kernels.triton_api import import_source

__all__ = ["EPILOGUE_OPTIONS", "activation_program", "epilogue_function", "evaluate",
           "generate_epilogue_source"]  # fmt: skip

# Eager rounds after every op; index checks have nothing to check in an epilogue.
EPILOGUE_OPTIONS = KernelOptions(index_checks=False, round_intermediates=True)


@functools.cache
def activation_program(name: str, dtype: torch.dtype) -> RowProgram:
    """``kernels.ir.ACTIVATIONS``' ``name`` applied to one ``dtype`` input (slot 0), as the
    op-table ops eager runs for it; "" is the identity (a cast to ``dtype``). Cached: a
    launch asks for it every time it builds its arguments."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
    x = InputRef(0)
    if name == "gelu_new":
        instrs = _new_gelu(x, dtype)
    elif name in ("gelu", "gelu_tanh"):
        approximate = "tanh" if name == "gelu_tanh" else "none"
        instrs = [Instr("gelu", (x,), dtype, (("approximate", approximate),))]
    else:
        instrs = [Instr(name or "cast", (x,), dtype)]
    return RowProgram((dtype,), (), tuple(instrs), (len(instrs) - 1,))


def _new_gelu(x: InputRef, dtype: torch.dtype) -> list[Instr]:
    """transformers' NewGELUActivation, ``0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715
    * pow(x, 3.0))))``, in eager's order of ops (passes/activations.py matches it)."""

    return [
        Instr("mul", (x, Const.of(0.5)), dtype),  # v0: 0.5 * x
        Instr("pow", (x,), dtype, (("exponent", 3.0),)),  # v1
        Instr("mul", (ValueRef(1), Const.of(0.044715)), dtype),  # v2
        Instr("add", (x, ValueRef(2)), dtype),  # v3
        Instr("mul", (ValueRef(3), Const.of(math.sqrt(2.0 / math.pi))), dtype),  # v4
        Instr("tanh", (ValueRef(4),), dtype),  # v5
        Instr("add", (ValueRef(5), Const.of(1.0)), dtype),  # v6
        Instr("mul", (ValueRef(0), ValueRef(6)), dtype),  # v7
    ]


@functools.cache
def epilogue_function(program: RowProgram) -> Any:
    """The ``@triton.jit`` function that applies ``program`` (one fp32 block per input, each
    a value rounded to its dtype; returns fp32 rounded to the output's dtype). Cached: a
    kernel's constant argument must be the same object at every launch."""
    name, source = generate_epilogue_source(program, EPILOGUE_OPTIONS)
    return getattr(import_source(name, source), name)


# Torch's own function of each elementwise op an epilogue may hold (the torch reference of a
# matmul group, kernels/matmul_reference.py), called as eager calls it; ops absent here are
# torch.<name>.
_TORCH = {
    "relu6": torch.nn.functional.relu6,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
    "hardswish": torch.nn.functional.hardswish,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
    "leaky_relu": torch.nn.functional.leaky_relu,
    "hardtanh": torch.nn.functional.hardtanh,
}


def evaluate(program: RowProgram, *inputs: torch.Tensor) -> torch.Tensor:
    """``program`` (elementwise, one output) run by torch's own ops, each value of its
    instruction's dtype as eager computes it: the reference the kernel is compared with."""
    values: list[Any] = []

    def operand(op: Any) -> Any:
        if isinstance(op, InputRef):
            return inputs[op.slot]
        if isinstance(op, ValueRef):
            return values[op.index]
        if isinstance(op, Const):
            return op.value
        return None

    for instr in program.instrs:
        args = [operand(op) for op in instr.operands]
        if instr.name in ("cast", "dropout"):
            value = args[0]
        else:
            function = _TORCH.get(instr.name) or getattr(torch, instr.name)
            value = function(*args, **instr.param_dict)
        values.append(torch.as_tensor(value).to(instr.dtype))
    return values[program.outputs[0]]


def generate_epilogue_source(program: RowProgram, options: KernelOptions) -> tuple[str, str]:
    """Return (function name, Python source of a module defining it): a ``@triton.jit``
    function that applies the elementwise ``program`` to values another kernel holds in
    registers (a matmul group's activation: kernels/epilogue.py). It takes one fp32 (fp64)
    block per input slot, each a value rounded to its dtype, and returns the program's one
    output in the compute dtype, rounded to its dtype; the instructions and their roundings
    are the row kernels' own (``codegen.Writer._instr``)."""
    if len(program.outputs) != 1 or program.lookups or program.scalar_inputs:
        raise ValueError("an epilogue is elementwise over its inputs with one output")
    if any(not isinstance(i, Instr) for i in program.instrs):
        raise ValueError("an epilogue holds elementwise instructions only")
    return _FunctionWriter(program, 0, options, "tile").write_function()


class _FunctionWriter(Writer):
    """A device function over values the caller holds (``generate_epilogue_source``): the
    inputs are its arguments, so nothing is loaded or stored, and every value is a block of
    the caller's shape (no narrow values, one scope)."""

    def write_function(self) -> tuple[str, str]:
        digest = hashlib.sha1(repr((self.p, self.options)).encode()).hexdigest()[:10]
        name = f"_epilogue_{digest}"
        args = ", ".join(f"in{slot}" for slot in range(len(self.p.input_dtypes)))
        self.emit(self.outer, f'"""{self._math_doc()}"""')
        result = self._value(self.outer, self.p.outputs[0])
        self.emit(self.outer, f"return {result}")
        lines = [
            '"""Generated by fusebackend.kernels.codegen; do not edit."""',
            "import triton",
            "import triton.language as tl",
            "",
            "",
            "@triton.jit",
            f"def {name}({args}):",
            *self.lines,
        ]
        return name, "\n".join(lines) + "\n"

    def _math_doc(self) -> str:
        return super()._math_doc().replace(f"layout: {self.layout}", "in the caller's registers")

    def _scope_for(self, scope: Scope, narrow: bool) -> Scope:
        return self.outer

    def _load(self, scope: Scope, slot: int) -> str:
        key = ("load", slot)
        if key not in self.outer.names:
            self.emit(self.outer, f"x{slot} = in{slot}.to({self.compute})")
            self.outer.names[key] = f"x{slot}"
        return self.outer.names[key]
