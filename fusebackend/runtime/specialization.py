"""Whether an older compiled graph of a function is a newer one with some sizes fixed, so
that the older one can serve a call the newer one is handed (``frames.route``).

Dynamo's recompiles of one function make ever more general graphs: a static one for the
first shape, then one dynamic in the length, then in the batch. From then on Dynamo hands
every shape to the newest graph, so a corpus encoded twice made a new entry (a run, a
capture) in the newest graph for each shape an older graph had already captured. On an
H100 (MiniLM-L6 shape under sentence-transformers, 3000 sentences in 46 padded shapes,
2026-11-26, ``benchmarks/diag/diag_sentence_passes.py``) that was 45 new entries and 46
captures in the second pass: 1.69 s against 0.66 s for a pass of replays.

``GraphForm`` is a graph with its size arithmetic taken out: each tensor operation in order,
its arguments as other operations, inputs, constants, or the symbolic value of a size.
``specialization(older, newer)`` compares two forms: the same operations on the same
arguments, inputs matched by name (Dynamo names them by their source: the same tensor of
the caller), where the older graph may hold a constant size in place of the newer one's
symbolic size. Those pairs become ``checks``, decided per call signature (``holds``): the
older graph computes the newer one's function exactly where every symbolic size equals the
older graph's constant. Graphs that differ in anything else (an operation, a constant, a
Python value the older graph was specialized on) never match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch import Tensor


def example_value(node: torch.fx.Node) -> Any:
    """The value Dynamo recorded for ``node`` (runtime/ imports nothing of passes/)."""
    return node.meta.get("example_value", node.meta.get("val"))


__all__ = [
    "GraphForm", "Operations", "Specialization", "binding", "evaluate", "form_of", "holds",
    "operations", "specialization",
]  # fmt: skip

_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
_PLAIN = (int, float, bool, str, type(None))
_NAMED = (torch.dtype, torch.device, torch.layout, torch.memory_format)


@dataclasses.dataclass(frozen=True, eq=False)
class GraphForm:
    """A graph without its size arithmetic (see the module docstring).

    ``inputs``: per input, its name; ``input_sizes``: per input, the symbolic value of a
    scalar one (a size or an int Dynamo passes in), None for the others;
    ``ops``: per tensor operation (and the output), a nested tuple of its kind, target and
    argument patterns; ``attrs``: op index -> the tensor a ``get_attr`` reads.
    """

    inputs: tuple[str, ...]
    input_sizes: tuple[Any, ...]
    ops: tuple[Any, ...]
    attrs: Mapping[int, Any]
    # How many values the graph the cache runs returns: Dynamo's graph less the host part
    # split off (passes/host_inputs.py). Two compilations of one function can split it
    # differently (a host chain folded at static sizes, not at symbolic ones); a call routed
    # between them read outputs the other graph returns from its host part (an IndexError
    # in a DynamicCache decode on the CPU, 2026-12-01).
    outputs: int = -1


@dataclasses.dataclass(frozen=True)
class Specialization:
    """How an older graph serves a newer graph's call: ``inputs[i]`` is the newer graph's
    input of the same name for the older one's input ``i`` (None: a scalar the newer graph
    lacks); ``checks``: (newer size, older size or constant) pairs that must be equal for
    the call. A scalar input of the older graph takes the value its symbol has in the
    older graph's tensor sizes where they have it (``frames.route``)."""

    inputs: tuple[int | None, ...]
    checks: tuple[tuple[Any, Any], ...]


def _size(value: Any) -> Any:
    """A scalar's symbolic value: a sympy expression, or the plain number."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        expr = value.node.expr
        if isinstance(expr, sympy.Integer):
            return int(expr)
        return expr
    return value


def _is_sizes(value: Any) -> bool:
    """A node computing sizes: a scalar, or a tuple (torch.Size) of scalars."""
    if isinstance(value, _SCALARS):
        return True
    return (
        isinstance(value, (tuple, list))
        and bool(value)
        and all(isinstance(v, _SCALARS) for v in value)
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Operations:
    """A traced graph's tensor operations (``GraphForm.ops`` / ``attrs``)."""

    ops: tuple[Any, ...]
    attrs: Mapping[int, Any]


