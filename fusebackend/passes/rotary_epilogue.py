"""A q/k/v matmul group's rotary embedding and KV-cache write, in the group's own launch.

After passes/matmul_groups.py a Llama-family attention block starts with one launch for its
RMSNorm and its q, k and v projections. transformers' code goes on with

    q = q.view(B, T, -1, D).transpose(1, 2)                        (k and v alike)
    q = q * cos + rotate_half(q) * sin                              (k alike; cos [B, 1, T, D])
    keys.index_copy_(2, index, k); values.index_copy_(2, index, v)  (StaticCache.update)

which runs as two launches more per layer: the rotary pair's row kernel and the cache-write
pair (44 of the 190 launches of a 22-layer TinyLlama decode step, 65 us of its 1.48 ms of
kernels on an H100: benchmarks/results/diag_decode_profile_h100.txt). This pass hands both
to the group (``MatmulGroup.rotary``, ``.cache_write``): the kernel rotates q and k while
their products are in registers and stores k and v straight into the caches.

Taken when:

- the group is q, k, v: three linears of ``[B, T, K]`` rows with no gate or residual;
- each output's only use is ``view(B, T, H_i, D)`` and that view's only use is
  ``transpose(1, 2)``, with one head width ``D`` for all three; for q and k both, with an
  RMSNorm of each head between the view and the transpose (Qwen3's q_norm and k_norm) or
  after the transpose (Gemma3's ``1 + weight`` one): the launch normalises the heads before
  rotating them (``MatmulGroup.head_norm``);
- q's and k's heads are used only by ``heads * cos + rotate_half(heads) * sin`` (either
  order of each product and of the sum; ``rotate_half`` as passes/rotation.py matches it:
  a half-width rotation whose first half is negated), both with the same ``cos`` and
  ``sin``: tensors of q's dtype that broadcast to ``[B, 1, T, D]``;
- for the cache write (else the rotary embedding alone): the rotated k and the v heads are
  used only by ``k_cache.index_copy_(2, index, k)`` and ``v_cache.index_copy_(2, index, v)``,
  two writes that passes/cache_writes.py could pair (``can_write_pair``);
- ``cos``, ``sin``, the index and the caches come before the group, and between the group
  and the last node it takes over no other node writes what the launch reads or reads or
  writes a cache it writes: the launch does all of that work at the group's place.

The rotated q (and k and v, without a cache write) come out of the launch as ``[B, T, N]``
and go on through their original view and transpose, which now read the launch's outputs.
Applied to the fused graph only, like the groups themselves.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from fusebackend.kernels.ir import MatmulGroup
from fusebackend.passes.cache_writes import cache_write_of, can_write_pair
from fusebackend.passes.fx_util import example_value, nodes_between, single_user, static_tensor
from fusebackend.passes.graph import is_mutation, resort_stably
from fusebackend.passes.groups import op_call, operand_orders
from fusebackend.passes.mutations import storage_id, written_storages
from fusebackend.passes.norms import offset_rms_norm_of, rms_norm_of
from fusebackend.passes.rotation import Rotation, is_split, match_rotation

__all__ = ["RotaryEpilogues", "use_rotary_epilogues"]


@dataclasses.dataclass
class RotaryEpilogues:
    """What the pass did: per group taken, ``"matmul_rms_3 + q_embed, k_embed + index_copy_,
    index_copy__1: rotary(q, k) + cache write(k, v)"``; per q/k/v group with a rotary
    embedding left alone, why."""

    made: list[str] = dataclasses.field(default_factory=list)
    left_alone: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Heads:
    """One output of the group as heads: ``output.view(B, T, H, D).transpose(1, 2)``, with
    an RMSNorm over each head where the model has one: between the two (Qwen3's q_norm and
    k_norm) or after the transpose (Gemma3's, with its ``1 + weight``)."""

    output: torch.fx.Node  # getitem(group, i)
    view: torch.fx.Node
    heads: torch.fx.Node  # the transpose, [B, H, T, D]
    norm: Any = None  # norms.Norm of the heads (its ``nodes`` end at its output)
    normed: torch.fx.Node | None = None  # the norm's output
    norm_after: bool = False  # the norm reads the transpose (else the transpose reads it)

    @property
    def rotated(self) -> torch.fx.Node:
        """The value the rotary embedding reads."""
        return self.normed if self.norm_after else self.heads


@dataclasses.dataclass
class _Rotary:
    """``heads * cos + rotate_half(heads) * sin`` of one ``_Heads``."""

    embed: torch.fx.Node  # the sum
    cos: torch.fx.Node
    sin: torch.fx.Node
    nodes: list[torch.fx.Node]  # its own nodes, the sum last


@dataclasses.dataclass
class _Plan:
    heads: list[_Heads]  # q, k, v
    rotary: list[_Rotary]  # q's, k's
    writes: list[torch.fx.Node]  # the two index_copy_ nodes, or none
    k_cache: torch.fx.Node | None = None
    v_cache: torch.fx.Node | None = None
    index: torch.fx.Node | None = None


def use_rotary_epilogues(
    graph: torch.fx.Graph, launch: Callable[[MatmulGroup], Any], checks: bool
) -> RotaryEpilogues:
    """Rewrite ``graph`` in place. ``launch(group)``: the callable that runs a
    ``MatmulGroup`` (``kernels.matmul.matmul_op``); ``checks``: cache-writing kernels are
    built with their device-side index assert (``FusionConfig.index_checks``)."""
    result = RotaryEpilogues()
    order = {node: k for k, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        group = _qkv_group(node)
        if group is None:
            continue
        plan = _plan(node)
        if plan is None:
            continue  # no rotary embedding after it: nothing to say
        reason = plan if isinstance(plan, str) else _hazard(node, plan, order)
        if reason:
            result.left_alone.append(f"{node.name}: {reason}")
            continue
        result.made.append(_rewrite(graph, node, group, plan, launch, checks))
    if result.made:
        # each launch sits where its group was; the re-sort moves it after an input computed
        # later (cos and sin unsqueezed in each layer), keeping every other node in its order
        resort_stably(graph, {})
        graph.lint()
    return result


def _qkv_group(node: torch.fx.Node) -> MatmulGroup | None:
    """The ``MatmulGroup`` a call node runs when it is three plain siblings, else None."""
    group = getattr(node.target, "group", None) if node.op == "call_function" else None
    if not isinstance(group, MatmulGroup) or group.siblings != 3 or group.rotary:
        return None
    if group.gate or group.residual or group.weight_layout != "nk":
        return None
    return group


# ---- Matching


def _plan(node: torch.fx.Node) -> _Plan | str | None:
    """What to take over after the group ``node``, why not (a reason), or None when its
    outputs show no rotary embedding at all."""
    outputs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if len(node.users) != 3 or set(outputs) != {0, 1, 2}:
        return None
    heads = [_by_heads(outputs[k]) for k in range(3)]
    if any(h is None for h in heads):
        return None
    norms = [h.norm for h in heads]
    widths = {example_value(h.heads).shape[-1] for h in heads}
    rotary = [_rotary(h.rotated) for h in heads[:2]]
    if rotary[0] is None and rotary[1] is None:
        return None
    if rotary[0] is None or rotary[1] is None:
        return "q and k are not both rotated (cos, sin)"
    if len(widths) != 1:
        return f"q, k, v heads of different widths {sorted(widths)}"
    if (rotary[0].cos, rotary[0].sin) != (rotary[1].cos, rotary[1].sin):
        return "q and k rotate with different cos and sin"
    if norms[2] is not None or (norms[0] is None) != (norms[1] is None):
        return "head norms on other heads than q and k"
    if norms[0] is not None and (norms[0].eps, norms[0].kind) != (norms[1].eps, norms[1].kind):
        return "q's and k's head norms of different kinds or epsilons"
    if norms[0] is not None and heads[0].norm_after != heads[1].norm_after:
        return "q's and k's head norms in different places"
    half = next(iter(widths)) // 2
    if norms[0] is not None and half & (half - 1):
        return f"head norms over heads of {2 * half} (half not a power of two)"
    reason = _cos_sin_reason(rotary[0], example_value(heads[0].output))
    if reason:
        return reason
    plan = _Plan(heads, rotary, [])  # type: ignore[arg-type]
    _cache_writes(plan)
    return plan


def _by_heads(output: torch.fx.Node) -> _Heads | None:
    """``output`` [B, T, N] as ``view(B, T, H, D).transpose(1, 2)``, its only use (an
    RMSNorm of each head between them, when it is all the view is used for)."""
    view = single_user(output)
    if view is None or view.op != "call_method" or view.target not in ("view", "reshape"):
        return None
    norm, normed = None, None
    heads = single_user(view)
    if heads is not None and heads.target != "transpose":
        found = _head_norm(view)
        if found is None:
            return None
        normed, norm = found
        heads = single_user(normed)
    if heads is None or heads.op != "call_method" or heads.target != "transpose":
        return None
    if sorted(a % 4 if isinstance(a, int) else a for a in heads.args[1:]) != [1, 2]:
        return None
    flat, split, moved = (example_value(n) for n in (output, view, heads))
    if not all(static_tensor(v) for v in (flat, split, moved)) or flat.dim() != 3:
        return None
    batch, seq, width = flat.shape
    if split.dim() != 4 or tuple(split.shape[:2]) != (batch, seq):
        return None
    if split.shape[2] * split.shape[3] != width:
        return None
    after = _head_norm(heads) if norm is None else None
    if after is not None:  # Gemma3: the heads' norm after the transpose
        return _Heads(output, view, heads, after[1], after[0], norm_after=True)
    return _Heads(output, view, heads, norm, normed)


def _head_norm(value: torch.fx.Node) -> tuple[torch.fx.Node, Any] | None:
    """(its output, the norm) of an RMSNorm of ``value``'s last dim (transformers' or
    Gemma's) when the norm's own nodes are all that read the value and all that read each
    other."""
    frontier, seen = list(value.users), set()
    while frontier and len(seen) < 16:  # the norm's 7-10 nodes
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        norm = rms_norm_of(node) or offset_rms_norm_of(node)
        if norm is not None and norm.rows is value:
            own = set(norm.nodes)
            inside = all(set(n.users) <= own for n in norm.nodes if n is not node)
            return (node, norm) if set(value.users) <= own and inside else None
        frontier.extend(node.users)
    return None


def _rotary(heads: torch.fx.Node) -> _Rotary | None:
    """``heads * cos + rotate_half(heads) * sin`` when that is all ``heads`` is used for."""
    width = example_value(heads).shape[-1]
    for product in heads.users:
        found = _product_with(product, heads)
        if found is None:
            continue
        embed = single_user(product)
        add = op_call(embed, "add")
        if add is None or add.params.get("alpha", 1) != 1 or len(add.operands) != 2:
            continue
        other = add.operands[1] if add.operands[0] is product else add.operands[0]
        if other is product or not isinstance(other, torch.fx.Node):
            continue
        if single_user(other) is not embed:
            continue
        for rotated, sin in operand_orders(op_call(other, "mul")):
            rotation = match_rotation(rotated) if isinstance(rotated, torch.fx.Node) else None
            if not _is_rotate_half(rotation, heads, width) or single_user(rotated) is not other:
                continue
            assert isinstance(rotation, Rotation)
            own = {product, rotated, *rotation.parts}
            # a chunk the halves come from is the heads' user too; nothing else may be (a
            # node without users, an in-place op or a write of the heads, least of all)
            chunks = {u for u in heads.users if u not in own and _only_feeds(u, own)}
            if set(heads.users) - own - chunks:
                return None
            nodes = [product, *rotation.parts, *chunks, rotated, other, embed]
            return _Rotary(embed, found, sin, nodes)
    return None


def _only_feeds(split: torch.fx.Node, own: set[torch.fx.Node]) -> bool:
    """Is ``split`` a chunk/split whose every part is one of the rotation's own nodes?"""
    return is_split(split) and bool(split.users) and set(split.users) <= own


def _product_with(product: torch.fx.Node, heads: torch.fx.Node) -> torch.fx.Node | None:
    """The other factor of ``heads * factor`` (a graph tensor), else None."""
    for a, b in operand_orders(op_call(product, "mul")):
        if a is heads and isinstance(b, torch.fx.Node) and b is not heads:
            return b
    return None


def _is_rotate_half(rotation: Any, heads: torch.fx.Node, width: int) -> bool:
    return (
        isinstance(rotation, Rotation)
        and rotation.source is heads
        and rotation.shift == width // 2
        and width % 2 == 0
        and rotation.signs == (-1, 1)
        and not rotation.interleaved
    )


def _cos_sin_reason(rotary: _Rotary, flat: torch.Tensor) -> str | None:
    """Why cos and sin cannot be read as ``[B, 1, T, D]`` tensors of q's dtype, or None."""
    batch, seq, _ = flat.shape
    width = example_value(rotary.embed).shape[-1]
    for node in (rotary.cos, rotary.sin):
        value = example_value(node)
        if not static_tensor(value) or value.dtype != flat.dtype or value.device != flat.device:
            return f"{node.name} is not a static tensor of q's dtype and device"
        try:
            shape = torch.broadcast_shapes(tuple(value.shape), (batch, 1, seq, width))
        except RuntimeError:
            shape = None
        if shape != (batch, 1, seq, width) or value.dim() > 4:
            return f"{node.name} {tuple(value.shape)} does not broadcast to [B, 1, T, D]"
    return None


def _cache_writes(plan: _Plan) -> None:
    """Fill in the cache write when the rotated k and the v heads go only into a pair of
    StaticCache writes."""
    k_write = single_user(plan.rotary[1].embed)
    v_write = single_user(plan.heads[2].heads)
    found = [cache_write_of(n) if n is not None else None for n in (k_write, v_write)]
    if found[0] is None or found[1] is None:
        return
    (k_cache, index, k), (v_cache, v_index, v) = found
    if index is not v_index or k is not plan.rotary[1].embed or v is not plan.heads[2].heads:
        return
    values = [example_value(n) for n in (k_cache, v_cache, index, k, v)]
    caches = {storage_id(values[0]), storage_id(values[1])}
    if not can_write_pair(*values) or None in caches or len(caches) != 2:
        return
    plan.writes = [k_write, v_write]  # type: ignore[list-item]
    plan.k_cache, plan.v_cache, plan.index = k_cache, v_cache, index


# ---- Safety and the rewrite


def _members(plan: _Plan) -> list[torch.fx.Node]:
    """The nodes the launch takes over (erased once unused)."""
    nodes = [n for r in plan.rotary for n in r.nodes] + plan.writes
    nodes += [n for h in plan.heads if h.norm is not None for n in h.norm.nodes]
    if plan.writes:  # k's heads only fed its rotation, v's its cache write
        nodes += [n for h in plan.heads[1:] for n in (h.view, h.heads)]
    return nodes


def _hazard(node: torch.fx.Node, plan: _Plan, order: dict[torch.fx.Node, int]) -> str | None:
    """Why the launch cannot do all of ``plan``'s work at ``node``'s place, or None."""
    extra = [plan.rotary[0].cos, plan.rotary[0].sin, plan.k_cache, plan.v_cache, plan.index]
    extra += [h.norm.weight for h in plan.heads if h.norm is not None]
    extra = [n for n in extra if n is not None]
    members = set(_members(plan)) | {h.output for h in plan.heads} | {node}
    for value in extra:  # one computed later (cos.unsqueeze(1) in each layer) moves the launch
        stack, seen = [value], set()
        while stack:
            ancestor = stack.pop()
            if ancestor in members:
                return f"{value.name} is computed from the group's outputs"
            if ancestor not in seen and order[ancestor] > order[node]:
                seen.add(ancestor)
                stack.extend(ancestor.all_input_nodes)
    inputs = [a for a in node.args if isinstance(a, torch.fx.Node)] + extra
    read = {storage_id(example_value(n)) for n in inputs}
    written = {storage_id(example_value(n)) for n in (plan.k_cache, plan.v_cache) if n}
    if None in read:
        return "an input without a storage"
    last = max(members, key=order.__getitem__)
    for other in nodes_between(node, last):
        if other in members:
            continue
        writes = written_storages([other])
        if is_mutation(other) and not writes:
            return f"{other.name} writes a value of unknown storage inside the span"
        reads = {storage_id(example_value(n)) for n in other.all_input_nodes}
        if writes & (read | written) or reads & written:
            return f"{other.name} touches what the launch reads or writes, inside the span"
    return None


def _rewrite(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    group: MatmulGroup,
    plan: _Plan,
    launch: Callable[[MatmulGroup], Any],
    checks: bool,
) -> str:
    cache = bool(plan.writes)
    norm = plan.heads[0].norm
    rotated = dataclasses.replace(group, rotary=int(example_value(plan.heads[0].heads).shape[-1]),
                                  cache_write=cache, index_checks=cache and checks,
                                  head_norm=norm.kind if norm is not None else "",
                                  head_eps=norm.eps if norm is not None else 0.0)  # fmt: skip
    extra = [plan.rotary[0].cos, plan.rotary[0].sin]
    if norm is not None:
        extra += [plan.heads[0].norm.weight, plan.heads[1].norm.weight]
    if cache:
        extra += [plan.k_cache, plan.v_cache, plan.index]
    kept = plan.heads[:1] if cache else plan.heads
    with graph.inserting_before(node):
        fused = graph.call_function(launch(rotated), (*node.args, *extra))
        fused.meta["example_value"] = tuple(example_value(h.output) for h in kept)
        for k, heads in enumerate(kept):
            output = graph.call_function(operator.getitem, (fused, k))
            output.meta["example_value"] = example_value(heads.output)
            heads.output.replace_all_uses_with(output)
    # the rotated values are now the original view + transpose of the launch's outputs (the
    # transpose reading the view itself where a head norm stood between: the launch did it)
    for heads, rotary in zip(kept, plan.rotary):
        if heads.normed is not None and not heads.norm_after:
            heads.heads.replace_input_with(heads.normed, heads.view)
        rotary.embed.replace_all_uses_with(heads.heads)
    taken = [*(r.embed.name for r in plan.rotary), *(w.name for w in plan.writes)]
    dropped = set(_members(plan) + [h.output for h in plan.heads] + [node])
    for gone in reversed([n for n in graph.nodes if n in dropped]):
        if not gone.users:
            graph.erase_node(gone)
    return f"{node.name} + {', '.join(taken)}: {rotated.describe()}"
