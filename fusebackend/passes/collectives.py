"""Tensor-parallel graphs: the work around their collectives.

Two rewrites of what transformers' ``tp_plan="auto"`` leaves in a Dynamo graph (after
passes/dtensor.py has made the sharded parameters local tensors):

- ``drop_reduce_copies``: a row-parallel projection's partial sum is all-reduced with
  ``x.copy_(wait_tensor(all_reduce(x, "sum", group)))`` (transformers' ``all_reduce_forward``
  traced by Dynamo): one extra copy kernel after every o_proj and down_proj (44 per
  TinyLlama decode step), and a write into ``x`` that makes the residual add after it wait.
  When ``x`` is the graph's own fresh value, nothing read it in between and nothing else
  aliases it, the readers after the copy read the reduced tensor itself and the copy goes.
  Both graphs get it (it changes no value).
- ``reduce_in_place``: ``_c10d_functional.all_reduce(x)`` clones ``x`` and reduces the
  clone: a copy kernel before every all-reduce (on two H100s, 66 of a Llama-3-8B step's
  402 launches, ~1.1 us each plus its gap in the graph, ``benchmarks/diag/diag_tp_step.py``).
  Where ``x`` is the graph's own fresh, contiguous value that nothing else reads or shares
  storage with, the reduction runs in place (``all_reduce_``) and the clone goes. Both
  graphs get it (it changes no value).
- ``use_vocab_parallel_lookup``: DTensor's vocab-parallel embedding, traced as
  ``from_local(ids, mesh, [Replicate()])`` -> ``embedding(ids, table)`` with the table
  ``Shard(0)`` -> ``redistribute([Replicate()])`` -> ``to_local()``, runs in eager as DTensor
  dispatch over several small kernels plus the all-reduce hidden in ``redistribute``. It
  becomes one ``kernels.vocab_lookup.vocab_parallel_lookup`` launch (mask, shift, gather,
  zero the other ranks' rows) and a functional all-reduce in place. The fused graph only
  (like the cache-write pairs): the unfused graph stays as traced and is the reference the
  fused one is validated against.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx

from fusebackend.passes.dtensor import Rewrap, is_dtensor
from fusebackend.passes.fx_util import example_value, nodes_between
from fusebackend.passes.graph import is_mutation
from fusebackend.passes.mutations import storage_id

__all__ = [
    "collective_nodes",
    "op_namespace",
    "drop_reduce_copies",
    "reduce_in_place",
    "use_vocab_parallel_lookup",
]

log = logging.getLogger(__name__)


def _functional(name: str) -> Any:
    """``torch.ops._c10d_functional.<name>``, or None without torch.distributed."""
    if not torch.distributed.is_available():
        return None
    return getattr(torch.ops._c10d_functional, name).default


def _is_op(node: torch.fx.Node, name: str) -> bool:
    if node.op != "call_function" or not torch.distributed.is_available():
        return False
    packet = getattr(torch.ops._c10d_functional, name)
    return node.target is packet or node.target is packet.default


def op_namespace(target: Any) -> str:
    """An op's namespace (``_c10d_functional``): an OpOverload's own, or the part before
    ``::`` of an OpOverloadPacket's qualified name; "" for anything else."""
    namespace = getattr(target, "namespace", None)
    if isinstance(namespace, str):
        return namespace
    return str(getattr(target, "_qualified_op_name", "")).split("::")[0]


def collective_nodes(graph: torch.fx.Graph) -> list[str]:
    """Names of the nodes that communicate: functional collectives (their waits aside) and
    DTensor ``redistribute`` calls (which run one inside)."""
    names = []
    for node in graph.nodes:
        if node.op == "call_function" and op_namespace(node.target) == "_c10d_functional":
            if not _is_op(node, "wait_tensor"):
                names.append(node.name)
        elif node.op == "call_method" and node.target == "redistribute":
            names.append(node.name)
    return names


def drop_reduce_copies(graph: torch.fx.Graph) -> list[str]:
    """Rewrite ``graph`` in place; return the names of the copies dropped."""
    dropped = []
    for copy in list(graph.nodes):
        source = _reduced_in_place(copy)
        if source is None:
            continue
        reduced = copy.args[1]
        for user in list(source.users):
            if user is not copy and user is not reduced.args[0]:
                user.replace_input_with(source, reduced)
        graph.erase_node(copy)
        dropped.append(copy.name)
    if dropped:
        graph.lint()
        log.info("all-reduce copies dropped (readers take the reduced tensor): %s", dropped)
    return dropped


