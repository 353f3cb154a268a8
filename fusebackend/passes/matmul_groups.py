"""Matmul groups: a linear layer of few rows becomes one ``matmul_group`` launch with its
siblings, the norm that produces its input and the work that consumes its output.

In a decode step (1-16 rows) every ``F.linear`` streams its weight once; the norm before it,
its siblings (q, k, v; gate and up) and the ops after it (the gate's activation and product,
the residual add) are separate launches that re-read the small activations. This pass finds,
on the fused graph before the row partition:

- **products**: ``F.linear(x, W, b)`` (W stored [N, K]); GPT-2's Conv1D
  ``addmm(b, x.view(-1, K), W).view(..., N)``, ``x @ W``, ``torch.matmul`` and ``torch.mm``
  (W stored [K, N]: ``weight_layout`` "kn"); ``x @ W.T`` (Falcon's FalconLinear: W stored
  [N, K]). Beside ``F.linear`` the right operand must be a graph input (a parameter, a
  buffer, a constant): a matrix the graph computes (attention's scores @ values) is left to
  cuBLAS;
- **siblings**: products of static shapes and at most ``MAX_ROWS`` rows that read one input
  node (same dtype and weight layout, all with or all without bias), up to
  ``MAX_SIBLINGS`` per launch in graph order;
- **prologue**: when every user of that input is one of the siblings and the input is a norm
  of the un-normalised rows ``h``: ``F.layer_norm`` over the last dim (weight, bias and a
  Python-number eps), or transformers' RMSNorm as traced
  (``w * (h.to(f32) * rsqrt(h.to(f32).pow(2).mean(-1, keepdim=True) + eps)).to(dtype)``,
  Llama, Mistral, Qwen2: ``rms_norm_of``), the kernel reads ``h`` and normalises it;
- **epilogue**: two siblings whose only use is ``act(a) * b`` (``silu``, ``gelu``, either
  order) become one gated output; one linear whose only use is an activation
  (passes/activations.py: silu, gelu, relu, GPT-2's NewGELU written out) gets it applied,
  or else whose only use is ``y + r`` (either order, ``r`` a tensor of y's shape and dtype)
  gets the residual added, and the elementwise ops of that sum alone after it (LeViT's
  distilled head, ``(head(x) + head_dist(x)) / 2``: one launch fewer).

The kernel reads the user's weights where they are (no concatenated copy): a weight changed
after compile is read as it is at each call. Each group becomes one call of the launcher the
backend hands in, with a ``getitem`` per output standing for the node it replaces; the nodes
it computed are erased when nothing else reads them. The call is placed where its first
member was, or just after its last input where that comes later (a residual computed
between the linear and the add), by a stable re-sort; a group is not formed where a node
inside its span writes anything (a read would move across the write) or where one of its
inputs depends on one of its members.

Linears left alone are reported with the reason (many rows: cuBLAS is the better kernel
there; symbolic sizes; dtypes).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from fusebackend.kernels.ir import MAX_ROWS, MAX_SIBLINGS, MatmulGroup, RowProgram
from fusebackend.passes.activations import activation_of, elementwise_tail, kernel_activation_name
from fusebackend.passes.fx_util import (
    example_value,
    nodes_between,
    single_user,
    static_tensor,
    vmapped_nodes,
)
from fusebackend.passes.graph import is_mutation, resort_stably
from fusebackend.passes.groups import op_call
from fusebackend.passes.lowering import lower_tail
from fusebackend.passes.norms import Norm, layer_norm_of, offset_rms_norm_of, rms_norm_of

__all__ = ["MadeGroup", "MatmulGroups", "offset_rms_norm_of", "rms_norm_of", "use_matmul_groups"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass
class MatmulGroups:
    """What the pass did: each group made (its products, the nodes its outputs replace where
    those differ, and what it computes: ``"linear_4, linear_5 -> mul_11: rms_norm + 2
    linears + silu(gate) * up"``) and each product left alone with its reason."""

    left_alone: list[str] = dataclasses.field(default_factory=list)
    groups: list[MadeGroup] = dataclasses.field(default_factory=list)  # as made, in order

    @property
    def made(self) -> list[str]:
        return [made.line for made in self.groups]


@dataclasses.dataclass(frozen=True)
class MadeGroup:
    """One group as made: its launch, the node names it absorbed (graph order), the graph
    values it reads and the nodes whose values it computes."""

    group: MatmulGroup
    kernel: str  # the launch's name in the graph (MatmulGroupOp.__name__)
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dtype: torch.dtype  # of its outputs
    line: str  # the report's line (``MatmulGroups``)


@dataclasses.dataclass
class _Anchor:
    """One product a group computes: ``F.linear(rows, weight, bias)`` (weight ``[N, K]``,
    layout "nk"), GPT-2's Conv1D ``addmm(bias, rows.view(-1, K), weight).view(..., N)``
    (weight ``[K, N]``, layout "kn"), or ``rows @ weight`` (``torch.matmul``, ``torch.mm``;
    "kn") and ``rows @ weight.T`` (Falcon's FalconLinear; the weight ``[N, K]``, "nk")."""

    output: torch.fx.Node  # the node whose value the product is
    rows: torch.fx.Node  # the input rows [..., K]
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    layout: str
    nodes: list[torch.fx.Node]  # its own nodes, the one reading ``rows`` first
    product: torch.fx.Node  # the linear or addmm node


@dataclasses.dataclass
class _Plan:
    anchors: list[_Anchor]  # in graph order (a gate's: gate first, then up)
    norm: Norm | None = None
    gate: str = ""
    gate_half: int | None = None  # a gated pair in one weight's halves: the gate's half
    residual: torch.fx.Node | None = None
    activation: str = ""  # a single linear's (passes/activations.py)
    epilogue: RowProgram | None = None  # or its elementwise tail (activations.elementwise_tail)
    residual_tail: RowProgram | None = None  # the residual sum's elementwise tail
    replaced: list[torch.fx.Node] = dataclasses.field(default_factory=list)  # per output
    members: list[torch.fx.Node] = dataclasses.field(default_factory=list)


def use_matmul_groups(
    graph: torch.fx.Graph,
    launch: Callable[..., Any],
    usable: Callable[[torch.device], bool],
) -> MatmulGroups:
    """Rewrite ``graph`` in place. ``launch(group)``: the callable that runs a
    ``MatmulGroup`` (``kernels.matmul.matmul_op``), called as ``(rows, norm_weight, norm_bias,
    residual, *weights, *biases)``; ``usable``: can its kernel run on a device."""
    result = MatmulGroups()
    order = {node: k for k, node in enumerate(graph.nodes)}
    by_input: dict[tuple[Any, ...], list[_Anchor]] = {}
    batched = vmapped_nodes(graph)  # (inside torch.vmap: no storage for a kernel to read)
    for node in graph.nodes:
        anchor = _anchor(node)
        if anchor is None or node in batched:
            continue
        reason = _anchor_reason(anchor, usable)
        if reason:
            result.left_alone.append(f"{anchor.output.name}: {reason}")
            continue
        key = (anchor.rows, anchor.bias is not None, anchor.layout)
        by_input.setdefault(key, []).append(anchor)
    members: list[torch.fx.Node] = []
    for anchors in by_input.values():
        for start in range(0, len(anchors), MAX_SIBLINGS):
            # read again: an earlier group may have replaced their rows (a gated product
            # is the down projection's rows) or residual since the scan
            siblings = [_anchor(a.product) for a in anchors[start : start + MAX_SIBLINGS]]
            plan = _plan(siblings, len(anchors) <= MAX_SIBLINGS)
            reason = _hazard(plan, order)
            if reason:
                names = ", ".join(a.output.name for a in siblings)
                result.left_alone.append(f"{names}: {reason}")
                continue
            products = ", ".join(a.product.name for a in plan.anchors)
            outputs = ", ".join(n.name for n in plan.replaced)
            absorbed = tuple(n.name for n in sorted(set(plan.members), key=order.__getitem__))
            reads = tuple(n.name for n in _inputs(plan))
            group, kernel = _rewrite(graph, plan, launch)
            made = tuple(n.name for n in plan.replaced)
            dtype = example_value(plan.anchors[0].output).dtype
            named = products if products == outputs else f"{products} -> {outputs}"
            line = f"{named}: {group.describe()}"
            result.groups.append(MadeGroup(group, kernel, absorbed, reads, made, dtype, line))
            members += plan.members
    if members:
        # Each call sits where its first member was; the re-sort moves it after an input
        # computed later (a residual), keeping every other node in its order.
        resort_stably(graph, {})
        for node in sorted(set(members), key=order.__getitem__, reverse=True):
            if not node.users:
                graph.erase_node(node)
        graph.lint()
    return result


# ---- Finding the products


def _anchor(node: torch.fx.Node) -> _Anchor | None:
    """The product ``node`` computes (an ``F.linear`` call, the ``addmm`` of a Conv1D
    between its views, a matmul by a matrix or its transpose), else None."""
    if _is_matmul(node) and len(node.args) == 2 and not node.kwargs:
        rows, right = node.args
        if not (isinstance(rows, torch.fx.Node) and isinstance(right, torch.fx.Node)):
            return None
        weight = _transposed(right)
        if weight is not None:  # x @ W.T: W stored [N, K], as F.linear's
            return _Anchor(node, rows, weight, None, "nk", [node, right], node)
        return _Anchor(node, rows, right, None, "kn", [node], node)
    if node.op != "call_function":
        return None
    if node.target is torch._C._nn.linear:
        args = list(node.args) + [None] * (3 - len(node.args))
        rows = node.kwargs.get("input", args[0])
        weight = node.kwargs.get("weight", args[1])
        bias = node.kwargs.get("bias", args[2])
        if not isinstance(rows, torch.fx.Node) or not isinstance(weight, torch.fx.Node):
            return None
        return _Anchor(node, rows, weight, bias, "nk", [node], node)
    if node.target is torch.addmm and len(node.args) == 3 and not node.kwargs:
        bias, flat, weight = node.args
        out = single_user(node)
        if not (_is_view(flat) and _is_view(out) and isinstance(weight, torch.fx.Node)):
            return None
        rows = flat.args[0]
        rows_value, flat_value = example_value(rows), example_value(flat)
        out_value, product = example_value(out), example_value(node)
        if not all(static_tensor(v) for v in (rows_value, flat_value, out_value, product)):
            return None
        # the views only flatten and restore the rows' lead dims
        if flat_value.dim() != 2 or flat_value.shape[-1] != rows_value.shape[-1]:
            return None
        if tuple(out_value.shape) != (*rows_value.shape[:-1], product.shape[-1]):
            return None
        return _Anchor(out, rows, weight, bias, "kn", [flat, node, out], node)
    return None


def _is_matmul(node: torch.fx.Node) -> bool:
    """``a @ b``, ``torch.matmul``, ``torch.mm`` or their method spellings."""
    if node.op == "call_method":
        return node.target in ("matmul", "mm")
    return node.op == "call_function" and node.target in (operator.matmul, torch.matmul, torch.mm)


def _transposed(node: Any) -> torch.fx.Node | None:
    """The matrix ``node`` is the transpose of (``w.T``, ``w.t()``, ``w.transpose(0, 1)``,
    ``torch.t(w)``, ``torch.transpose(w, -1, -2)``, ...), or None."""
    if not isinstance(node, torch.fx.Node) or node.kwargs or not node.args:
        return None
    source, target, rest = node.args[0], node.target, node.args[1:]
    value = example_value(source) if isinstance(source, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    method = node.op == "call_method"
    if node.op == "call_function" and target is getattr:
        found = rest in (("T",), ("mT",))
    elif (method and target == "t") or target is torch.t:
        found = rest == ()
    elif (method and target == "transpose") or target is torch.transpose:
        found = len(rest) == 2 and {d % 2 for d in rest if isinstance(d, int)} == {0, 1}
    else:
        found = False
    return source if found else None


def _is_view(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in (
        "view", "reshape",
    )  # fmt: skip


def _anchor_reason(anchor: _Anchor, usable: Callable[[torch.device], bool]) -> str | None:
    """Why this product cannot be (part of) a matmul group, or None."""
    xv, wv = example_value(anchor.rows), example_value(anchor.weight)
    if not (static_tensor(xv) and static_tensor(wv)):
        return "symbolic sizes"
    if xv.dtype not in _FLOATS or wv.dtype != xv.dtype:
        return f"dtypes {xv.dtype} x {wv.dtype}"
    out = example_value(anchor.product)
    if isinstance(out, torch.Tensor) and out.dtype != xv.dtype:
        # an autocast region: eager casts the operands first; the kernel would not (seen on
        # an H200: a fp32 product under fp16 autocast left validation's tolerance)
        return f"an autocast region ({xv.dtype} operands, a {out.dtype} result)"
    k_dim = 1 if anchor.layout == "nk" else 0
    if wv.dim() != 2 or xv.dim() < 1 or xv.shape[-1] != wv.shape[k_dim]:
        shape = "[N, K]" if anchor.layout == "nk" else "[K, N]"
        return f"not a [..., K] x {shape} product"
    if anchor.product.target is not torch._C._nn.linear and anchor.weight.op not in (
        "placeholder", "get_attr",
    ):  # fmt: skip
        # a matmul group streams weights that are the same tensors at every call; a product
        # of two activations (attention's scores and values) is left to cuBLAS
        return f"the right operand ({anchor.weight.name}) is computed in the graph, not a weight"
    if xv.device != wv.device or not usable(xv.device):
        return f"no Triton on {xv.device}"
    rows = math.prod(xv.shape[:-1])
    if rows > MAX_ROWS:
        return f"{rows} rows (> {MAX_ROWS}): cuBLAS"
    if rows == 0 or wv.numel() == 0:
        return "empty"
    if wv.numel() >= 2**31:  # the kernel's weight offsets are 32-bit
        return f"a weight of {wv.numel()} elements (>= 2**31): cuBLAS"
    if anchor.bias is not None:
        bias = anchor.bias
        bv = example_value(bias) if isinstance(bias, torch.fx.Node) else None
        width = wv.shape[1 - k_dim]
        if not (static_tensor(bv) and tuple(bv.shape) == (width,) and bv.dtype == xv.dtype):
            return "bias is not a [N] tensor of the input's dtype"
        if bv.device != xv.device:
            return "bias on another device"
    return None


# ---- Prologue and epilogue


def _plan(siblings: list[_Anchor], whole: bool) -> _Plan:
    """What to fuse around ``siblings``; ``whole``: they are every grouped product of their
    rows (a prologue may replace the rows only then)."""
    plan = _Plan(list(siblings))
    if len(siblings) == 2:
        gated = _gate(siblings)
        if gated is not None:
            plan.anchors, plan.gate, product, extra = gated
            plan.replaced = [product]
            plan.members += extra + [product]
    if len(siblings) == 1:
        chunked = _chunked_gate(siblings[0])
        if chunked is not None:
            plan.gate, plan.gate_half, product, extra = chunked
            plan.replaced = [product]
            plan.members += extra + [product]
    if len(siblings) == 1 and not plan.replaced:
        activated = activation_of(siblings[0].output)
        if activated is not None:
            plan.activation, product, extra = activated
            plan.replaced = [product]
            plan.members += extra
    if len(siblings) == 1 and not plan.replaced:
        tail = _lowered_tail(siblings[0].output)
        if tail is not None:
            plan.epilogue, last, nodes = tail
            plan.replaced = [last]
            plan.members += nodes
    if len(siblings) == 1 and not plan.replaced:
        added = _residual(siblings[0].output)
        if added is not None:
            plan.residual, add, aliases = added
            plan.replaced = [add]
            plan.members += aliases + [add]
            tail = _lowered_tail(add)
            if tail is not None:
                plan.residual_tail, last, nodes = tail
                plan.replaced = [last]
                plan.members += nodes
    if not plan.replaced:
        plan.replaced = [a.output for a in plan.anchors]
    plan.members += [n for a in plan.anchors for n in a.nodes]
    x = siblings[0].rows
    if whole and set(x.users) <= {a.nodes[0] for a in siblings}:
        passed = _pass_through(x)
        source = passed[-1]
        plan.norm = layer_norm_of(source) or rms_norm_of(source) or offset_rms_norm_of(source)
        if plan.norm is not None:
            plan.members += plan.norm.nodes + passed[:-1]
    return plan


def _lowered_tail(
    y: torch.fx.Node,
) -> tuple[RowProgram, torch.fx.Node, list[torch.fx.Node]] | None:
    """(the program, its last node, its nodes) of the elementwise ops of ``y`` alone after
    it (``activations.elementwise_tail``, lowered as a row group's members), or None."""
    tail = elementwise_tail(y)
    program = lower_tail(y, tail[1]) if tail else None
    return None if program is None else (program, *tail)


def _pass_through(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and the values it stands for unchanged, to the first that is not: through
    slices and views that keep all of a value of one user in its shape and strides
    (transformers' ``hidden_states[:, slice(-logits_to_keep, None), :]`` before the LM
    head at one position, GPT-2's ``view(-1, T, D)`` before it)."""
    chain = [node]
    while True:
        source = _unchanged_source(chain[-1])
        if source is None or len(source.users) != 1:
            return chain
        chain.append(source)


def _unchanged_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The value ``node`` is a no-op slice or view of (same shape, strides and offset), or
    None."""
    is_slice = node.op == "call_function" and node.target is operator.getitem
    if not (is_slice or _is_view(node)):
        return None
    source = node.args[0]
    if not isinstance(source, torch.fx.Node):
        return None
    before, after = example_value(source), example_value(node)
    if not (static_tensor(before) and static_tensor(after)) or before.shape != after.shape:
        return None
    if before.stride() != after.stride() or after.storage_offset() != before.storage_offset():
        return None
    return source


def _gate(siblings: list[_Anchor]) -> tuple[list[_Anchor], str, torch.fx.Node, list] | None:
    """([gate, up], activation, the product node, [the activation node]) when the two
    products' only use is ``act(gate) * up``."""
    for gate, up in (siblings, siblings[::-1]):
        found = _gated_product(gate.output, up.output)
        if found is not None:
            name, act, product = found
            return [gate, up], name, product, [act]
    return None


def _chunked_gate(anchor: _Anchor) -> tuple[str, int, torch.fx.Node, list] | None:
    """(activation, the gate's half, the product node, [chunk, halves, activation]) when the
    product's only use is ``g, u = y.chunk(2, -1)`` then ``act(g) * u`` (Phi-3's gate_up_proj;
    either half may be the gate)."""
    chunk = single_user(anchor.output)
    if chunk is None or chunk.op != "call_method" or chunk.target != "chunk":
        return None
    value = example_value(anchor.output)
    parts, dim = (list(chunk.args[1:]) + list(chunk.kwargs.values()) + [None])[:2]
    if parts != 2 or dim not in (-1, value.dim() - 1) or value.shape[-1] % 2:
        return None
    halves = {n.args[1]: n for n in chunk.users if n.target is operator.getitem}
    if len(chunk.users) != 2 or set(halves) != {0, 1}:
        return None
    for gate_half in (0, 1):
        found = _gated_product(halves[gate_half], halves[1 - gate_half])
        if found is not None:
            name, act, product = found
            return name, gate_half, product, [chunk, *halves.values(), act]
    return None


def _gated_product(
    gate: torch.fx.Node, up: torch.fx.Node
) -> tuple[str, torch.fx.Node, torch.fx.Node] | None:
    """(activation, its node, the product node) when ``gate``'s only use is a silu or gelu
    whose only use is its product with ``up``, ``up``'s only use (in gate's dtype)."""
    act = single_user(gate)
    call = op_call(act, "silu", "gelu")
    if call is None or call.params.get("inplace"):
        return None
    product = single_user(act)
    mul = op_call(product, "mul")
    if mul is None or single_user(up) is not product or set(mul.operands) != {act, up}:
        return None
    if example_value(product).dtype != example_value(gate).dtype:
        return None
    name = kernel_activation_name(call)
    return (name, act, product) if name else None


def _residual(
    output: torch.fx.Node,
) -> tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]] | None:
    """(residual, the add node, eval-mode dropouts between) when the product's only use is
    ``product + residual`` (through dropouts outside training, which return their input)."""
    aliases: list[torch.fx.Node] = []
    value, add = output, single_user(output)
    while add is not None and _is_eval_dropout(add):
        aliases.append(add)
        value, add = add, single_user(add)
    call = op_call(add, "add")
    if call is None or call.params.get("alpha", 1) != 1 or len(call.operands) != 2:
        return None
    a, b = call.operands
    other = b if a is value else a
    if other is value or not isinstance(other, torch.fx.Node):
        return None
    y, r, out = example_value(output), example_value(other), example_value(add)
    if not (static_tensor(r) and r.shape == y.shape and r.dtype == y.dtype == out.dtype):
        return None
    if r.device != y.device:
        return None
    return other, add, aliases


def _is_eval_dropout(node: torch.fx.Node) -> bool:
    call = op_call(node, "dropout")
    return (
        call is not None and call.op.check(call.params) is None and not call.params.get("inplace")
    )


def _inputs(plan: _Plan) -> list[torch.fx.Node]:
    """The graph values the launch reads."""
    values: list[Any] = [plan.norm.rows if plan.norm else plan.anchors[0].rows]
    if plan.norm is not None:
        values += [plan.norm.weight, plan.norm.bias]
    values.append(plan.residual)
    for anchor in plan.anchors:
        values += [anchor.weight, anchor.bias]
    return [v for v in values if isinstance(v, torch.fx.Node)]


def _hazard(plan: _Plan, order: dict[torch.fx.Node, int]) -> str | None:
    """Why ``plan`` cannot become one launch, or None: a write inside its span, or an input
    computed from one of its members."""
    members = set(plan.members)
    start = min(members, key=order.__getitem__)
    end = max(members, key=order.__getitem__)
    first = order[start]
    for node in nodes_between(start, end) if start is not end else ():
        if node not in members and is_mutation(node):
            return f"{node.name} writes inside the group's span"
    for value in _inputs(plan):
        stack, seen = [value], set()
        while stack:
            node = stack.pop()
            if node in members:
                return f"input {value.name} depends on the group"
            if node in seen or order.get(node, -1) < first:
                continue
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return None


def _rewrite(
    graph: torch.fx.Graph, plan: _Plan, launch: Callable[..., Any]
) -> tuple[MatmulGroup, str]:
    """The group's call in place of its members' outputs: (its group, the launch's name)."""
    norm, anchors = plan.norm, plan.anchors
    biases = [a.bias for a in anchors]
    group = MatmulGroup(
        # a chunked pair: one weight (and bias) given, which the launch splits in halves
        siblings=2 if plan.gate_half is not None else len(anchors),
        norm=norm.kind if norm else "",
        eps=norm.eps if norm else 0.0,
        norm_bias=bool(norm and norm.bias is not None),
        gate=plan.gate,
        bias=biases[0] is not None,
        residual=plan.residual is not None,
        weight_layout=anchors[0].layout,
        chunked=plan.gate_half is not None,
        gate_half=plan.gate_half or 0,
        activation=plan.activation,
        epilogue=plan.epilogue,
        residual_tail=plan.residual_tail,
    )

    rows = norm.rows if norm else anchors[0].rows
    args = (
        rows, norm.weight if norm else None, norm.bias if norm else None, plan.residual,
        *(a.weight for a in anchors), *(biases if group.bias else []),
    )  # fmt: skip
    op = launch(group)
    with graph.inserting_before(anchors[0].nodes[0]):
        fused = graph.call_function(op, args)
        fused.meta["example_value"] = tuple(example_value(n) for n in plan.replaced)
        for k, replaced in enumerate(plan.replaced):
            output = graph.call_function(operator.getitem, (fused, k))
            output.meta["example_value"] = example_value(replaced)
            replaced.replace_all_uses_with(output)
    return group, getattr(op, "__name__", "matmul_group")
