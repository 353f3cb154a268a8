"""Which values a row group may hold in integer dtypes, and why it refuses the others.

Integer tensors reach row groups through index arithmetic: RoBERTa's, XLM-R's and MPNet's
position ids (``ne(ids, pad).int()``, ``cumsum``, ``type_as``, ``* mask``, ``.long() + pad``:
seven aten kernels in eager), BLOOM's ALiBi positions (``cumsum`` of the attention mask).
The kernel computes integer values in int64 (never through fp32, whose 24-bit mantissa
would round ids above 2**24) and wraps each to its own dtype, as eager's integer ops wrap.
An integer or bool operand of an op with a floating result is converted to the compute
dtype first, as eager promotes it (a bool operand of integer math to int64).

Integer results come only from the ops of ``INTEGER_OPS``: exact in int64 and written
the same for every integer dtype. Reductions, norms, softmax and moves of integer tensors
stay as traced, as do graph numbers (SymInts) in integer arithmetic: the kernel takes graph
numbers as floating scalar arguments.
"""

from __future__ import annotations

import torch
import torch.fx

from fusebackend.kernels.ir import INTEGER_DTYPES as INTEGERS
from fusebackend.passes.groups import is_graph_scalar
from fusebackend.passes.ops import FLOATING, OpCall, OpKind

__all__ = [
    "INTEGERS",
    "INTEGER_OPS",
    "integer_scalar_reason",
    "operand_dtype_reason",
    "result_dtype_reason",
]

# The dtypes a group reads and computes
_READABLE = (*FLOATING, torch.bool, *INTEGERS)
# Ops whose result may be an integer tensor: each is exact in int64 and wraps like eager
# once rounded to its dtype (comparisons give bools from integers too; they need no entry).
INTEGER_OPS = frozenset({"add", "sub", "mul", "neg", "abs", "cast", "where", "dropout", "cumsum"})


def result_dtype_reason(call: OpCall, dtype: torch.dtype) -> str | None:
    """None when a group may compute ``call``'s result in ``dtype``."""
    if call.op.result == "bool":
        expected: tuple[torch.dtype, ...] = (torch.bool,)
    elif call.op.name == "cast":
        expected = _READABLE
    elif call.op.name in INTEGER_OPS:
        expected = (*FLOATING, *INTEGERS)
    else:
        expected = FLOATING
    if dtype not in expected:
        return f"result dtype {dtype} is not fused"
    if dtype in INTEGERS and call.params.get("alpha", 1) != 1:
        return f"{call.op.name} with alpha={call.params['alpha']!r} of integers"
    return None


def operand_dtype_reason(call: OpCall, name: str, dtype: torch.dtype) -> str | None:
    """None when operand ``name`` of ``call``, a tensor of ``dtype``, can be read."""
    wants_bool = name in call.op.bool_operands
    if call.op.name == "cast":
        return None if dtype in _READABLE else f"cast from {dtype}"
    if wants_bool and dtype != torch.bool:
        return f"operand {name} has dtype {dtype}"
    if dtype not in _READABLE:
        return f"operand {name} of dtype {dtype} is not fused"
    whole_values = (OpKind.ELEMENTWISE, OpKind.SCAN)
    if dtype in INTEGERS and call.op.kind not in whole_values:
        return f"{call.op.name} of an integer tensor ({dtype}) is not fused"
    if dtype == torch.bool and call.op.kind not in whole_values and not wants_bool:
        return f"{call.op.name} of a bool tensor"  # (any/all ask for one: lowering.py)
    return None


def integer_scalar_reason(node: torch.fx.Node, call: OpCall, dtype: torch.dtype) -> str | None:
    """Integer arithmetic with a number computed in the graph (a SymInt): the kernel would
    take it as a floating scalar argument, so such a node stays as traced."""
    if dtype not in INTEGERS:
        return None
    for operand in call.operands:
        if isinstance(operand, torch.fx.Node) and is_graph_scalar(operand):
            return f"integer arithmetic with the graph number {operand.name}"
    return None
