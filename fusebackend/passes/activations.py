"""The activation a linear's output goes through, named for a matmul group's epilogue.

Two spellings are recognised where a product's only use is its activation:

- one op of the op table: ``F.silu``, ``F.gelu`` (exact or ``approximate="tanh"``),
  ``F.relu`` / ``torch.relu`` (not in place): OPT's fc1, GPT-NeoX's and Falcon's MLPs;
- transformers' ``NewGELUActivation`` ("gelu_new": GPT-2, GPT-J, CodeGen, Phi-1/2), written
  out as eight ops, ``0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3.0))))``,
  each rounded to the dtype in eager: the kernel rounds at the same places
  (``MatmulGroup.activation == "gelu_new"``).

Any other chain of elementwise ops over the product alone (CLIP's quick GELU, BLOOM's and
fast GELU written out, a hardswish, a leaky ReLU as a ``where``) is taken as a program
(``elementwise_tail``, lowered by ``passes/lowering.lower_tail``): the kernel runs its ops with
the row kernels' expressions and roundings.
"""

from __future__ import annotations

import math
from typing import Any

import torch.fx

from fusebackend.passes.fx_util import example_value, single_user
from fusebackend.passes.graph import is_mutation
from fusebackend.passes.groups import match, op_call
from fusebackend.passes.ops import OpCall, OpKind

__all__ = ["activation_of", "elementwise_tail", "kernel_activation_name"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
# Graph nodes looked at past the product for its tail (the longest activation written out
# in transformers, BLOOM's GELU, is 8 ops; a node that does not read the tail is skipped)
TAIL_WINDOW = 32


def activation_of(y: torch.fx.Node) -> tuple[str, torch.fx.Node, list[torch.fx.Node]] | None:
    """(``MatmulGroup.activation`` name, the node of the activated value, the nodes that
    compute it) when all ``y`` is used for is one activation, else None."""
    users = list(y.users)
    if len(users) == 1:
        single = _one_op(users[0], y)
        if single is not None:
            return single, users[0], [users[0]]
    return _new_gelu(y)


def kernel_activation_name(call: OpCall | None) -> str:
    """The kernels' name (``kernels.ir.ACTIVATIONS``) of an activation call of the op table,
    "" for None or one they do not run: ``gelu`` by its approximation, and ``nn.ReLU6``,
    which reaches the graph as ``hardtanh(x, 0.0, 6.0)``, as "relu6"."""
    if call is None:
        return ""
    if call.op.name == "hardtanh":
        bounds = (call.params.get("min_val", -1.0), call.params.get("max_val", 1.0))
        return "relu6" if bounds == (0.0, 6.0) else ""
    if call.op.name != "gelu":
        return call.op.name
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(call.params.get("approximate", "none"), "")


def _one_op(node: torch.fx.Node, y: torch.fx.Node) -> str | None:
    call = op_call(node, "silu", "gelu", "relu")
    if call is None or call.params.get("inplace") or list(call.operands[:1]) != [y]:
        return None
    return kernel_activation_name(call) or None


def _new_gelu(y: torch.fx.Node) -> tuple[str, torch.fx.Node, list[torch.fx.Node]] | None:
    """``0.5 * y * (1.0 + tanh(sqrt(2/pi) * (y + 0.044715 * pow(y, 3.0))))``, the three
    uses of ``y`` (the half, the cube, the sum) and every node between used once."""
    if len(y.users) != 3:
        return None
    half = cube = shifted = None
    for user in y.users:
        if _scaled(user, y, 0.5):
            half = user
        elif _cube(user, y):
            cube = user
        elif op_call(user, "add") is not None:
            shifted = user
    if half is None or cube is None or shifted is None:
        return None
    scaled = single_user(cube)
    if scaled is None or not _scaled(scaled, cube, 0.044715) or single_user(scaled) is not shifted:
        return None
    add = op_call(shifted, "add")
    if add.params.get("alpha", 1) != 1 or set(add.operands) != {y, scaled}:
        return None
    inner = single_user(shifted)
    if inner is None or not _scaled(inner, shifted, _SQRT_2_OVER_PI):
        return None
    tanh = single_user(inner)
    if op_call(tanh, "tanh") is None:
        return None
    one_plus = single_user(tanh)
    plus = op_call(one_plus, "add")
    if plus is None or plus.params.get("alpha", 1) != 1 or set(plus.operands) != {tanh, 1.0}:
        return None
    out = single_user(one_plus)
    if out is None or single_user(half) is not out or not _product_of(out, half, one_plus):
        return None
    return "gelu_new", out, [half, cube, scaled, shifted, inner, tanh, one_plus, out]


def _scaled(node: Any, x: torch.fx.Node, factor: float) -> bool:
    """Is ``node`` ``x * factor`` (either order; the factor to within 1e-12)?"""
    call = op_call(node, "mul")
    if call is None or len(call.operands) != 2 or x not in call.operands:
        return False
    other = call.operands[1] if call.operands[0] is x else call.operands[0]
    return isinstance(other, float) and abs(other - factor) < 1e-12


def _cube(node: Any, x: torch.fx.Node) -> bool:
    call = op_call(node, "pow")
    return (
        call is not None
        and list(call.operands[:1]) == [x]
        and call.params.get("exponent") in (3, 3.0)
    )


def _product_of(node: Any, a: torch.fx.Node, b: torch.fx.Node) -> bool:
    call = op_call(node, "mul")
    return call is not None and len(call.operands) == 2 and set(call.operands) == {a, b}


def elementwise_tail(y: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the node of the tail's value, the tail's nodes in graph order): elementwise op-table
    ops, floating or boolean, that read only ``y``, each other and numbers, take every use
    of ``y``, and of which only the last is read outside. The longest such run of the
    graph's ops after ``y`` (nodes that read none of it are passed over), else None."""
    grown: list[torch.fx.Node] = []
    inside = {y}
    node, looked = y.next, 0
    while node.op != "output" and looked < TAIL_WINDOW:
        looked += 1
        if is_mutation(node):
            break  # the group's span may hold no write (matmul_groups._hazard)
        if any(a in inside for a in node.all_input_nodes):
            if not _joins(node, inside):
                break  # what it reads stays read outside: a shorter tail may still do
            grown.append(node)
            inside.add(node)
        node = node.next
    for end in range(len(grown), 0, -1):
        tail = grown[:end]
        members = {y, *tail}
        read_outside = [n for n in tail if any(u not in members for u in n.users)]
        if set(y.users) <= members and read_outside == [tail[-1]]:
            same_dtype = example_value(tail[-1]).dtype == example_value(y).dtype
            return (tail[-1], tail) if same_dtype else None
    return None


def _joins(node: torch.fx.Node, inside: set[torch.fx.Node]) -> bool:
    call = match(node)
    if not isinstance(call, OpCall) or call.op.kind != OpKind.ELEMENTWISE:
        return False
    value = example_value(node)
    kind_ok = isinstance(value, torch.Tensor) and (value.is_floating_point()
                                                   or value.dtype == torch.bool)  # fmt: skip
    return kind_ok and all(a in inside for a in node.all_input_nodes)
