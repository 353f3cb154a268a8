"""Work that reads only parameters and buffers, done once instead of every call (fused graph).

A model can compute from its weights alone on every call: Swin's relative position bias gathers
its table by a buffer of indices and copies it into the heads' layout in each block (two
kernels a block, 24 a call in Swin-T, for the same values every time); a weight-normed conv
rescales its weight; a dequantized weight is scaled. Such a value is a derived constant, as a
folded BatchNorm is: computed at compile time from the first call's parameters into a tensor
the fused graph owns (``get_attr``), and computed again into the same tensor by ``Refresh``
when a parameter or buffer it reads changes (an in-place edit, ``load_state_dict``), so
captured graphs stay valid. The unfused graph (fallback and validation reference) keeps the
work.

Folded: the last node of a chain whose inputs are all parameters or buffers the graph does not
write (and constants built from Python values, ``passes/constants.py``: GPT-J gathers its
sine table by constant position ids at static lengths, splits it and repeats each column
twice, a gather and four repeats a layer), where the chain launches a kernel of its own: it
holds an op that no row group takes in (a gather, a copy, a matmul), or it feeds only such
ops. Views after it stay in the graph and
read the derived tensor; chains of views alone (a transposed weight) and elementwise chains
that a row group takes in (Gemma's ``1 + weight``) are left as they are. Random ops, in-place
ops, values the graph writes into later and symbolic shapes are never folded; a derived tensor
over ``MAX_BYTES`` or whose elements share memory (an expand) is not made.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch import Tensor

from fusebackend.passes.constants import CONSTANT_PREFIX, RngStates, is_random
from fusebackend.passes.embedding_fusion import is_embedding
from fusebackend.passes.fx_util import (
    example_value,
    placeholders,
    reaches_output,
    readers_through,
    static_fake,
    static_tensor,
)
from fusebackend.passes.graph import is_mutation
from fusebackend.passes.mutations import storage_id, written_storages
from fusebackend.passes.ops import lookup_op

__all__ = ["MAX_BYTES", "ParameterWork", "fold_parameter_work"]

# The attribute names of the derived tensors start with this (the fused graph's get_attrs).
PREFIX = "_infinifuse_parameter_work_"
# A derived tensor larger than this is not made (it would hold a second copy of a weight).
MAX_BYTES = 64 << 20

_VIEW_METHODS = {"view", "reshape", "unsqueeze", "squeeze", "permute", "transpose", "t",
                 "expand", "expand_as", "flatten", "unflatten", "view_as", "reshape_as",
                 "movedim", "swapaxes", "detach", "split", "tensor_split", "chunk",
                 "unbind"}  # fmt: skip
_VIEW_FUNCTIONS = {torch.reshape, torch.unsqueeze, torch.squeeze, torch.permute,
                   torch.transpose, torch.t, torch.flatten, torch.movedim, torch.swapaxes,
                   torch.detach, torch.split, torch.tensor_split, torch.chunk,
                   torch.unbind}  # fmt: skip


@dataclasses.dataclass
class ParameterWork:
    """One folded chain: a derived constant (the protocol ``batch_norm_folding.Refresh``
    runs: ``sources``, ``eps_source``, ``derive``).

    Attributes:
        name: The folded node's name (for reports).
        sources: Graph input index of each parameter or buffer the chain reads.
        chain: The chain as a module of its own, called with those inputs in that order.
        buffer: The derived tensor (the folded node's value), which the fused graph reads.
    """

    name: str
    sources: tuple[int, ...]
    chain: torch.fx.GraphModule
    buffer: Tensor
    eps_source: None = None

    def derive(self, inputs: Sequence[Any]) -> None:
        with torch.no_grad():
            self.buffer.copy_(self.chain(*[inputs[i] for i in self.sources]))


def _is_view(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target in _VIEW_FUNCTIONS:
        return True
    if node.target is operator.getitem:  # a slice is a view, an index tensor a gather
        return not any(isinstance(a, torch.fx.Node) for a in _flat(node.args[1:]))
    return False


def _static_values(value: Any) -> bool:
    """A tensor of static shape, or a tuple of them (a ``split``'s parts)."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return bool(values) and all(static_tensor(v) for v in values)


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flat(item)]
    return [value]


def _launches(node: torch.fx.Node) -> bool:
    """Does ``node`` run a kernel that no row group would take in? (Views and a constant's
    ``get_attr`` run none; the op table's ops and embedding lookups fuse into the group of
    what reads them: a position embedding's lookup by constant positions stays there.)"""
    if node.op not in ("call_function", "call_method") or _is_view(node):
        return False
    return lookup_op(node.op, node.target) is None and not is_embedding(node)


def fold_parameter_work(
    graph: torch.fx.Graph,
    owner: torch.nn.Module,
    inputs: Sequence[Any],
    is_state: Callable[[Any], bool],
) -> list[ParameterWork]:
    """Fold each chain of work on parameters and buffers alone (module docstring) into a
    derived tensor set on ``owner``; returns the chains folded."""
    # (zip: the signature constants pass appends placeholders after the example inputs, for
    # per-signature values that are never parameters)
    index = dict(zip(placeholders(graph), range(len(inputs))))
    written = written_storages(graph.nodes)
    fixed: set[torch.fx.Node] = {
        p for p, i in index.items()
        if is_state(inputs[i]) and storage_id(example_value(p)) not in written
    }  # fmt: skip
    fixed |= {
        n for n in graph.nodes
        if n.op == "get_attr" and str(n.target).startswith(CONSTANT_PREFIX)
        and storage_id(example_value(n)) not in written
    }  # fmt: skip
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method") or not node.all_input_nodes:
            continue
        if is_random(node) or is_mutation(node) or not _static_values(example_value(node)):
            continue
        if _written(node, written):
            continue  # written later in the call (BEiT's relative_coords[:, :, 0] += ...)
        if all(arg in fixed for arg in node.all_input_nodes):
            fixed.add(node)
    candidates = [
        n for n in graph.nodes
        if n in fixed and n.op not in ("placeholder", "get_attr") and not _is_view(n)
        and isinstance(example_value(n), Tensor)  # (a split's parts are views of a tensor)
        and any(u not in fixed or _is_view(u) for u in n.users)
    ]  # fmt: skip
    folded: list[ParameterWork] = []
    budget = MAX_BYTES
    erased: set[torch.fx.Node] = set()
    for node in reversed(candidates):  # the outermost first: it takes the chains inside it
        if node in erased or reaches_output(node, _is_view):
            continue  # (a graph output must not be a tensor the backend owns)
        chain = _ancestors(node, fixed)
        readers = readers_through(node, _is_view)
        if not any(_launches(n) for n in chain) and not all(map(_launches, readers)):
            continue  # elementwise work that the row group of its reader takes in
        value = example_value(node)
        size = value.numel() * value.element_size()
        if size > budget or _overlaps_itself(value):
            continue  # (an expanded value: transformers' inv_freq[None, :, None].expand(B, ...))
        work = _fold(graph, owner, node, chain, index, inputs)
        if work is None:
            continue
        budget -= size
        folded.append(work)
        for dead in reversed(chain):  # what only the folded node read
            if not dead.users:
                graph.erase_node(dead)
                erased.add(dead)
    return folded[::-1]


def _written(node: torch.fx.Node, written: set[int]) -> bool:
    """Does the graph write into ``node``'s value (or a part of a tuple of them)? Folded, it
    would be read as it was before the write: the chain copied for ``derive`` holds no write."""
    values = example_value(node)
    values = values if isinstance(values, (tuple, list)) else (values,)
    return any(isinstance(v, Tensor) and storage_id(v) in written for v in values)


def _overlaps_itself(value: Tensor) -> bool:
    """Do elements of ``value`` share memory (an expand's stride 0)? A buffer with its
    strides cannot be written."""
    return any(stride == 0 and size > 1 for size, stride in zip(value.shape, value.stride()))


def _ancestors(node: torch.fx.Node, fixed: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """``node`` and the computed nodes it depends on, in graph order."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen or current.op == "placeholder":  # (a constant's get_attr is copied)
            continue
        seen.add(current)
        stack.extend(a for a in current.all_input_nodes if a in fixed)
    return [n for n in node.graph.nodes if n in seen]


def _fold(
    graph: torch.fx.Graph, owner: torch.nn.Module, node: torch.fx.Node,
    chain: list[torch.fx.Node], index: dict[torch.fx.Node, int], inputs: Sequence[Any],
) -> ParameterWork | None:  # fmt: skip
    """``node``'s value as a derived tensor read by a new ``get_attr``; None where the chain
    does not run on the real inputs as traced (then nothing changes)."""
    reads = sorted({a for n in chain for a in n.all_input_nodes if a.op == "placeholder"},
                   key=lambda p: index[p])  # fmt: skip
    standalone = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {p: standalone.placeholder(p.name) for p in reads}
    for n in chain:
        env[n] = standalone.node_copy(n, lambda arg: env[arg])
    standalone.output(env[node])
    value = example_value(node)
    work = ParameterWork(node.name, tuple(index[p] for p in reads),
                         torch.fx.GraphModule(owner, standalone), torch.empty(0))  # fmt: skip
    rng = RngStates()
    try:
        with torch.no_grad():
            result = work.chain(*[inputs[index[p]] for p in reads])
    except Exception:  # noqa: BLE001 - a chain the real tensors do not run: left as traced
        rng.restore_if_moved()
        return None
    if rng.restore_if_moved():  # it drew random numbers (an op not named so): left as traced
        return None
    if not isinstance(result, Tensor) or result.shape != value.shape or result.dtype != value.dtype:
        return None
    work.buffer = torch.empty_strided(tuple(value.shape), tuple(value.stride()),
                                      dtype=value.dtype, device=result.device)  # fmt: skip
    work.buffer.copy_(result)
    attr = f"{PREFIX}{node.name}"
    setattr(owner, attr, work.buffer)
    with graph.inserting_before(node):
        constant = graph.get_attr(attr)
    constant.meta["example_value"] = static_fake(value, work.buffer)
    node.replace_all_uses_with(constant)
    return work
