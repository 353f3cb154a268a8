"""Partition a graph into row groups: seeds anywhere, growth downstream, reasons as values.

The pass works on Dynamo's own FX graph (torch-level ops, each node carrying its fake
``example_value``). Every node the op table knows (an elementwise op on floating tensors, a
reduction along the last dim, a norm, a softmax, a ``rotate_half``: passes/rotation.py, a
``torch.cat``: passes/concatenation.py) and every embedding lookup can seed a group, in
graph order. A group grows downstream, in graph order, through consumers the table knows, as
long as each consumer's other operands can be read by strides (numbers, tensors that
broadcast to its result, views of tensors computed outside the group) or are embedding
lookups, which then join the group (token + position + token-type tables become one kernel).
It also grows upstream, into an operand's producer when only the group reads it (``q * cos +
rotate_half(q) * sin`` seeded at ``q * cos`` takes ``rotate_half(q) * sin`` in; ``(x - mean)
/ sqrt(x.var() + eps)`` seeded at the mean takes the variance in). A value used outside the
group becomes one more output of the kernel. Where growth stops, the reason is kept for the
report.

Rules that keep the rewrite correct:
- no cycle: an operand computed from the group's own values stops the growth;
- no mutation inside the span of graph positions a group covers (FX data flow does not
  show what an in-place op changes, so order is preserved by position);
- results must be floating point, bool (comparisons, masks) or integers from the ops
  passes/integers.py lists (index arithmetic: position ids);
- one row width: every value is ``lead + [D]`` or ``lead + [1]`` for one D, and every
  reduction reduces rows of width D (or 1);
- a group replaces at least two ops (two kernels in eager); a lone op stays as it is,
  but for a lone LayerNorm (``_LONE_OPS_THAT_PAY``: aten's kernel reads short rows slowly).
"""

from __future__ import annotations

import heapq
import logging
import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fusebackend.passes.dtensor import is_dtensor
from fusebackend.passes.embedding_fusion import check_lookup, embedding_args, is_embedding
from fusebackend.passes.folded_copies import copy_folds_into
from fusebackend.passes.fx_util import example_value, vmapped_nodes
from fusebackend.passes.graph import is_mutation
from fusebackend.passes.groups import (
    Candidate,
    LoweredGroup,
    is_alias,
    is_graph_scalar,
    match,
    rotation_of,
)
from fusebackend.passes.integers import (
    integer_scalar_reason,
    operand_dtype_reason,
    result_dtype_reason,
)
from fusebackend.passes.ops import OpCall, OpKind, lookup_op, reduction_dim_reason
from fusebackend.passes.rotation import Rotation, match_rotation
from fusebackend.report import RejectionReport

# Candidate, LoweredGroup, is_alias and match live in groups.py (backend.py imports
# Candidate from here)
__all__ = ["Candidate", "LoweredGroup", "find_groups", "is_alias", "match"]

log = logging.getLogger(__name__)

_MIN_OPS = 2  # a group must replace at least this many ops (eager kernels) to pay
# Ops whose generated kernel beats aten's alone. A LayerNorm: 3.7 against aten's 28.4 us for
# 25088 x 96 fp16 rows (ConvNeXt-tiny's first stage at batch 8), faster at all nine shapes of
# 784-25088 rows x 96-768 (H200, 2026-11-28, benchmarks/row_kernels.py --patterns layernorm);
# a ConvNeXt-tiny batch-8 call's 23 LayerNorms went from 244.7 to 59.4 us.
_LONE_OPS_THAT_PAY = {"layer_norm"}
_OTHER_REDUCTIONS = {
    "max", "min", "prod", "norm", "group_norm", "batch_norm",
    "logsumexp", "cumprod", "argmax", "argmin", "any", "all", "var_mean", "std_mean",
}  # fmt: skip
_VIEW_NAMES = {
    "view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "flatten",
    "contiguous", "t", "__getitem__", "getitem", "narrow", "select", "unflatten", "view_as",
    "expand_as", "reshape_as", "movedim", "swapaxes",
}  # fmt: skip