def operations(gm: torch.fx.GraphModule) -> Operations | None:
    """The tensor operations of Dynamo's graph ``gm``, taken before any pass changes it (a
    size-dependent part folded into a constant would differ between a static and a
    dynamic graph of one function); None: a graph this module does not understand."""
    ops: list[Any] = []
    attrs: dict[int, Any] = {}
    sizes: dict[torch.fx.Node, Any] = {}
    place: dict[torch.fx.Node, Any] = {}

    def pattern(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if a in sizes:
                return ("s", sizes[a])
            return place[a]
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("s", _size(a))
        if isinstance(a, _PLAIN):
            return ("c", type(a).__name__, a)
        if isinstance(a, _NAMED):
            return ("c", type(a).__name__, str(a))
        if isinstance(a, (tuple, list)):
            return ("seq", type(a).__name__, tuple(pattern(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(("kw", k, pattern(a[k])) for k in sorted(a)))
        if isinstance(a, slice):
            return ("slice", pattern(a.start), pattern(a.stop), pattern(a.step))
        return ("o", a)  # any other object: the same one only (held: its id stays its own)

    for node in gm.graph.nodes:
        value = example_value(node)
        if node.op == "placeholder":
            if _is_scalar_input(value):
                sizes[node] = _size(value)
            else:
                place[node] = ("p", str(node.target))  # Dynamo's name: the caller's source
            continue
        if node.op in ("call_function", "call_method") and _is_sizes(value):
            sizes[node] = (
                _size(value)
                if isinstance(value, _SCALARS)
                else ("S", tuple(_size(v) for v in value))
            )
            continue
        target = node.target if isinstance(node.target, str) else id(node.target)
        if node.op == "get_attr":
            try:
                attrs[len(ops)] = _attribute(gm, node.target)
            except AttributeError:
                return None
        ops.append((node.op, target, pattern(node.args), pattern(node.kwargs)))
        place[node] = ("n", len(ops) - 1)
    return Operations(tuple(ops), attrs)


def _is_scalar_input(value: Any) -> bool:
    return isinstance(value, _SCALARS) and not isinstance(value, bool)


def form_of(
    runs: torch.fx.GraphModule, traced: Operations | None, arity: int | None = None
) -> GraphForm | None:
    """The form of a compiled graph: the inputs of ``runs`` (the graph the cache runs; its
    first ``arity``, the ones callers pass: per-signature inputs follow them) and the
    ``traced`` operations of Dynamo's graph it came from (None: no form)."""
    if traced is None:
        return None
    inputs: list[str] = []
    input_sizes: list[Any] = []
    for node in runs.graph.nodes:
        if node.op == "placeholder" and (arity is None or len(inputs) < arity):
            value = example_value(node)
            inputs.append(str(node.target))
            input_sizes.append(_size(value) if _is_scalar_input(value) else None)
    returned = runs.graph.output_node().args[0]
    outputs = len(returned) if isinstance(returned, (tuple, list)) else 1
    return GraphForm(tuple(inputs), tuple(input_sizes), traced.ops, traced.attrs, outputs)


def _attribute(gm: torch.fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def specialization(older: GraphForm, newer: GraphForm) -> Specialization | None:
    """How ``older`` serves ``newer``'s calls, or None where it cannot (see the module
    docstring)."""
    if len(older.ops) != len(newer.ops) or older.outputs != newer.outputs:
        return None
    checks: list[tuple[Any, Any]] = []
    by_name = {name: j for j, name in enumerate(newer.inputs)}
    inputs: list[int | None] = []
    for name, size in zip(older.inputs, older.input_sizes, strict=True):
        if name in by_name and (size is None) == (newer.input_sizes[by_name[name]] is None):
            inputs.append(by_name[name])
        elif size is not None:
            inputs.append(None)  # a size the older graph takes: from its own tensors
        else:
            return None
    for k, (o, n) in enumerate(zip(older.ops, newer.ops, strict=True)):
        if not _match(o, n, checks):
            return None
        if k in older.attrs and not _same_tensor(older.attrs[k], newer.attrs.get(k)):
            return None
    return Specialization(tuple(inputs), tuple(checks))


# Pattern tags (the first item of a pattern tuple); an op's tuple starts with its op kind.
_TAGS = frozenset({"s", "c", "p", "n", "o", "seq", "dict", "slice"})


def _tag(p: Any) -> str | None:
    if isinstance(p, tuple) and p and isinstance(p[0], str) and p[0] in _TAGS:
        return p[0]
    return None


def _match(o: Any, n: Any, checks: list[tuple[Any, Any]]) -> bool:
    to, tn = _tag(o), _tag(n)
    if to in ("s", "c") and tn in ("s", "c") and "s" in (to, tn):
        # a size, or a constant in place of a size: equal for the call (holds)
        if not (_scalar(o) and _scalar(n)):
            return _sizes_match(o, n, checks)
        checks.append((_scalar_value(n), _scalar_value(o)))
        return True
    if to != tn:
        return False
    if to == "o":
        return o[1] is n[1]
    if to in ("p", "n", "c"):
        return o == n
    if isinstance(o, tuple) and isinstance(n, tuple):  # an op, or a pattern's parts
        return len(o) == len(n) and all(_match(a, b, checks) for a, b in zip(o, n, strict=True))
    return o == n


def _scalar(p: Any) -> bool:
    return p[0] == "c" or not (isinstance(p[1], tuple) and p[1] and p[1][0] == "S")


def _scalar_value(p: Any) -> Any:
    return p[2] if p[0] == "c" else p[1]


def _sizes_match(o: Any, n: Any, checks: list[tuple[Any, Any]]) -> bool:
    """Two size tuples (``("s", ("S", sizes))``): element by element."""
    if o[0] != "s" or n[0] != "s" or _scalar(o) or _scalar(n):
        return False
    a, b = o[1][1], n[1][1]
    if len(a) != len(b):
        return False
    checks.extend(zip(b, a, strict=True))
    return True


def _same_tensor(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return False
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return bool(torch.equal(a, b))


def binding(symbols: Mapping[int, Any], args: Sequence[Any]) -> dict[str, int]:
    """Symbol name -> value, from the inputs whose size (or value) is a plain symbol
    (``buckets.symbols_of``: input index -> each dim's symbol, or the scalar's)."""
    out: dict[str, int] = {}
    for i, symbol in symbols.items():
        if i >= len(args):
            continue
        a = args[i]
        if isinstance(symbol, tuple):
            if isinstance(a, Tensor) and a.dim() == len(symbol):
                for name, size in zip(symbol, a.shape, strict=True):
                    if name is not None and name.isidentifier():
                        out.setdefault(name, int(size))
        elif symbol is not None and symbol.isidentifier() and isinstance(a, int):
            out[symbol] = a
    return out


def evaluate(size: Any, values: Mapping[str, int]) -> Any:
    """A symbolic size's value under ``values`` (a plain number as it is); None where a
    symbol has no value or the result is not a number."""
    if not isinstance(size, sympy.Basic):
        return size
    try:
        found = {s: values[s.name] for s in size.free_symbols}
        result = size.xreplace({s: sympy.Integer(v) for s, v in found.items()})
        if result is sympy.true or result is sympy.false:
            return bool(result)
        if not result.is_number:
            return None
        return int(result) if result.is_integer else float(result)
    except (KeyError, TypeError, ValueError):
        return None


def holds(checks: Sequence[tuple[Any, Any]], newer: Mapping[str, int],
          older: Mapping[str, int]) -> bool:  # fmt: skip
    """Every (newer size, older size) pair of ``checks`` equal under the two bindings."""
    for n, o in checks:
        a, b = evaluate(n, newer), evaluate(o, older)
        if a is None or b is None or a != b:
            return False
    return True
