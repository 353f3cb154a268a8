"""Batched-matmul operands as cuBLAS takes them: copied once where they come from, and
scaled in the product.

**Copied once** (``copy_matmul_operands_once``, before ``find_groups``). ``q @ k`` on
operands of 3 or more dims runs as one ``bmm`` over their batch dims merged into one. Where
an operand's batch dims cannot merge, or neither of its matrix dims has a unit stride,
``torch.matmul`` first copies it to a contiguous tensor: a copy kernel inside the matmul
that no pass sees. Attention written by hand over a packed q/k/v projection does this for
each of q, k and v:

- LeViT: ``qkv.view(B, N, heads, -1).split([kd, kd, vd], dim=3)``, then each piece permuted
  to (B, heads, ...): batch strides (N * heads * c, c) do not merge;
- Swin: ``qkv.reshape(B, N, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)``.

LeViT-128S at batch 8 ran 40 such copies a call (H200, efca184: 91 of its 522 us of kernel
time). Where two or more operands are views of one value, one copy of that value in a
chosen dim order makes all of them ready for ``bmm``::

    value.permute(order).contiguous().permute(inverse_order)

takes the value's place under those views: the same shape and elements in another layout,
so the graph computes what it did, with one copy instead of one per operand. The order is
the first permutation of the value's dims (the identity first) under which every operand,
its views replayed on a tensor of that layout, merges its batch dims and has a unit-stride
matrix dim. The nodes below get example values with their new strides (a view's, and an
elementwise op's output, which follows its input's layout: Swin's ``q * scale``).

Left as traced: operands of 2 dims or fewer on either side (``x @ W`` folds its batch into
rows), sizes that are not plain ints, views other than splits, picks and permutes between
the value and the operand, values of more than 6 dims, and a value only one operand reads
(one copy either way).

**Scaled in the product** (``scale_in_matmuls``, after the copies). Attention written by
hand scales q before its product with k: Swin's ``(q * self.scale) @ k.transpose(-2, -1)``.
The scaled q is a tensor of its own: one more elementwise kernel a block that reads and
writes q (Swin-T: 12 a call), where nothing else joins it. cuBLAS scales a product in fp32
before its one rounding (``alpha``), so the product runs as
``torch.baddbmm(ignored, q, k, beta=0, alpha=scale)`` over q and k viewed as (batch, rows,
cols); ``beta=0`` reads nothing of its first argument (a 1 x 1 x 1 view of q). Eager rounds
q * scale to q's dtype before the product; here the product is scaled and rounded once.
Left as traced: a scale that is a tensor or a symbol, a scaled operand read elsewhere too,
operands whose batch dims differ (broadcast) or that are not ready for bmm, and dtypes other
than floating point.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
import torch.fx

from fusebackend.passes.fx_util import call_evaluated, evaluate, example_value, static_layout

__all__ = ["copy_matmul_operands_once", "scale_in_matmuls", "scaled_by_number"]

_MATMULS = {operator.matmul, torch.matmul}
# Views that keep every dim of their input or drop or reorder some: the chains replayed here.
_VIEW_METHODS = {"permute", "transpose", "t", "split", "unbind", "chunk", "select", "narrow",
                 "unsqueeze", "squeeze", "expand", "movedim"}  # fmt: skip
_VIEW_FUNCTIONS = {torch.permute, torch.transpose, torch.t, torch.split, torch.unbind,
                   torch.chunk, torch.select, torch.narrow, torch.unsqueeze, torch.squeeze,
                   torch.movedim, operator.getitem}  # fmt: skip
_MAX_DIMS = 6  # 720 orders at most, tried until one serves


def copy_matmul_operands_once(graph: torch.fx.Graph) -> list[str]:
    """Give the operands of batched matmuls that would each be copied one copy of the value
    they are views of (module docstring); returns the names of the copies made."""
    chains_from: dict[torch.fx.Node, dict[torch.fx.Node, list[torch.fx.Node]]] = {}
    for node in graph.nodes:
        for operand, chain in _copied_operands(node):
            chains_from.setdefault(chain[0], {})[operand] = chain
    made = []
    for chains in chains_from.values():
        if len(chains) >= 2:
            copy = _copy_once(graph, list(chains.values()))
            if copy is not None:
                made.append(copy.name)
    if made:
        graph.lint()
    return made


def _is_view(node: Any) -> bool:
    """A view op of the chains handled here, its first argument the viewed tensor and its
    others constants."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return False
    if node.op == "call_method":
        known = node.target in _VIEW_METHODS
    else:
        known = node.op == "call_function" and node.target in _VIEW_FUNCTIONS
    inputs: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args[1:], node.kwargs), inputs.append)
    return known and not inputs