def _scalar_param(call: OpCall, name: str, value: Any) -> bool:
    """A param that may be a graph number (dynamic shapes pass module attributes in as
    inputs): a norm's eps (a scalar argument of the kernel) and the ``p`` of a dropout
    outside training, which returns its input whatever ``p`` is."""
    if call.op.name == "dropout" and name == "p" or call.op.kind == OpKind.NORM and name == "eps":
        return is_graph_scalar(value)
    return False


def _takes_graph_scalar(call: OpCall, name: str) -> bool:
    """Can operand ``name`` of ``call`` be a number computed in the graph? In arithmetic
    (a float result) it is used as eager uses a Python number: in the op's compute dtype,
    fp32 for half and fp32 tensors (transformers' RMSNorm adds ``self.variance_epsilon``,
    a graph input under dynamic shapes). Comparisons round a number to the tensor's dtype
    first (``lowering._scalar_for``), which a value known only at run time cannot be."""
    if call.op.kind != OpKind.ELEMENTWISE or call.op.result != "float":
        return False
    return name not in call.op.bool_operands and call.op.name not in ("cast", "dropout")


def _concat_reason(part: torch.fx.Node) -> str:
    return (f"a concatenation of {part.name}, a value computed in the group: the kernel reads "
            "each part at its own address")  # fmt: skip


def _rotation_reason(source: torch.fx.Node) -> str:
    return (f"rotate_half of {source.name}, a value computed in the group: the kernel moves "
            "columns by loading an input at permuted offsets, and a computed value's other "
            "columns are in other threads' registers")  # fmt: skip


# --- growth ---------------------------------------------------------------------------


