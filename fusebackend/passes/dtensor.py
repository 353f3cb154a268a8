"""Tensor-parallel graphs: DTensor inputs run as their local shards.

transformers' ``tp_plan="auto"`` and torch's ``parallelize_module`` turn parameters into
``DTensor``s on a ``DeviceMesh``; Dynamo passes them to the backend as DTensor inputs, and
the mesh as one more input. A DTensor owns no storage of its own (its storage reports 16
bytes and ``data_ptr()`` is 0), so the runtime, which reads inputs' storages and addresses
to find in-place effects and static inputs, cannot take it. This pass rewrites the graph so
that no DTensor crosses its boundary:

- Each DTensor input becomes its local shard: the placeholder stands for
  ``DTensor._local_tensor`` (the parameter's own storage: used in place, never copied), and
  ``LocalShards.bind`` hands the runtime that tensor at each call. ``x.to_local()`` of such
  an input is the placeholder itself; any other use reads ``DTensor.from_local(shard, ...)``
  built once in the graph, with the input's mesh, placements, global shape and stride (a
  new wrapper around the same storage: no copy).
- A node that writes into such an input through a DTensor (``cache.index_copy_(...)`` on a
  DTensor KV cache, ``c.add_(x)``) is followed by ``written_through(shard, node)``, which
  declares the write on the local shard (``writes_arguments``): a DTensor's storage is not
  its shard's, so the passes that follow writes by storage identity (mutated inputs, the
  fusion pass's ordering, constants, the host split) would otherwise miss it.
- A DTensor output leaves the graph as its local tensor (``to_local``) and ``bind`` wraps
  it again, with the traced mesh and placements, after the runtime returns it.

What remains between the local tensors is DTensor's own dispatch where the model calls it
(``redistribute`` around a sharded LM head, the vocab-parallel embedding) and functional
collectives (``_c10d_functional.all_reduce`` + ``wait_tensor`` after a row-parallel
projection); passes/collectives.py rewrites the common ones.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._prims_common import make_contiguous_strides_for

from fusebackend.passes.fx_util import example_value, placeholders
from fusebackend.passes.mutations import storage_id, written_args

__all__ = ["LocalShards", "Rewrap", "is_dtensor", "unwrap_dtensors", "written_through"]

log = logging.getLogger(__name__)


def is_dtensor(value: object) -> bool:
    """Is ``value`` a DTensor (real or fake)? False where torch.distributed is absent."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(value, dtensor)


def _dtensor_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


@dataclasses.dataclass(frozen=True)
class Spec:
    """What makes a local tensor a DTensor again: mesh, placements, global shape, stride.

    Traced with dynamic sizes, a global size is a SymInt, which means nothing at run time:
    ``sizes`` then names, for each such dim in order, the graph input that holds its value
    at each call (Dynamo passes every size symbol as an input), and ``wrap`` takes those
    values. A size no input holds (an expression of symbols) leaves ``sizes`` None, and
    ``from_local`` derives the global shape from the local tensor (right for even shards).
    """

    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[Any, ...]
    stride: tuple[Any, ...]
    sizes: tuple[int, ...] | None = ()  # graph inputs of the symbolic global sizes

    @classmethod
    def of(cls, value: Any, size_inputs: dict[str, int] | None = None) -> Spec:
        """``value``'s spec; ``size_inputs``: a size symbol's expression -> the index of
        the graph input holding it."""
        shape = tuple(value.shape)
        sizes: tuple[int, ...] | None = ()
        symbolic = [d for d in shape if type(d) is not int]
        if symbolic:
            found = [(size_inputs or {}).get(str(d.node.expr)) for d in symbolic]
            sizes = None if None in found else tuple(found)  # type: ignore[arg-type]
        return cls(value.device_mesh, tuple(value.placements), shape, tuple(value.stride()), sizes)

    def wrap(self, local: torch.Tensor, sizes: Sequence[int] = ()) -> Any:
        """``local`` as the DTensor; ``sizes``: the values of the inputs ``self.sizes``
        names, at this call."""
        from torch.distributed.tensor import DTensor

        if not self.symbolic:
            shape, stride = self.shape, self.stride
        elif self.sizes is None or not local.is_contiguous():
            return DTensor.from_local(local, self.mesh, self.placements, run_check=False)
        else:
            given = iter(sizes)
            shape = tuple(d if type(d) is int else int(next(given)) for d in self.shape)
            stride = make_contiguous_strides_for(shape)
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=shape, stride=stride
        )

    @functools.cached_property
    def symbolic(self) -> bool:
        """Does the traced shape or stride hold a SymInt (a graph compiled with dynamic
        sizes)?"""
        return not all(type(n) is int for n in (*self.shape, *self.stride))