def _copied_operands(node: torch.fx.Node) -> list[tuple[torch.fx.Node, list[torch.fx.Node]]]:
    """The operands of ``node`` (a batched matmul) that ATen would copy, each with its chain
    of views from the value they view: [value, view, ..., operand]."""
    if not (node.op == "call_function" and node.target in _MATMULS and len(node.args) == 2):
        return []
    values = [example_value(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
    if not all(static_layout(v) and v.dim() >= 3 for v in values):
        return []
    batch = torch.broadcast_shapes(values[0].shape[:-2], values[1].shape[:-2])
    found = []
    for operand, value in zip(node.args, values, strict=True):
        if _bmm_ready(_meta(value), batch):
            continue
        chain = [operand]
        while _is_view(chain[0]) and isinstance(chain[0].args[0], torch.fx.Node):
            chain.insert(0, chain[0].args[0])
        if len(chain) > 1 and static_layout(example_value(chain[0])):
            found.append((operand, chain))
    return found


def _meta(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def _bmm_ready(value: torch.Tensor, batch: torch.Size) -> bool:
    """Would ``torch.matmul`` pass ``value`` (a meta tensor) to bmm uncopied: its batch dims,
    broadcast to ``batch``, merge into one by a view, and one of its matrix dims has a unit
    stride and the other a leading dim cuBLAS takes?"""
    rows, cols = value.shape[-2:]
    try:
        merged = value.expand(*batch, rows, cols).view(-1, rows, cols)
    except RuntimeError:
        return False
    row_stride, col_stride = merged.stride()[1:]
    if col_stride == 1 and row_stride >= max(1, cols):
        return True
    return row_stride == 1 and col_stride >= max(1, rows)


def _copy_once(graph: torch.fx.Graph, chains: list[list[torch.fx.Node]]) -> torch.fx.Node | None:
    """One copy of the deepest value all ``chains`` view, in the first dim order that makes
    every chain's operand ready for bmm; None where there is none."""
    shared = 0
    while all(len(c) > shared + 1 and c[shared] is chains[0][shared] for c in chains):
        shared += 1
    while shared and not isinstance(example_value(chains[0][shared - 1]), torch.Tensor):
        shared -= 1  # a split's pieces: copy what it splits
    if not shared:
        return None
    value = chains[0][shared - 1]
    tail = {n for c in chains for n in c[shared:]}
    example = example_value(value)
    if example.dim() > _MAX_DIMS or example.dim() < 2:
        return None
    for order in itertools.permutations(range(example.dim())):
        if _serves(value, order, chains, tail):
            return _insert_copy(graph, value, order, tail)
    return None


def _layout(example: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """A meta tensor of ``example``'s shape whose dims lie in memory in ``order`` (outermost
    first)."""
    contiguous = torch.empty([example.shape[d] for d in order], dtype=example.dtype,
                             device="meta")  # fmt: skip
    return contiguous.permute([order.index(d) for d in range(example.dim())])


def _serves(value: torch.fx.Node, order: tuple[int, ...], chains: list[list[torch.fx.Node]],
            tail: set[torch.fx.Node]) -> bool:  # fmt: skip
    """Does every chain's operand, its views replayed on ``value`` laid out in ``order``,
    go to bmm uncopied?"""
    replayed = {value: _layout(example_value(value), order)}
    try:
        for node in _graph_order(tail):
            replayed[node] = evaluate(node, lambda a: replayed.get(a, example_value(a)))
    except (RuntimeError, TypeError):
        return False
    for chain in chains:
        operand = chain[-1]
        for matmul in operand.users:
            if not (matmul.op == "call_function" and matmul.target in _MATMULS):
                continue
            values = [replayed.get(a, example_value(a)) for a in matmul.args]
            batch = torch.broadcast_shapes(values[0].shape[:-2], values[1].shape[:-2])
            if not _bmm_ready(_meta(replayed[operand]), batch):
                return False
    return True


def _graph_order(nodes: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """``nodes`` in their graph's order."""
    if not nodes:
        return []
    every = next(iter(nodes)).graph.nodes
    return [n for n in every if n in nodes]


def _insert_copy(graph: torch.fx.Graph, value: torch.fx.Node, order: tuple[int, ...],
                 tail: set[torch.fx.Node]) -> torch.fx.Node:  # fmt: skip
    """``value.permute(order).contiguous().permute(inverse)`` read by ``value``'s readers
    in ``tail``; the example values of the views below it computed again."""
    inverse = tuple(order.index(d) for d in range(len(order)))
    with graph.inserting_after(value):
        permuted = graph.call_method("permute", (value, order))
    with graph.inserting_after(permuted):
        copy = graph.call_method("contiguous", (permuted,))
    with graph.inserting_after(copy):
        back = graph.call_method("permute", (copy, inverse))
    for node in (permuted, copy, back):
        node.meta["example_value"] = evaluate(node)
    for reader in [u for u in value.users if u in tail]:
        reader.replace_input_with(value, back)
    _refresh_below(back)
    return copy


def _refresh_below(start: torch.fx.Node) -> None:
    """Example values of the nodes below ``start`` computed again where an input's layout
    changed (views follow the new strides, and so does an elementwise op's output: q * scale
    of a contiguous q is contiguous), until the layouts are the traced ones again."""
    changed = {start}
    for node in _after(start):
        if not any(a in changed for a in node.all_input_nodes):
            continue
        if node.op not in ("call_function", "call_method") or _is_kernel(node.target):
            continue
        try:
            value = evaluate(node)
        except (RuntimeError, TypeError, NotImplementedError):
            continue  # an op that cannot run on fake tensors: its output is its own layout
        if not _same_layout(value, example_value(node)):
            node.meta["example_value"] = value
            changed.add(node)


def _is_kernel(target: Any) -> bool:
    """A kernel family's launcher (a matmul group's, ...): it allocates its own outputs, and
    is not run on fake tensors here."""
    return hasattr(target, "precompile_job")


def _after(start: torch.fx.Node) -> list[torch.fx.Node]:
    nodes, node = [], start.next
    while node.op != "root":
        nodes.append(node)
        node = node.next
    return nodes


def _same_layout(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(),
                                                             b.storage_offset())  # fmt: skip
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b)


# -- a scale by a number, applied in the product ---------------------------------------

_MULS = {operator.mul, torch.mul}
_DIVS = {operator.truediv, torch.div}


def scale_in_matmuls(graph: torch.fx.Graph) -> list[str]:
    """Each batched matmul whose operand is scaled by a Python number run as a baddbmm that
    scales the product (module docstring); returns the names of the scalings gone."""
    gone = []
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target in _MATMULS and len(node.args) == 2):
            continue
        for side in (0, 1):
            scaled = scaled_by_number(node.args[side])
            if scaled is None or len(node.args[side].users) != 1:
                continue
            operands = list(node.args)
            operands[side] = scaled[0]
            if _ready(operands):
                multiply = node.args[side]
                _as_baddbmm(graph, node, operands, scaled[1])
                graph.erase_node(multiply)
                gone.append(multiply.name)
                break
    if gone:
        graph.lint()
    return gone


def scaled_by_number(node: Any) -> tuple[torch.fx.Node, float] | None:
    """(x, s) where ``node`` is x * s, s * x or x / s with s a Python number; else None."""
    if not isinstance(node, torch.fx.Node) or node.kwargs or len(node.args) != 2:
        return None
    name = node.target if node.op == "call_method" else None
    is_mul = node.op == "call_function" and node.target in _MULS or name == "mul"
    is_div = node.op == "call_function" and node.target in _DIVS or name == "div"
    first, second = node.args
    if is_mul and isinstance(first, (int, float)) and isinstance(second, torch.fx.Node):
        first, second = second, first
    if not (is_mul or is_div) or not isinstance(first, torch.fx.Node):
        return None
    if isinstance(second, bool) or not isinstance(second, (int, float)) or second == 0:
        return None
    return first, float(second) if is_mul else 1.0 / float(second)


def _ready(operands: list[Any]) -> bool:
    values = [example_value(a) if isinstance(a, torch.fx.Node) else None for a in operands]
    if not all(static_layout(v) and v.dim() >= 3 and v.dtype.is_floating_point for v in values):
        return False
    a, b = values
    if a.dtype != b.dtype or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        return False
    batch = a.shape[:-2]
    return all(_bmm_ready(_meta(v), batch) for v in values)


def _as_baddbmm(graph: torch.fx.Graph, matmul: torch.fx.Node, operands: list[Any],
                scale: float) -> None:  # fmt: skip
    """``matmul`` replaced by ``baddbmm(ignored, a, b, beta=0, alpha=scale)`` on its operands
    viewed as (batch, rows, cols), viewed back to its shape."""
    a, b = operands
    shape = tuple(example_value(matmul).shape)
    with graph.inserting_before(matmul):
        a3 = call_evaluated(graph, torch.Tensor.view, (a, (-1, *example_value(a).shape[-2:])))
        b3 = call_evaluated(graph, torch.Tensor.view, (b, (-1, *example_value(b).shape[-2:])))
        ignored = call_evaluated(graph, operator.getitem, (a3, (slice(0, 1),) * 3))
        product = graph.call_function(torch.baddbmm, (ignored, a3, b3),
                                      {"beta": 0, "alpha": scale})  # fmt: skip
        product.meta["example_value"] = evaluate(product)
        result = call_evaluated(graph, torch.Tensor.view, (product, shape))
    matmul.replace_all_uses_with(result)
    graph.erase_node(matmul)
