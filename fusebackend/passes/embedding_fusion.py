"""Find embedding lookups and their elementwise consumers; rewrite each group as one node.

The pass works on Dynamo's own FX graph (torch-level ops, each node carrying its fake
``example_value``). A group is seeded at every embedding lookup and grows downstream, in
graph order, through consumers the op table knows, as long as each consumer's other
operands can be read elementwise (numbers, tensors that broadcast to the result) or are
themselves embedding lookups, which then join the group (token + position + token-type
tables become one kernel). A value used outside the group becomes one more output of the
kernel. Where growth stops, the reason is kept for the report.

Rules that keep the rewrite correct:
- no cycle: an operand computed from the group's own values stops the growth;
- no mutation inside the span of graph positions a group covers (FX data flow does not
  show what an in-place op changes, so order is preserved by position);
- results must be floating point (or bool for comparisons feeding ``where``).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusebackend.kernels.spec import Const, GroupSpec, InputRef, Instr, Lookup, ValueRef
from fusebackend.passes.graph import build_digraph, example_value, is_mutation, resort_stably
from fusebackend.passes.ops import OpCall, bind_op, format_scalar, lookup_op
from fusebackend.report import RejectionReport

__all__ = ["Candidate", "find_groups", "embedding_args", "is_embedding"]

log = logging.getLogger(__name__)

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "norm", "softmax",
    "log_softmax", "layer_norm", "rms_norm", "group_norm", "batch_norm", "logsumexp",
    "cumsum", "argmax", "argmin", "any", "all",
}  # fmt: skip


@dataclasses.dataclass
class Candidate:
    """A group found by the pass, before and after the rewrite."""

    lookups: list[torch.fx.Node]
    members: list[torch.fx.Node]  # lookups and elementwise nodes, in graph order
    calls: dict[torch.fx.Node, OpCall]  # elementwise members -> their matched op
    stops: list[RejectionReport]  # consumers where growth stopped
    spec: GroupSpec | None = None
    inputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    outputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    # member -> index of the kernel output holding its value; aliases (same-dtype casts)
    # share their source's output, as they share its tensor in eager
    output_slot: dict[torch.fx.Node, int] = dataclasses.field(default_factory=dict)

    @property
    def elementwise(self) -> list[torch.fx.Node]:
        return [m for m in self.members if m in self.calls]


# --- embedding lookups ------------------------------------------------------------------


def is_embedding(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (F.embedding, torch.embedding)


def embedding_args(node: torch.fx.Node) -> dict[str, Any]:
    """Normalise F.embedding(input, weight, ...) and torch.embedding(weight, input, ...)."""
    args, kwargs = node.args, node.kwargs
    if node.target is torch.embedding:
        names = ("weight", "input", "padding_idx", "scale_grad_by_freq", "sparse")
        defaults: dict[str, Any] = {"padding_idx": -1, "scale_grad_by_freq": False}
    else:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type",
                 "scale_grad_by_freq", "sparse")  # fmt: skip
        defaults = {"padding_idx": None, "max_norm": None}
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _check_lookup(node: torch.fx.Node) -> str | None:
    args = embedding_args(node)
    if args.get("max_norm") is not None:
        return "max_norm mutates the weight (renormalises rows in place)"
    weight, index = args.get("weight"), args.get("input")
    if not isinstance(weight, torch.fx.Node) or not isinstance(index, torch.fx.Node):
        return "weight or indices are not graph values"
    w, i, out = example_value(weight), example_value(index), example_value(node)
    if not all(isinstance(t, torch.Tensor) for t in (w, i, out)):
        return "no example value recorded for the weight, indices or result"
    if w.dim() != 2:
        return f"weight must be 2-D, got shape {tuple(w.shape)}"
    if w.dtype not in _FLOATING:
        return f"weight dtype {w.dtype} is not floating point"
    if i.dtype not in _INDEX_DTYPES:
        return f"indices dtype {i.dtype} is not int32/int64"
    if w.device != i.device:
        return f"indices on {i.device} but weight on {w.device}"
    if w.device.type not in ("cuda", "cpu"):
        return f"device {w.device} is not supported"
    return None


# --- growth ---------------------------------------------------------------------------


class _Grower:
    """Grows one group from a seed lookup, in graph order."""

    def __init__(self, pass_: _FusionPass, seed: torch.fx.Node) -> None:
        self.p = pass_
        self.device = example_value(seed).device
        self.members: set[torch.fx.Node] = {seed}
        self.seed = seed
        self.calls: dict[torch.fx.Node, OpCall] = {}
        self.stops: list[RejectionReport] = []

    def grow(self) -> Candidate:
        seen: set[torch.fx.Node] = set()
        heap: list[tuple[int, torch.fx.Node]] = []

        def push_users(node: torch.fx.Node) -> None:
            for user in node.users:
                if user not in seen and user not in self.members:
                    seen.add(user)
                    heapq.heappush(heap, (self.p.position[user], user))

        push_users(self.seed)
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
        lookups = [m for m in members if m not in self.calls]
        return Candidate(lookups, members, self.calls, self.stops)

    def _try_absorb(self, user: torch.fx.Node) -> list[torch.fx.Node] | str:
        """The nodes to add for ``user`` (itself plus new lookups), or why not."""
        if user.op == "output":
            return "graph output"
        if user in self.p.assigned:
            return f"consumer {user.name} belongs to another group"
        if is_mutation(user):
            return f"consumer {user.name} is an in-place op"
        row = lookup_op(user.op, user.target)
        if row is None:
            return f"consumer {user.name} is {_describe_kind(user)}"
        call = bind_op(row[0], row[1], user.args, dict(user.kwargs))
        if isinstance(call, str):
            return f"consumer {user.name}: {call}"
        reason = self._check_result(user, call)
        if reason:
            return f"consumer {user.name}: {reason}"
        if _is_alias_cast(call, user) and call.operands[0] not in self.members:
            # eager returns the external tensor itself; a kernel output would be a copy
            return f"consumer {user.name}: a same-dtype cast of a tensor outside the group"
        new_lookups: list[torch.fx.Node] = []
        for name, operand in zip(call.op.operands, call.operands):
            reason = self._check_operand(call, name, operand, new_lookups)
            if reason:
                return f"consumer {user.name}: {reason}"
        for value in call.params.values():
            if _contains_node(value):
                return f"consumer {user.name}: a tensor argument in a non-operand position"
        outside = self.p.path_outside({*self.members, user, *new_lookups})
        if outside is not None:
            return (f"consumer {user.name}: {outside.name} is computed from the group's own "
                    "values and feeds the group (a cycle)")  # fmt: skip
        span = [user, *new_lookups, *self.members]
        mutation = self.p.mutation_between(span)
        if mutation is not None:
            return f"consumer {user.name}: the in-place op {mutation} lies inside the group"
        self.calls[user] = call
        return [user, *new_lookups]

    def _check_result(self, user: torch.fx.Node, call: OpCall) -> str | None:
        value = example_value(user)
        if not isinstance(value, torch.Tensor):
            return "result is not a tensor"
        if value.device != self.device:
            return f"result on {value.device}, group on {self.device}"
        expected = (torch.bool,) if call.op.result == "bool" else _FLOATING
        if call.op.name == "cast":
            expected = (*_FLOATING, torch.bool)
        if value.dtype not in expected:
            return f"result dtype {value.dtype} is not fused"
        if value.dim() == 0:
            return "result is 0-d"
        return None

    def _check_operand(
        self, call: OpCall, name: str, operand: Any, new_lookups: list[torch.fx.Node]
    ) -> str | None:
        wants_bool = name in call.op.bool_operands
        if operand is None:
            return None if call.op.name == "clamp" else f"operand {name} is None"
        if isinstance(operand, bool) or _is_real_number(operand):
            if wants_bool:
                return f"{name} must be a tensor"
            return None
        if not isinstance(operand, torch.fx.Node):
            return f"operand {name} is a {type(operand).__name__}"
        if operand in self.members:
            dtype = example_value(operand).dtype
        else:
            value = example_value(operand)
            if not isinstance(value, torch.Tensor):
                return f"operand {operand.name} is a symbolic scalar"
            if value.device != self.device:
                return f"operand {operand.name} on {value.device}, group on {self.device}"
            if is_embedding(operand) and operand not in self.p.assigned:
                reason = _check_lookup(operand)
                if reason is None:
                    new_lookups.append(operand)
            dtype = value.dtype
        if call.op.name == "cast":
            return None if dtype in (*_FLOATING, torch.bool) else f"cast from {dtype}"
        if wants_bool != (dtype == torch.bool):
            return f"operand {name} has dtype {dtype}"
        if dtype not in (*_FLOATING, torch.bool):
            return f"integer tensor operand {name} ({dtype}) is not fused"
        return None


def _is_alias_cast(call: OpCall, node: torch.fx.Node) -> bool:
    """A cast to the dtype (and device) it already has: eager returns the input itself."""
    source = call.operands[0]
    if call.op.name != "cast" or not isinstance(source, torch.fx.Node):
        return False
    before, after = example_value(source), example_value(node)
    return isinstance(before, torch.Tensor) and before.dtype == after.dtype


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
    if name in _REDUCTIONS:
        return f"a reduction ({name})"
    if node.op == "call_module":
        return f"a module call ({node.target})"
    return f"not an elementwise op in the table ({name or node.target})"


# --- the pass -------------------------------------------------------------------------


class _FusionPass:
    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.digraph = build_digraph(graph)
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        self.mutations = [n for n in graph.nodes if is_mutation(n)]
        self.assigned: set[torch.fx.Node] = set()
        self.group_of: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}  # accepted groups

    def path_outside(self, group: set[torch.fx.Node]) -> torch.fx.Node | None:
        """A node outside ``group`` that depends on it and feeds it, or None.

        Such a node would have to run both after and before the fused kernel. Checked for
        the whole group at each step: a lookup joining as an operand can close a cycle
        through operands the group already had.
        """
        below = self._reach(self.digraph.successors, group)
        above = self._reach(self.digraph.predecessors, group)
        both = below & above
        return min(both, key=self.position.__getitem__) if both else None

    def _reach(self, neighbours: Any, sources: set[torch.fx.Node]) -> set[torch.fx.Node]:
        """Nodes reachable from ``sources`` (excluded) through ``neighbours``.

        A group found earlier will be one kernel: reaching any of its members reaches all
        of them, so a path through it (into one member, out of another) counts as a path.
        """
        seen: set[torch.fx.Node] = set()
        stack = [n for source in sources for n in neighbours(source)]
        while stack:
            node = stack.pop()
            if node in seen or node in sources:
                continue
            seen.add(node)
            stack.extend(neighbours(node))
            for member in self.group_of.get(node, ()):
                if member not in seen:
                    stack.append(member)
        return seen

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
            if not is_embedding(node) or node in self.assigned:
                continue
            reason = _check_lookup(node)
            if reason:
                rejections.append(RejectionReport(node.name, reason))
                continue
            candidate = _Grower(self, node).grow()
            if not candidate.elementwise:
                stops = "; ".join(s.reason for s in candidate.stops) or "unused"
                rejections.append(RejectionReport(node.name, f"no elementwise consumer ({stops})"))
                continue
            self.assigned.update(candidate.members)
            members = frozenset(candidate.members)
            self.group_of.update(dict.fromkeys(members, members))
            groups.append(candidate)
            rejections.extend(s for s in candidate.stops if s.reason != "graph output")
        return groups, rejections


def find_groups(graph: torch.fx.Graph) -> tuple[list[Candidate], list[RejectionReport]]:
    """Every fusable group in ``graph`` and every candidate not fused, with reasons."""
    return _FusionPass(graph).run()


# --- description for the kernel generator ----------------------------------------------


def _scalar_for(call: OpCall, value: Any) -> Any:
    """Comparisons run in the tensor operand's dtype in eager, the scalar rounded to it
    (``x == 0.1`` is True where an fp16 x holds fp16(0.1)); arithmetic keeps it in fp32."""
    if call.op.result != "bool":
        return value
    for operand in call.operands:
        if isinstance(operand, torch.fx.Node):
            dtype = example_value(operand).dtype
            if dtype.is_floating_point:
                return torch.tensor(value, dtype=dtype).item()
    return value


def describe(candidate: Candidate) -> None:
    """Fill ``candidate.spec``, ``inputs`` (graph values read) and ``outputs``."""
    slots: dict[tuple[torch.fx.Node, str], int] = {}
    inputs: list[torch.fx.Node] = []
    dtypes: list[torch.dtype] = []

    def slot(node: torch.fx.Node, role: str) -> int:
        key = (node, role)
        if key not in slots:
            slots[key] = len(inputs)
            inputs.append(node)
            dtypes.append(example_value(node).dtype)
        return slots[key]

    values: dict[torch.fx.Node, int] = {}
    lookups = []
    for j, node in enumerate(candidate.lookups):
        args = embedding_args(node)
        lookups.append(Lookup(slot(args["input"], "index"), slot(args["weight"], "table")))
        values[node] = j
    instrs = []
    for node in candidate.elementwise:
        # Re-match from the node's current arguments: an earlier group's rewrite may have
        # replaced an operand by that group's output.
        row = lookup_op(node.op, node.target)
        call = bind_op(row[0], row[1], node.args, dict(node.kwargs))
        assert isinstance(call, OpCall), call
        candidate.calls[node] = call
        if _is_alias_cast(call, node):
            values[node] = values[call.operands[0]]
            continue
        operands: list[Any] = []
        for operand in call.operands:
            if operand is None:
                operands.append(None)
            elif isinstance(operand, torch.fx.Node) and operand in values:
                operands.append(ValueRef(values[operand]))
            elif isinstance(operand, torch.fx.Node):
                operands.append(InputRef(slot(operand, "tensor")))
            else:
                operands.append(Const(format_scalar(_scalar_for(call, operand))))
        placeholders = [None if op is None else f"{{{i}}}" for i, op in enumerate(operands)]
        template = call.emit(placeholders)
        instrs.append(Instr(call.op.name, template, tuple(operands), example_value(node).dtype))
        values[node] = len(lookups) + len(instrs) - 1
    members = set(candidate.members)
    outputs = [m for m in candidate.members if any(u not in members for u in m.users)]
    distinct: list[int] = []
    for member in outputs:
        if values[member] not in distinct:
            distinct.append(values[member])
        candidate.output_slot[member] = distinct.index(values[member])
    candidate.inputs, candidate.outputs = inputs, outputs
    candidate.spec = GroupSpec(tuple(dtypes), tuple(lookups), tuple(instrs), tuple(distinct))


# --- rewrite --------------------------------------------------------------------------


def rewrite(
    graph: torch.fx.Graph, candidates: Sequence[Candidate], make_op: Any
) -> list[torch.fx.Node]:
    """Describe each group and replace it by ``make_op(candidate)`` called on its inputs.

    Returns the new fused nodes. The graph is re-sorted so that every node keeps its place
    relative to the mutations around it (see ``resort_stably``).
    """
    priority: dict[torch.fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
    fused_nodes = []
    for candidate in candidates:
        describe(candidate)
        first = candidate.members[0]
        start = priority[first]
        holders = _output_holders(candidate)
        with graph.inserting_before(first):
            fused = graph.call_function(make_op(candidate), tuple(candidate.inputs))
            fused.meta["example_value"] = tuple(example_value(h) for h in holders)
            priority[fused] = start
            items = []
            for k, holder in enumerate(holders):
                item = graph.call_function(operator.getitem, (fused, k))
                item.meta["example_value"] = example_value(holder)
                priority[item] = start + (k + 1) / (len(holders) + 1)
                items.append(item)
            members = set(candidate.members)
            for out in candidate.outputs:
                item = items[candidate.output_slot[out]]
                out.replace_all_uses_with(item, delete_user_cb=lambda u, m=members: u not in m)
        for member in reversed(candidate.members):
            graph.erase_node(member)
        fused_nodes.append(fused)
    resort_stably(graph, priority)
    graph.lint()
    return fused_nodes


def _output_holders(candidate: Candidate) -> list[torch.fx.Node]:
    """For each kernel output, the first member whose value it holds."""
    holders: dict[int, torch.fx.Node] = {}
    for member in candidate.outputs:
        holders.setdefault(candidate.output_slot[member], member)
    return [holders[k] for k in range(len(holders))]


def reference_module(candidate: Candidate) -> torch.fx.GraphModule:
    """The group's original torch ops as a small GraphModule (inputs -> outputs).

    Runs the group when no Triton backend is usable (CPU without the interpreter), and
    is what the kernel's first-run validation compares against.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, node in enumerate(candidate.inputs):
        env[node] = graph.placeholder(f"in{i}_{node.name}")
    for member in candidate.members:
        call = candidate.calls.get(member)
        if call is None:  # a lookup; its other arguments only matter for gradients, or are
            # max_norm (rejected), and may be graph values (norm_type under dynamic shapes)
            args = embedding_args(member)
            env[member] = graph.call_function(F.embedding, (env[args["input"]],
                                                            env[args["weight"]]))  # fmt: skip
        elif call.op.name == "cast":  # the target dtype may come from another tensor
            env[member] = graph.call_method("to", (env[call.operands[0]],
                                                   example_value(member).dtype))  # fmt: skip
        else:
            env[member] = graph.node_copy(member, lambda n: env[n])
    graph.output(tuple(env[h] for h in _output_holders(candidate)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)