class Rewrap:
    """Graph target: a local shard as the DTensor it was traced as (no copy, no
    communication: ``from_local`` without ``run_check``)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.__name__ = "rewrap_dtensor"  # FX's generated code calls the node after this name
        self.__qualname__ = self.__name__

    def __call__(self, local: torch.Tensor, *sizes: int) -> Any:
        return self.spec.wrap(local, sizes)

    def __repr__(self) -> str:
        return f"Rewrap({list(self.spec.placements)}, shape={list(self.spec.shape)})"


def written_through(shard: torch.Tensor, write: Any) -> None:
    """Graph marker placed after ``write``, a node that writes into the DTensor input whose
    local shard is ``shard``: nothing to run, it declares the write (``writes_arguments``)
    for passes/mutations.py, which follows writes by storage (a DTensor's is not its
    shard's)."""


written_through.writes_arguments = (0,)  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class LocalShards:
    """The DTensor inputs and outputs of a rewritten graph.

    ``inputs``: indices of the inputs the runtime gets as local shards; ``parameters``: the
    ones used in place, like any parameter (parameters, and DTensors Dynamo marks static:
    buffers, ``mark_static_address``); ``outputs``: output
    position -> the spec that wraps it again. Indices are the graph's (unchanged by this
    pass: the mesh input stays an input).
    """

    inputs: tuple[int, ...]
    parameters: frozenset[int]
    outputs: dict[int, Spec]
    names: tuple[str, ...] = ()  # the inputs' placeholder names, for explain

    def local_inputs(self, example_inputs: Sequence[Any]) -> list[Any]:
        """``example_inputs`` with each DTensor replaced by its local tensor."""
        inputs = list(example_inputs)
        for i in self.inputs:
            inputs[i] = inputs[i]._local_tensor
        return inputs

    def bind(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The callable that replaces the graph: local shards in, DTensor outputs out."""
        indices, outputs = self.inputs, tuple(self.outputs.items())

        def run(*args: Any) -> Any:
            args = list(args)
            for i in indices:
                # The attribute, not to_local(): that is an autograd Function call (~10 us
                # each, for every weight of a model on every step).
                args[i] = args[i]._local_tensor
            result = fn(*args)
            if not outputs:
                return result
            result = list(result)
            for j, spec in outputs:
                result[j] = spec.wrap(result[j], [args[k] for k in spec.sizes or ()])
            return result

        run.local_shards = self  # type: ignore[attr-defined]  # for tests and explain
        return run


def unwrap_dtensors(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> LocalShards | None:
    """Rewrite ``gm`` in place so that its DTensor inputs and outputs are local tensors;
    None (and ``gm`` unchanged) when no input or output is a DTensor."""
    nodes = placeholders(gm.graph)
    inputs = [i for i, v in enumerate(example_inputs) if i < len(nodes) and is_dtensor(v)]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = output.args[0]
    as_tuple = isinstance(returned, (tuple, list))
    items = list(returned) if as_tuple else [returned]
    out_positions = [
        j
        for j, a in enumerate(items)
        if isinstance(a, torch.fx.Node) and is_dtensor(example_value(a))
    ]
    if not inputs and not out_positions:
        return None
    # Used in place as on one device: parameters, and what Dynamo marks static (buffers,
    # mark_static_address tensors: a StaticCache's). The mark is on the DTensor, not on the
    # local shard the runtime sees.
    parameters = frozenset(
        i
        for i in inputs
        if isinstance(example_inputs[i], torch.nn.Parameter)
        or getattr(example_inputs[i], "_dynamo_static_input_type", None) is not None
    )
    size_inputs: dict[str, int] = {}
    for k, p in enumerate(nodes):
        if isinstance(value := example_value(p), torch.SymInt):
            size_inputs.setdefault(str(value.node.expr), k)
    for i in inputs:
        _localize(gm.graph, nodes[i], example_inputs[i], nodes, size_inputs)
    _declare_writes(gm.graph, [nodes[i] for i in inputs])
    outputs: dict[int, Spec] = {}
    for j in out_positions:
        node = items[j]
        spec = Spec.of(example_value(node), size_inputs)
        with gm.graph.inserting_before(output):
            local = gm.graph.call_method("to_local", (node,))
        local.meta["example_value"] = example_value(node)._local_tensor
        items[j] = local
        outputs[j] = spec
    if outputs:
        output.args = (type(returned)(items) if as_tuple else items[0],)
    gm.graph.lint()
    gm.recompile()
    log.info(
        "DTensor inputs run as local shards: %s; outputs wrapped again: %s",
        [nodes[i].name for i in inputs],
        sorted(outputs),
    )
    names = tuple(nodes[i].name for i in inputs)
    return LocalShards(tuple(inputs), parameters, outputs, names)


def _localize(
    graph: torch.fx.Graph,
    placeholder: torch.fx.Node,
    value: Any,
    placeholders: list[torch.fx.Node],
    size_inputs: dict[str, int],
) -> None:
    """Make ``placeholder`` stand for ``value``'s local shard."""
    fake = example_value(placeholder)
    # The traced (fake) value's spec: under dynamic sizes its shape is symbolic, where the
    # real example input's is only the first call's (a later call's DTensor was rewrapped
    # with that stale global shape).
    spec = Spec.of(fake if is_dtensor(fake) else value, size_inputs)
    sizes = [placeholders[k] for k in spec.sizes or ()]
    placeholder.meta["example_value"] = fake._local_tensor if is_dtensor(fake) else value
    placeholder.meta.pop("val", None)
    rewrapped = None
    for user in list(placeholder.users):
        if user.op == "call_method" and user.target == "to_local" and len(user.args) == 1:
            if not user.kwargs:
                user.replace_all_uses_with(placeholder)
                graph.erase_node(user)
                continue
        if rewrapped is None:
            first_op = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first_op):  # placeholders stay first
                rewrapped = graph.call_function(Rewrap(spec), (placeholder, *sizes))
            rewrapped.meta["example_value"] = fake
        user.replace_input_with(placeholder, rewrapped)


def _declare_writes(graph: torch.fx.Graph, shards: list[torch.fx.Node]) -> None:
    """Follow each node that writes into a DTensor alias of a localized input (the Rewrap
    node, a view of it) with ``written_through(shard, node)``. The alias is found by the
    storage of its example value's ``_local_tensor``: a fake DTensor view's local tensor is
    a view of its base's."""
    by_storage = {storage_id(example_value(p)): p for p in shards}
    by_storage.pop(None, None)
    if not by_storage:
        return
    for node in list(graph.nodes):
        written = {
            by_storage.get(storage_id(value._local_tensor))
            for target in written_args(node)
            if is_dtensor(value := example_value(target))
        }
        written.discard(None)
        anchor = node
        for shard in sorted(written, key=lambda p: p.name):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(written_through, (shard, node))
            anchor.meta["example_value"] = None