class _Grower:
    """Grows one group from a seed (a lookup or a table op), in graph order."""

    def __init__(self, pass_: _FusionPass, seed: torch.fx.Node) -> None:
        self.p = pass_
        self.seed = seed
        self.device = example_value(seed).device
        self.members: set[torch.fx.Node] = set()
        self.calls: dict[torch.fx.Node, OpCall] = {}
        self.parts: set[torch.fx.Node] = set()
        self.stops: list[RejectionReport] = []
        self.width: Any = None  # the row width D once a value has one (int or SymInt)
        self.shape: tuple[Any, ...] | None = None  # broadcast of every value's shape

    def start(self) -> str | None:
        """Take the seed in; a reason when it cannot start a group."""
        if is_embedding(self.seed):
            value = example_value(self.seed)
            reason = self._fit_shape(value.shape, ())
            if reason:
                return reason
            self.members.add(self.seed)
            return None
        result = self._try_absorb(self.seed)
        if isinstance(result, str):
            return result
        self.members.update(result)
        return None

    def grow(self) -> Candidate:
        seen: set[torch.fx.Node] = set()
        heap: list[tuple[int, torch.fx.Node]] = []

        def push_users(node: torch.fx.Node) -> None:
            for user in node.users:
                if user not in seen and user not in self.members:
                    seen.add(user)
                    heapq.heappush(heap, (self.p.position[user], user))

        for member in list(self.members):
            push_users(member)
        while heap:
            _, user = heapq.heappop(heap)
            result = self._try_absorb(user)
            if isinstance(result, str):
                self.stops.append(RejectionReport(user.name, result))
                continue
            for node in result:
                self.members.add(node)
                push_users(node)
        members = sorted(self.members, key=self.p.position.__getitem__)
        lookups = [m for m in members if m not in self.calls and m not in self.parts]
        return Candidate(lookups, members, self.calls, self.stops, parts=self.parts)

    def _try_absorb(self, user: torch.fx.Node) -> list[torch.fx.Node] | str:
        """The nodes to add for ``user`` (itself, new lookups, producers only the group
        reads and rotation parts), or why not."""
        if user.op == "output":
            return "graph output"
        if user in self.p.assigned:
            return f"consumer {user.name} belongs to another group"
        if user in self.p.part_of:
            cat = self.p.part_of[user]
            source = rotation_of(cat).source
            if source in self.members:
                return f"consumer {cat.name}: {_rotation_reason(source)}"
            return f"consumer {user.name} is part of the rotation {cat.name}"
        if is_mutation(user):
            return f"consumer {user.name} is an in-place op"
        call = match(user)
        if call is None:
            return f"consumer {user.name} is {_describe_kind(user)}"
        if isinstance(call, str):
            return f"consumer {user.name}: {call}"
        new_lookups: list[torch.fx.Node] = []
        reason = self._check_node(user, call, new_lookups)
        if reason:
            return f"consumer {user.name}: {reason}"
        saved = (self.width, self.shape)
        taken: dict[torch.fx.Node, OpCall] = {user: call}
        self._take_producers(user, call, taken, new_lookups)
        for upstream in (True, False):
            if not upstream:  # retry with the producers left outside, read as operands
                if len(taken) == 1:
                    break
                self.width, self.shape = saved
                taken, new_lookups = {user: call}, []
                # it passed above from the same shape state: this only redoes its lookups
                # and the group's shape
                self._check_node(user, call, new_lookups)
            reason = self._legal(user, taken, new_lookups)
            if reason is None:
                parts = [p for node, c in taken.items() if c.op.name == "rotate"
                         for p in rotation_of(node).parts]  # fmt: skip
                self.calls.update(taken)
                self.parts.update(parts)
                return [*taken, *new_lookups, *parts]
        return f"consumer {user.name}: {reason}"

    def _check_node(
        self,
        node: torch.fx.Node,
        call: OpCall,
        new_lookups: list[torch.fx.Node],
        upstream: bool = False,
    ) -> str | None:
        """Can ``node`` join (its result, operands and rows)? Lookups it reads that can be
        gathered are added to ``new_lookups``. ``upstream``: a producer only the group
        reads, which may be a 0-d number (T5's clamp bound ``where(flag, a, b)``), computed
        where the kernel reads it."""
        reason = self._check_result(node, call, upstream)
        if reason or node in self.p.batched:
            return reason or "inside torch.vmap (a batched tensor)"
        if call.op.kind == OpKind.MOVE:
            source = call.operands[0]
            if source in self.members:
                return _rotation_reason(source)
            parts = rotation_of(node).parts
            if any(p in self.p.assigned for p in parts):
                return "a part of the rotation belongs to another group"
        if call.op.kind == OpKind.CONCAT:
            return self._check_concat_parts(call) or self._check_rows(node, call)
        for name, operand in zip(call.op.operands, call.operands):
            reason = self._check_operand(call, name, operand, new_lookups)
            if reason:
                return reason
        if is_alias(call, node) and call.operands[0] not in (*self.members, *new_lookups):
            # eager returns the external tensor itself; a kernel output would be a copy. An
            # alias of a lookup the group gathers is that lookup's value (GPT-2's position
            # rows reach the add through ``.to(device)``).
            return f"a {call.op.name} that returns a tensor outside the group as it is"
        for name, value in call.params.items():
            if _contains_node(value) and not _scalar_param(call, name, value):
                return "a tensor argument in a non-operand position"
        reason = integer_scalar_reason(node, call, example_value(node).dtype)
        return reason or self._check_rows(node, call)

    def _reads_member(self, lookup: torch.fx.Node) -> bool:
        return embedding_args(lookup).get("input") in self.members

    def _check_concat_parts(self, call: OpCall) -> str | None:
        """A concatenation's parts are read where they lie: tensors computed outside the
        group (a value of the kernel sits in registers, not at an address to offset)."""
        for part in call.operands:
            if part in self.members:
                return _concat_reason(part)
            # an operand's checks (device, strides, floating dtype); a lookup stays an input
            reason = self._check_operand(call, "tensors", part, [])
            if reason:
                return reason
        return None

    def _take_producers(
        self,
        consumer: torch.fx.Node,
        call: OpCall,
        taken: dict[torch.fx.Node, OpCall],
        new_lookups: list[torch.fx.Node],
    ) -> None:
        """Upstream growth: take in each operand of ``consumer`` computed outside the group
        by a table op whose every user is in the group (so it needs no output of its own),
        and recursively its producers. One that cannot join stays an operand; a
        concatenation's parts always do."""
        if call.op.kind == OpKind.CONCAT:
            return
        for operand in call.operands:
            if not isinstance(operand, torch.fx.Node) or operand in taken:
                continue
            if operand in self.members or operand in self.p.assigned or operand in new_lookups:
                continue
            if operand in self.p.part_of or is_mutation(operand) or is_embedding(operand):
                continue
            if any(u not in taken and u not in self.members for u in operand.users):
                continue
            producer = match(operand)
            if not isinstance(producer, OpCall):
                continue
            saved, lookups = (self.width, self.shape), list(new_lookups)
            if self._check_node(operand, producer, lookups, upstream=True):
                self.width, self.shape = saved
                continue
            taken[operand] = producer
            new_lookups[:] = lookups
            self._take_producers(operand, producer, taken, new_lookups)

    def _legal(
        self,
        user: torch.fx.Node,
        taken: dict[torch.fx.Node, OpCall],
        new_lookups: list[torch.fx.Node],
    ) -> str | None:
        """No cycle through nodes outside the group, no mutation inside its span. Lookups
        that would close a cycle stay outside (read as operands) when that helps."""
        nodes = {*self.members, *taken}
        outside = self.p.path_outside(nodes | set(new_lookups))
        if outside is not None and new_lookups:
            new_lookups.clear()
            outside = self.p.path_outside(nodes)
        if outside is not None:
            return (f"{outside.name} is computed from the group's own values and feeds the "
                    "group (a cycle)")  # fmt: skip
        mutation = self.p.mutation_between([*taken, *new_lookups, *self.members])
        if mutation is not None:
            return f"the in-place op {mutation} lies inside the group"
        for node, call in {**self.calls, **taken}.items():
            if call.op.kind == OpKind.CONCAT:
                inside = [p for p in call.operands if p in nodes or p in new_lookups]
                if inside:
                    return f"{node.name}: {_concat_reason(inside[0])}"
        return None

    def _check_result(self, user: torch.fx.Node, call: OpCall, upstream: bool) -> str | None:
        value = example_value(user)
        if not isinstance(value, torch.Tensor):
            return "result is not a tensor"
        if is_dtensor(value):
            # A DTensor has no storage of its own for a kernel to read (tensor parallelism:
            # its arithmetic runs through DTensor's dispatch, as traced).
            return "result is a DTensor (DTensor dispatch runs as traced)"
        if value.device != self.device:
            return f"result on {value.device}, group on {self.device}"
        if value.device.type not in ("cuda", "cpu"):
            return f"device {value.device} is not supported"
        reason = result_dtype_reason(call, value.dtype)
        if reason:
            return reason
        if value.dim() == 0 and not (upstream and call.op.kind == OpKind.ELEMENTWISE):
            # (a 0-d value a group computes for itself is broadcast like a 0-d operand; one
            # of its own would be an output of another shape than the kernel's rows)
            return "result is 0-d"
        return None

    def _check_rows(self, user: torch.fx.Node, call: OpCall) -> str | None:
        """Reductions reduce the last dim; every value keeps the group's row width."""
        value = example_value(user)
        reduced: tuple[torch.Size, ...] = ()
        if call.op.kind not in (OpKind.ELEMENTWISE, OpKind.CONCAT):
            source = example_value(call.operands[0])
            if source.dim() == 0:
                return f"{call.op.name} of a 0-d tensor"
            if call.op.kind in (OpKind.REDUCTION, OpKind.SOFTMAX, OpKind.SCAN):
                reason = reduction_dim_reason(call.params, source.dim())
                if reason:
                    return reason
            elif call.op.kind == OpKind.NORM:
                (size,) = call.params["normalized_shape"]
                if not _same_size(size, source.shape[-1]):
                    return f"normalizes {size} elements of rows {source.shape[-1]} wide"
                for extra in call.operands[1:]:
                    if isinstance(extra, torch.fx.Node) and example_value(extra).dim() != 1:
                        return f"{call.op.name}'s {extra.name} is not 1-d"
            reduced = (source.shape,)
        return self._fit_shape(value.shape, reduced)

    def _fit_shape(self, shape: torch.Size, reduced: tuple[torch.Size, ...]) -> str | None:
        widths = [shape[-1] if len(shape) else 1] + [s[-1] for s in reduced]
        width = self.width
        for size in widths:
            if _is_one(size):
                continue
            if width is None:
                width = size
            elif not _same_size(size, width):
                return f"rows {size} wide in a group of rows {width} wide"
        group = _broadcast(self.shape, shape) if self.shape is not None else tuple(shape)
        if group is None:
            return f"shape {tuple(shape)} does not broadcast with the group's {self.shape}"
        self.width, self.shape = width, group
        return None

    def _check_operand(
        self, call: OpCall, name: str, operand: Any, new_lookups: list[torch.fx.Node]
    ) -> str | None:
        wants_bool = name in call.op.bool_operands
        if operand is None:
            return None if name in call.op.optional else f"operand {name} is None"
        if isinstance(operand, bool) or _is_real_number(operand):
            if wants_bool:
                return f"{name} must be a tensor"
            if call.op.kind != OpKind.ELEMENTWISE and name == "input":
                return f"{call.op.name} of a number"
            return None
        if not isinstance(operand, torch.fx.Node):
            return f"operand {name} is a {type(operand).__name__}"
        if operand in self.members:
            dtype = example_value(operand).dtype
        else:
            value = example_value(operand)
            if not isinstance(value, torch.Tensor):
                if is_graph_scalar(operand) and _takes_graph_scalar(call, name):
                    return None  # a scalar argument of the kernel, read at each call
                return f"operand {operand.name} is a symbolic scalar"
            if value.device != self.device:
                return f"operand {operand.name} on {value.device}, group on {self.device}"
            if value.layout != torch.strided:
                return f"operand {operand.name} has layout {value.layout}: no strides to read it by"
            if is_embedding(operand) and operand not in self.p.assigned:
                # (indices computed in the group stay a lookup's input: the lookup stays out)
                if check_lookup(operand) is None and not self._reads_member(operand):
                    new_lookups.append(operand)
            dtype = value.dtype
        return operand_dtype_reason(call, name, dtype)


