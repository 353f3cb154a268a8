"""Rewrites of the graph's attention calls (``F.scaled_dot_product_attention``): one
boolean-to-additive mask conversion per step, and no mask where a mask is the same for every
key.

Grouped-query attention keeps transformers' ``repeat_kv`` copies. A rewrite that made the
query heads of one K/V head query rows of it (K/V read once, no copies) was removed on
2026-11-25: on an H100, with it, a 22-layer TinyLlama decode graph's replay took 1834 us
of device time against 1750 us without it (400-slot cache), and ``cudaGraphLaunch`` of the
graph blocked the host until the previous replay had finished (1845 us per replay back to
back, against 5.7 us without it), so nothing a client did between steps overlapped the GPU
(``benchmarks/results/diag_replay_host_h100.txt``).

**Shared masks** (``share_mask_conversion``): SDPA turns a boolean mask into an additive
one in the queries' dtype on every call, ``where(~mask, -inf, 0)`` with its scalar made a
tensor first: three to four launches per layer, 66 per TinyLlama decode step, about 90 us of
its 1.8 ms of kernels (H100 profile, 2026-11-23); a 2-layer DistilBERT's padded prefill
spent 8 of its 26 kernels a call there (H200, 2026-11-29), while every layer passes the same
mask. When two or more calls pass one boolean mask node, it is converted once, before the
first call, as ``where(mask, 0.0, -inf).to(dtype)`` (two elementwise ops that join the
group building the mask), and the calls get the additive mask: the values SDPA's math,
memory-efficient and flash paths make for themselves. A row that allows no key (a
left-padded prefill's padding rows) then gives 0 on every path, SDPA's convention; with the
boolean mask torch 2.10's cuDNN path filled it with -65504 instead of -inf and attended to
every key there (pytorch#177842): the rows no real token reads.

**Masks uniform along the keys** (``drop_key_uniform_masks``): a boolean mask whose last
dim has stride 0 (or size 1) allows each query row every key or none. Every fused GPU
kernel of SDPA refuses a mask with a stride-0 last dim, so the math path runs: BERT traced
by Dynamo passes an all-True ``[8, 1, 128, 128]`` mask expanded that way (H100,
2026-11-23, ``benchmarks/results/diag_bert_sdpa_h100.txt``: 413 kernels per call against
eager's 166, where eager passes no mask and gets cuDNN's kernel). Such a call runs without
the mask, and ``where(mask[..., :1], out, 0)`` sets the rows that allowed no key to 0,
which is what SDPA returns for them (the math path's safe softmax; the CPU kernel too).
Applied when the call has no dropout and is not causal, and the ``where`` keeps SDPA's
output layout. On an H100, BERT-base 8 x 128 then took 0.93 ms per call against
reduce-overhead's 1.19 ms (``benchmarks/results/suite_decode_h100_no_packing.md``).

**One K/V head for every query head** (``expand_shared_kv_heads``, fused graph only):
multi-query attention (Falcon-7B's ``multi_query``) passes K and V with one head and lets
SDPA broadcast them over the query's heads. SDPA's fused kernels take q, k and v of one head
count only, so the call ran SDPA's math path, eager's too: a batched matmul, the scale, the
mask, a safe softmax and a second matmul, about ten launches a layer against one (a 2-layer
Falcon: 58 kernels a call against Inductor's 32, H200, 2026-11-29). The rewrite passes K and V
expanded to the query's heads (a view: stride 0 along the heads, no copy), the values SDPA's
broadcast reads; SDPA then picks a fused kernel.

**A query scaled by a number** (``scale_in_attention``, fused graph only): OPT, Whisper and
XGLM scale the query projection by ``head_dim ** -0.5`` (``q_proj(x) * self.scaling``) and
call SDPA with ``scale=1.0``: an elementwise kernel a layer on the query. The multiply goes
and SDPA takes the number in its ``scale`` (times the scale it was given), where the query
reaches SDPA through views only, the multiply has no other reader and its result has its
operand's layout (so every view in between sees the same strides).

**A mask whose last dim is not contiguous** (``contiguous_attention_masks``, fused graph
only): every fused GPU kernel of SDPA wants the mask's last dim at stride 1. T5 adds its
relative position bias, a bucket embedding permuted to ``[1, heads, q, k]``, to the padding
mask; the sum keeps the permuted layout (stride 4 along the keys of a 4-head model), so
every layer's attention ran SDPA's math path in eager and in the fused graph alike: an fp32
upcast of q, k and v, two batched matmuls, the mask, a softmax, about ten launches a layer
(a 2-layer T5 encoder, H200, 2026-11-29: all three fused kernels refused it with that
reason, ``benchmarks/diag/diag_attention_paths.py``). The mask is made contiguous once for
every call that passes it, before the groups are formed, so the group that computes it
writes it contiguous (``folded_copies``: no copy kernel).

**No cuDNN plans per shape** (``avoid_cudnn_plans``, fused graph only): on an H100 (torch
2.11) SDPA picks cuDNN's fused kernel for fp16/bf16 attention, and cuDNN builds an execution
plan for each new shape: a padded encoder's attention took 48-71 ms at its first call at
each new length, against 0.12-0.18 ms for the memory-efficient kernel, whose steady calls
cost the same (0.10-0.16 ms against cuDNN's 0.10-0.15 ms, MiniLM and BERT-base heads at
batch 1 and 32; ``benchmarks/results/diag_encoder_sdpa_h100.json``). Encoders fed a corpus
sorted by length, or one query at a time, meet a new length on most calls; the plans made
their queries' p90 (49-60 ms in every backend, eager's included). Calls whose query or key
length is symbolic (Dynamo went dynamic: it saw the lengths change; a decode step over a
cache that grows each step, too) run with cuDNN's kernel switched off for the call (SDPA then
picks flash or memory-efficient attention, or its math path). Graphs of static lengths keep
SDPA's choice: one plan serves each batch size, and cuDNN's steady calls are faster at
longer lengths (a BERT-base corpus pass of replays only took 0.391 s with the
memory-efficient kernel against 0.330 s with cuDNN's,
``diag_sentence_passes_bert_h100_cudnn_plans.json``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from fusebackend.passes.fx_util import (
    bound_arguments,
    call_evaluated,
    evaluate,
    example_value,
    same_layout,
    static_tensor,
)
from fusebackend.passes.matmul_operands import scaled_by_number

__all__ = [
    "avoid_cudnn_plans",
    "contiguous_attention_masks",
    "drop_key_uniform_masks",
    "expand_shared_kv_heads",
    "sdpa_arguments",
    "scale_in_attention",
    "sdpa_without_cudnn",
    "share_mask_conversion",
]

log = logging.getLogger(__name__)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False): ...  # fmt: skip


_SDPA = inspect.signature(_sdpa)


def share_mask_conversion(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` in place: each boolean mask of static shape that two or more SDPA calls
    pass (with queries of one dtype) becomes additive once. Return one entry per mask
    converted, ``"<mask node> (<n> calls)"``."""
    by_mask: dict[tuple[torch.fx.Node, torch.dtype], list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        a = sdpa_arguments(node)
        if a is None or not isinstance(a["attn_mask"], torch.fx.Node):
            continue
        m, q = example_value(a["attn_mask"]), example_value(a["query"])
        if (static_tensor(m) and m.dtype == torch.bool and m.dim() >= 2
                and isinstance(q, torch.Tensor) and q.is_floating_point()):  # fmt: skip
            by_mask.setdefault((a["attn_mask"], q.dtype), []).append(node)
    shared = []
    for (mask, dtype), calls in by_mask.items():
        if len(calls) < 2:
            continue  # one call: SDPA's own conversion costs the same
        with gm.graph.inserting_before(calls[0]):  # after the mask, before every call
            additive = call_evaluated(gm.graph, torch.where, (mask, 0.0, -math.inf))
            converted = gm.graph.call_method("to", (additive, dtype))
            converted.meta["example_value"] = evaluate(converted)
        for call in calls:
            call.replace_input_with(mask, converted)
        shared.append(f"{mask.name} ({len(calls)} calls)")
    return _finish(gm, shared, "boolean attention masks made additive once")


def drop_key_uniform_masks(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite ``gm`` in place: an SDPA call whose boolean mask is the same for every key of
    a query row runs without the mask, and the rows that allowed no key are set to 0
    afterwards. Return the names of the calls rewritten."""
    dropped = []
    for node in list(gm.graph.nodes):
        a = sdpa_arguments(node)
        if a is None or not isinstance(a["attn_mask"], torch.fx.Node):
            continue
        m, out = example_value(a["attn_mask"]), example_value(node)
        if not (static_tensor(m) and static_tensor(out) and m.dtype == torch.bool and m.dim()):
            continue
        if m.shape[-1] == 0 or (m.shape[-1] > 1 and m.stride(-1) != 0):
            continue  # keys masked one by one (or no keys)
        if a["is_causal"] is not False or a["dropout_p"] != 0.0:
            continue
        rows = m[..., :1]
        with getattr(m, "fake_mode", None) or contextlib.nullcontext():
            kept = torch.where(rows, out, 0.0)
        if kept.shape != out.shape or kept.stride() != out.stride():
            continue  # later views rely on SDPA's output layout
        with gm.graph.inserting_before(node):
            row_mask = gm.graph.call_function(
                operator.getitem, (a["attn_mask"], (Ellipsis, slice(None, 1)))
            )
            row_mask.meta["example_value"] = rows
        if "attn_mask" in node.kwargs:
            node.update_kwarg("attn_mask", None)
        else:
            node.update_arg(3, None)
        users = list(node.users)
        with gm.graph.inserting_after(node):
            zeroed = gm.graph.call_function(torch.where, (row_mask, node, 0.0))
            zeroed.meta["example_value"] = kept
        for user in users:
            user.replace_input_with(node, zeroed)
        dropped.append(node.name)
    return _finish(gm, dropped, "attention masks uniform along the keys dropped")


def expand_shared_kv_heads(graph: torch.fx.Graph) -> list[str]:
    """Rewrite ``graph`` in place: each SDPA call whose 4-d key and value have one head where
    its query has several (and no ``enable_gqa``) reads them expanded to the query's heads.
    Return the names of the calls rewritten."""
    rewritten = []
    for node in graph.nodes:
        a = sdpa_arguments(node)
        if a is None or a["enable_gqa"] is not False:
            continue
        values = [example_value(a[k]) if isinstance(a[k], torch.fx.Node) else None
                  for k in ("query", "key", "value")]  # fmt: skip
        if not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in values):
            continue
        query, key, value = values
        heads = query.shape[1]
        if not (isinstance(heads, int) and heads > 1 and key.shape[1] == value.shape[1] == 1):
            continue
        with graph.inserting_before(node):
            for name in ("key", "value"):
                expanded = graph.call_method("expand", (a[name], -1, heads, -1, -1))
                expanded.meta["example_value"] = evaluate(expanded)
                node.replace_input_with(a[name], expanded)
        rewritten.append(node.name)
    return _checked(graph, rewritten, "attention with K/V expanded to the query's heads")


def contiguous_attention_masks(graph: torch.fx.Graph) -> list[str]:
    """Rewrite ``graph`` in place: a mask of static shape whose last dim has a stride other
    than 1 (or 0: a key-uniform mask, ``drop_key_uniform_masks``) is made contiguous once,
    after the node that computes it, for every SDPA call passing it. Return the names of the
    masks made contiguous."""
    made: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        a = sdpa_arguments(node)
        mask = a["attn_mask"] if a is not None else None
        if not isinstance(mask, torch.fx.Node):
            continue
        value = example_value(mask)
        if not static_tensor(value) or value.dim() < 2 or value.shape[-1] < 2:
            continue
        if value.stride(-1) in (0, 1):
            continue
        if mask not in made:
            with graph.inserting_after(mask):
                made[mask] = graph.call_method("contiguous", (mask,))
                made[mask].meta["example_value"] = evaluate(made[mask])
        node.replace_input_with(mask, made[mask])
    return _checked(graph, [m.name for m in made], "attention masks made contiguous")


# Views a query may reach SDPA through (a multiply before them moves into SDPA's scale).
_VIEWS = {"view", "reshape", "transpose", "permute", "unflatten", torch.transpose,
          torch.permute, torch.reshape, torch.unflatten}  # fmt: skip


def scale_in_attention(graph: torch.fx.Graph) -> list[str]:
    """Rewrite ``graph`` in place: an SDPA call whose query is ``x * c`` (``c`` a Python
    number) seen through views reads ``x`` through them, with ``c`` in its scale. Return the
    names of the multiplies removed."""
    gone = []
    for node in list(graph.nodes):
        a = sdpa_arguments(node)
        if a is None or not isinstance(a["query"], torch.fx.Node):
            continue
        scaled, views = a["query"], []
        while scaled.target in _VIEWS and len(scaled.users) == 1 and scaled.args:
            views.append(scaled)
            scaled = scaled.args[0]
            if not isinstance(scaled, torch.fx.Node):
                break
        found = scaled_by_number(scaled) if isinstance(scaled, torch.fx.Node) else None
        if found is None or len(scaled.users) != 1:
            continue
        source, factor = found
        query = example_value(a["query"])
        if not static_tensor(query):
            continue
        if not same_layout(example_value(source), example_value(scaled)):
            continue  # a view after it could see other strides
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(query.shape[-1])
        if not isinstance(scale, (int, float)):
            continue
        scaled.replace_all_uses_with(source)
        graph.erase_node(scaled)
        bound = sdpa_arguments(node)  # (read again: the query may have been the multiply)
        assert bound is not None
        bound["scale"] = float(scale) * factor
        node.args = tuple(bound.pop(name) for name in ("query", "key", "value"))
        node.kwargs = bound
        gone.append(scaled.name)
    return _checked(graph, gone, "query scalings moved into attention's scale")


def avoid_cudnn_plans(graph: torch.fx.Graph) -> list[str]:
    """Rewrite ``graph`` in place: each SDPA call whose query or key length is symbolic (Dynamo
    made the graph dynamic: the lengths keep changing; a decode step's cache that grows every
    step too) calls ``sdpa_without_cudnn`` instead. Return the names of the calls rewritten."""
    rewritten = []
    for node in graph.nodes:
        a = sdpa_arguments(node)
        if a is None:
            continue
        query, key = (example_value(a[k]) if isinstance(a[k], torch.fx.Node) else None
                      for k in ("query", "key"))  # fmt: skip
        if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)):
            continue
        if query.dim() < 2 or key.dim() < 2:
            continue
        if isinstance(query.shape[-2], int) and isinstance(key.shape[-2], int):
            continue  # one length per graph: one plan, and cuDNN's steady calls are faster
        node.target = sdpa_without_cudnn
        rewritten.append(node.name)
    return _checked(graph, rewritten, "attention without cuDNN's per-shape plans")


def sdpa_without_cudnn(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with cuDNN's kernel switched off for this call (the
    other kernels as the user set them); the switch is put back even when SDPA raises.
    Like ``torch.nn.attention.sdpa_kernel``, this sets the process-wide flag for the call,
    so another thread's SDPA call at that moment skips cuDNN too; and another thread that
    saves and restores the flag meanwhile (``sdpa_kernel``, ``enable_cudnn_sdp``) can leave
    it off, or have its own change undone, as two threads using ``sdpa_kernel`` can."""
    if not torch._C._get_cudnn_sdp_enabled():
        return F.scaled_dot_product_attention(*args, **kwargs)
    torch._C._set_sdp_use_cudnn(False)
    try:
        return F.scaled_dot_product_attention(*args, **kwargs)
    finally:
        torch._C._set_sdp_use_cudnn(True)


def _finish(gm: torch.fx.GraphModule, rewritten: list[str], what: str) -> list[str]:
    """After a rewrite of ``gm``: check and recompile it, and log what changed."""
    _checked(gm.graph, rewritten, what)
    if rewritten:
        gm.recompile()
    return rewritten


def _checked(graph: torch.fx.Graph, rewritten: list[str], what: str) -> list[str]:
    """After a rewrite of ``graph``: check it, and log what changed."""
    if rewritten:
        graph.lint()
        log.info("%s: %s", what, ", ".join(rewritten))
    return rewritten


def sdpa_arguments(node: torch.fx.Node) -> dict[str, Any] | None:
    """An SDPA call's arguments by name, defaults filled in; None for any other node."""
    if not (node.op == "call_function" and node.target is F.scaled_dot_product_attention):
        return None
    return bound_arguments(node, _SDPA)