def _reduced_in_place(copy: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` of ``x.copy_(wait_tensor(all_reduce(x, ...)))`` when the copy can go, else None."""
    if not (copy.op == "call_method" and copy.target == "copy_" and len(copy.args) == 2):
        return None
    source, waited = copy.args
    if copy.kwargs or copy.users or not isinstance(waited, torch.fx.Node):
        return None
    if not (_is_op(waited, "wait_tensor") and isinstance(waited.args[0], torch.fx.Node)):
        return None
    reduce = waited.args[0]
    if not (_is_op(reduce, "all_reduce") and reduce.args[0] is source):
        return None
    if source.op not in ("call_function", "call_method") or set(waited.users) != {copy}:
        return None
    # Every other reader of x comes after the copy (it must see the reduced values), and no
    # other value shares x's storage (a view of x read after the copy would miss the write).
    if (set(source.users) - {reduce, copy}) & set(nodes_between(source, copy)):
        return None
    return source if _owns_its_storage(source, copy) else None


def _owns_its_storage(source: torch.fx.Node, *aliases: torch.fx.Node) -> bool:
    """Is ``source``'s value the only one on its storage, apart from ``aliases`` (nodes
    known to return it, as ``x.copy_`` returns x)? False where the storage is unknown: a
    view of it (or it a view of another value) would see a write into it."""
    storage = storage_id(example_value(source))
    if storage is None:
        return False
    return all(
        node is source or node in aliases or storage_id(example_value(node)) != storage
        for node in source.graph.nodes
    )


def reduce_in_place(graph: torch.fx.Graph) -> list[str]:
    """Rewrite ``graph`` in place; return the names of the all-reduces made in place."""
    made = []
    in_place = _functional("all_reduce_")
    for reduce in list(graph.nodes):
        source = _reducible_in_place(reduce)
        if source is None:
            continue
        reduce.target = in_place
        # all_reduce_ returns its input: the reduce (and the wait, which returns its own
        # input) now alias x, which the passes after this one read from storage identity
        fake = example_value(source)
        old = storage_id(example_value(reduce))
        reduce.meta["example_value"] = fake
        for user in reduce.users:
            if _is_op(user, "wait_tensor") and storage_id(example_value(user)) == old:
                user.meta["example_value"] = fake
        made.append(reduce.name)
    if made:
        graph.lint()
        log.info("all-reduces in place (no clone of their input): %s", made)
    return made


def _reducible_in_place(reduce: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` of an out-of-place ``all_reduce(x, ...)`` that may reduce in place, else None."""
    if not _is_op(reduce, "all_reduce") or not reduce.args:
        return None
    source = reduce.args[0]
    if not isinstance(source, torch.fx.Node) or source.op not in ("call_function", "call_method"):
        return None  # a graph input or constant: the caller's tensor must stay as it is
    if set(source.users) != {reduce} or is_mutation(source):
        return None  # read elsewhere, or itself an in-place op's result (x aliases its target)
    if not _owns_its_storage(source):
        return None
    # NCCL reduces a contiguous buffer; the clone made it so
    return source if example_value(source).is_contiguous() else None


def use_vocab_parallel_lookup(graph: torch.fx.Graph, lookup: Any, checks: bool) -> list[str]:
    """Rewrite ``graph`` in place; return the names of the lookups replaced. ``lookup``:
    ``kernels.vocab_lookup.vocab_parallel_lookup``, called as ``lookup(ids, table, start,
    vocab, checks)``."""
    replaced = []
    for node in list(graph.nodes):
        match = _vocab_parallel(node)
        if match is None:
            continue
        ids, table, spec, local = match
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
        group = spec.mesh.get_group().group_name
        fake = example_value(local)
        with graph.inserting_before(local):
            part = graph.call_function(lookup, (ids, table, offset[0], spec.shape[0], checks))
            # in place: the lookup's output is fresh and read by nothing else
            reduce = graph.call_function(_functional("all_reduce_"), (part, "sum", group))
            waited = graph.call_function(_functional("wait_tensor"), (reduce,))
        part.meta["example_value"] = _fresh_like(fake)
        for new in (reduce, waited):  # each returns its input
            new.meta["example_value"] = part.meta["example_value"]
        local.replace_all_uses_with(waited)
        _erase_dead(graph, local)
        replaced.append(node.name)
    if replaced:
        graph.lint()
        log.info("vocab-parallel lookups as one kernel + all-reduce: %s", replaced)
    return replaced


def _vocab_parallel(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """(ids, local table, table spec, the to_local node) of DTensor's vocab-parallel
    embedding ending at ``node`` (the embedding call), else None."""
    if not (node.op == "call_function" and node.target is torch.nn.functional.embedding):
        return None
    args = list(node.args) + [None] * (7 - len(node.args))
    ids, table, padding_idx, max_norm = args[:4]
    if padding_idx is not None or max_norm is not None or node.kwargs:
        return None
    if not (isinstance(table, torch.fx.Node) and isinstance(table.target, Rewrap)):
        return None
    spec = table.target.spec
    if spec.symbolic or not (
        len(spec.placements) == 1 and _is_shard(spec.placements[0], 0) and len(spec.shape) == 2
    ):
        return None
    if not (isinstance(ids, torch.fx.Node) and _replicated_from_local(ids, spec.mesh)):
        return None
    if len(node.users) != 1:
        return None
    (redistribute,) = node.users
    if not (redistribute.op == "call_method" and redistribute.target == "redistribute"):
        return None
    # redistribute(device_mesh=None, placements=None, *, async_op=False): by position or
    # by keyword (transformers passes keywords; a model's own code may not).
    args = list(redistribute.args) + [None] * (3 - len(redistribute.args))
    target_mesh = redistribute.kwargs.get("device_mesh", args[1])
    placements = redistribute.kwargs.get("placements", args[2])
    if _mesh_of(target_mesh) not in (None, spec.mesh):
        return None  # to another mesh: not this lookup's all-reduce
    if placements is None or len(placements) != 1 or not _is_replicate(placements[0]):
        return None
    if len(redistribute.users) != 1:
        return None
    (local,) = redistribute.users
    if not (local.op == "call_method" and local.target == "to_local" and not local.kwargs):
        return None
    if is_dtensor(example_value(local)):
        return None
    return ids.args[0], table.args[0], spec, local


def _replicated_from_local(node: torch.fx.Node, mesh: Any) -> bool:
    """Is ``node`` ``from_local(tensor, mesh, [Replicate()], run_check=False)``?"""
    if node.op != "call_function" or getattr(node.target, "__name__", "") != "from_local":
        return False
    if len(node.args) < 3 or node.kwargs.get("run_check", True):
        return False
    value = example_value(node)
    placements = node.args[2]
    return (
        is_dtensor(value)
        and value.device_mesh == mesh
        and len(placements) == 1
        and _is_replicate(placements[0])
        and isinstance(node.args[0], torch.fx.Node)
    )


def _mesh_of(value: Any) -> Any:
    """The DeviceMesh ``value`` is (a graph input's: Dynamo passes the mesh as one, its
    ``grapharg`` holds the real object), or None where unknown."""
    if isinstance(value, torch.fx.Node):
        value = getattr(value.meta.get("grapharg"), "example", None)
    return value if type(value).__name__ == "DeviceMesh" else None


def _is_shard(placement: Any, dim: int) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) and placement.dim == dim


def _is_replicate(placement: Any) -> bool:
    from torch.distributed.tensor import Replicate

    return isinstance(placement, Replicate)


def _fresh_like(fake: Any) -> Any:
    """A new fake tensor like ``fake`` with its own storage (storage identity is aliasing
    to passes/mutations.py)."""
    mode = getattr(fake, "fake_mode", None)
    if mode is None:
        return torch.empty_like(fake)
    with mode:
        return torch.empty_like(fake)


def _erase_dead(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and then every producer left without users (placeholders stay)."""
    pending = [node]
    while pending:
        current = pending.pop()
        if current.users or current.op in ("placeholder", "output"):
            continue
        inputs = current.all_input_nodes
        graph.erase_node(current)
        pending.extend(inputs)