# Sizes may be SymInts (dynamic=True). Comparing those with == would add guards after
# Dynamo has installed its own, so they are compared by their symbolic expression; Dynamo
# specialises sizes 0 and 1, so a symbolic size is never 1.
def _is_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1


def _same_size(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return str(a) == str(b)


def _broadcast(a: Sequence[Any], b: Sequence[Any]) -> tuple[Any, ...] | None:
    """Eager's broadcast of two shapes, or None when they do not broadcast."""
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + tuple(a), (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if _is_one(x) or _same_size(x, y):
            out.append(y)
        elif _is_one(y):
            out.append(x)
        else:
            return None
    return tuple(out)


def _is_real_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, torch.SymInt | torch.SymFloat)


def _contains_node(value: Any) -> bool:
    if isinstance(value, torch.fx.Node):
        return True
    if isinstance(value, list | tuple):
        return any(_contains_node(v) for v in value)
    return False


def _describe_kind(node: torch.fx.Node) -> str:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name in _OTHER_REDUCTIONS:
        return f"a reduction not fused yet ({name})"
    if name in _VIEW_NAMES:
        return (
            f"a view ({name}) of a value computed in the group: the kernel writes its "
            "outputs contiguous and does not address its own values by new strides"
        )
    if node.op == "call_module":
        return f"a module call ({node.target})"
    return f"not an op in the table ({name or node.target})"


# --- the pass -------------------------------------------------------------------------


class _FusionPass:
    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        self.mutations = [n for n in graph.nodes if is_mutation(n)]
        self.batched = vmapped_nodes(graph)  # (never in a group: no storage to read)
        self.assigned: set[torch.fx.Node] = set()
        self.group_of: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}  # accepted groups
        self.group_span: dict[frozenset[torch.fx.Node], tuple[int, int]] = {}
        # the slices, splits and negations of each rotate_half -> its concatenation: they
        # never seed or join a group alone, only with their concatenation
        self.part_of: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in graph.nodes:
            rotation = match_rotation(node)
            if isinstance(rotation, Rotation):
                self.part_of.update(dict.fromkeys(rotation.parts, node))

    def path_outside(self, group: set[torch.fx.Node]) -> torch.fx.Node | None:
        """A node outside ``group`` that depends on it and feeds it, or None.

        Such a node would have to run both after and before the fused kernel. Checked for
        the whole group at each step (a lookup joining as an operand can close a cycle
        through operands the group already had) by searching upward from the group's
        external operands. A node before ``floor`` in graph order cannot depend on the
        group (graph order is topological), unless through a group found earlier, which
        will be one kernel: reaching one of its members reaches all of them.
        """
        first = min(self.position[m] for m in group)
        floor = min([first] + [lo for lo, hi in self.group_span.values() if hi > first])
        producers = {p for m in group for p in m.all_input_nodes} - group
        for producer in producers:
            seen: set[torch.fx.Node] = set()
            stack = [producer]
            while stack:
                node = stack.pop()
                if node in seen or self.position[node] < floor:
                    continue
                seen.add(node)
                for above in node.all_input_nodes:
                    if above in group:
                        return producer
                    stack.append(above)
                stack.extend(self.group_of.get(node, ()))
        return None

    def mutation_between(self, nodes: Sequence[torch.fx.Node]) -> str | None:
        positions = [self.position[n] for n in nodes]
        low, high = min(positions), max(positions)
        for mutation in self.mutations:
            if low < self.position[mutation] < high:
                return mutation.name
        return None

    def run(self) -> tuple[list[Candidate], list[RejectionReport]]:
        groups: list[Candidate] = []
        rejections: list[RejectionReport] = []
        for node in list(self.graph.nodes):
            if node in self.assigned:
                continue
            if is_embedding(node):
                reason = check_lookup(node)
                if reason:
                    rejections.append(RejectionReport(node.name, reason))
                    continue
            elif node in self.part_of or _kind(node) is None:
                continue
            if not isinstance(example_value(node), torch.Tensor):
                continue  # Python-number arithmetic (a SymInt + 1 beside a sliding window)
            grower = _Grower(self, node)
            reason = grower.start()
            if reason:
                if match(node) is not None and _kind(node) != OpKind.ELEMENTWISE:
                    rejections.append(RejectionReport(node.name, reason))
                continue  # an elementwise op that cannot seed is not worth a line
            candidate = grower.grow()
            if candidate.cost < _MIN_OPS and not _pays_alone(candidate):
                if is_embedding(node):
                    stops = "; ".join(s.reason for s in candidate.stops) or "unused"
                    reason = f"no fusible consumer ({stops})"
                    rejections.append(RejectionReport(node.name, reason))
                elif _kind(node) != OpKind.ELEMENTWISE:
                    reason = (f"alone: a lone {_kind(node)} is one kernel in eager too; "
                              "fused only with another op")  # fmt: skip
                    rejections.append(RejectionReport(node.name, reason))
                continue
            self.assigned.update(candidate.members)
            members = frozenset(candidate.members)
            self.group_of.update(dict.fromkeys(members, members))
            positions = [self.position[m] for m in members]
            self.group_span[members] = (min(positions), max(positions))
            groups.append(candidate)
            rejections.extend(s for s in candidate.stops if s.reason != "graph output")
        return groups, rejections


def _pays_alone(candidate: Candidate) -> bool:
    """Is the group one op whose kernel beats aten's alone (``_LONE_OPS_THAT_PAY``), or one
    that takes in a copy reordering its operand or its output (passes/folded_copies.py:
    LeViT's hardswish on the attention's ``transpose(1, 2).reshape``: two kernels, one)?"""
    calls = list(candidate.calls.values())
    if candidate.lookups or len(calls) != 1:
        return False
    (node,) = candidate.calls
    if calls[0].op.name in _LONE_OPS_THAT_PAY:
        return True
    return any(copy_folds_into(node, operand) for operand in node.all_input_nodes)


def _kind(node: torch.fx.Node) -> OpKind | None:
    """The node's op kind; None for a node that is not a table op."""
    row = lookup_op(node.op, node.target)
    if row is not None:
        return row[0].kind
    call = match(node)
    return call.op.kind if isinstance(call, OpCall) else None


def find_groups(graph: torch.fx.Graph) -> tuple[list[Candidate], list[RejectionReport]]:
    """Every fusable group in ``graph`` and every candidate not fused, with reasons."""
    return _FusionPass(graph).run()
