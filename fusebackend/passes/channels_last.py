"""Channels-last per graph: 2-d convolutions run on NHWC tensors (fused graph only).

cuDNN runs a half-precision 2-d convolution in NHWC. Given NCHW tensors it transposes the
input before the convolution and the output after it: a timm ResNet-50 call at batch 1 ran
35 + 19 such transposes (H200, fp16, 2026-11-28, ``benchmarks/diag/diag_conv_layout.py``).
Inductor avoids them by choosing channels-last for graphs with convolutions; this pass does
the same for the fused graph:

- the image entering the first convolution is made channels-last once
  (``x.contiguous(memory_format=torch.channels_last)``);
- each convolution reads a channels-last copy of its weight: a derived constant the fused
  graph owns, refreshed before each call when the parameter changed (in place,
  ``load_state_dict``), as folded BatchNorms are (``batch_norm_folding.Refresh``); a
  BatchNorm folded into fp32 weights has its buffer made channels-last in place;
- what follows keeps the layout: convolutions give channels-last outputs, elementwise groups
  walk their tensors in storage order and write the layout they read (``lowering``), and
  pooling, reductions, permutes and matmuls read any layout;
- an op not known to read any layout correctly (``view``, an unknown function) and the
  graph's outputs get the layout they had in the traced graph back (``.contiguous()``), so
  what the user receives has eager's strides.

The layout is worked out on the graph's fake tensors first; if some value cannot be given
its traced layout back, or the graph writes into a value whose layout would change (a write
would land in a copy where eager's tensor was a view), the graph is left as traced, with the
reason.

When (``FusionConfig.channels_last``): ``True`` wherever a graph has a batched 2-d
convolution; ``None`` (default) where it runs on CUDA in half precision, has a convolution
per 300 nodes or more (``_NODES_PER_CONVOLUTION``), and its convolutions' FLOPs, weighted by
Inductor's NHWC/NCHW time per kind of convolution (grouped with more than one input channel
per group 1.358, small channel counts 0.783, ...), are no more than unweighted
(``_CHANNELS_LAST_TIME``); ``False`` never.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor

from fusebackend.passes.batch_norm_folding import FOLDED_PREFIX
from fusebackend.passes.conv_bias import is_batched
from fusebackend.passes.fx_util import (
    evaluate,
    example_value,
    known_channels_last,
    known_contiguous,
    known_equal,
    placeholders,
    static_fake,
)
from fusebackend.passes.groups import match
from fusebackend.passes.mutations import storage_id, written_storages
from fusebackend.passes.ops import OpCall

__all__ = [
    "LayoutResult",
    "WeightCopy",
    "choose_channels_last",
    "is_channels_last_copy",
    "is_conv2d",
    "use_channels_last",
]

CHANNELS_LAST = torch.channels_last
_CONV2D = {torch.conv2d, F.conv2d}
_HALF = (torch.float16, torch.bfloat16)

# Ops whose values do not depend on their inputs' strides (only their own strides do): a
# channels-last tensor may flow into them. Anything else gets the traced layout back first.
_ANY_LAYOUT_FUNCTIONS = {
    *_CONV2D, F.batch_norm, F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d,
    F.adaptive_max_pool2d, torch.max_pool2d, torch.mean, torch.sum, torch.amax, torch.amin,
    torch.flatten, torch.reshape, torch.permute, torch.transpose, torch.cat, torch.clone,
    torch.matmul, operator.matmul, F.linear, F.layer_norm, F.dropout, torch.squeeze,
    torch.unsqueeze, operator.getitem, F.group_norm, F.interpolate, F.pad, torch._C._nn.pad,
    torch.chunk, torch.split,
}  # fmt: skip
_ANY_LAYOUT_METHODS = {
    "mean", "sum", "amax", "amin", "flatten", "reshape", "permute", "transpose", "clone",
    "contiguous", "squeeze", "unsqueeze", "size", "dim", "float", "half", "to", "type_as",
    "chunk", "split", "expand", "expand_as", "repeat", "narrow",
}  # fmt: skip


@dataclasses.dataclass
class WeightCopy:
    """A convolution weight's channels-last copy: a derived constant with one source (the
    protocol of ``batch_norm_folding.Fold`` that ``Refresh`` runs)."""

    name: str
    sources: tuple[int]
    buffer: Tensor
    eps_source: None = None

    def derive(self, inputs: Sequence[Any]) -> None:
        with torch.no_grad():
            self.buffer.copy_(inputs[self.sources[0]].detach())


@dataclasses.dataclass
class LayoutResult:
    """What ``use_channels_last`` did: the convolutions it runs channels-last, the weight
    copies it made, and why nothing or part was done."""

    convolutions: list[str] = dataclasses.field(default_factory=list)
    copies: list[WeightCopy] = dataclasses.field(default_factory=list)
    left_alone: list[str] = dataclasses.field(default_factory=list)


def _convolutions(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The batched 2-d convolutions of ``graph``."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and is_conv2d(node.target) and is_batched(node):
            if example_value(node.args[1]).dim() == 4:
                found.append(node)
    return found


def is_conv2d(target: Any) -> bool:
    """``F.conv2d``, or a call that takes its arguments first and computes a 2-d convolution
    then elementwise work (``kernels.conv.conv2d_relu``, marked ``conv2d_arguments``)."""
    return target in _CONV2D or getattr(target, "conv2d_arguments", False) is True


def _insert_channels_last_copy(
    graph: torch.fx.Graph, source: torch.fx.Node, before: torch.fx.Node, value: Tensor
) -> torch.fx.Node:
    """``source.contiguous(memory_format=torch.channels_last)``, inserted before ``before``,
    its example value ``value``: the copy ``is_channels_last_copy`` recognises."""
    with graph.inserting_before(before):
        node = graph.call_method("contiguous", (source,), {"memory_format": CHANNELS_LAST})
    node.meta["example_value"] = value
    return node


def is_channels_last_copy(node: torch.fx.Node) -> bool:
    """Is ``node`` a channels-last copy this pass put before convolutions (a convolution's
    input whose traced layout is not channels-last, a weight computed in the graph)? A later
    pass whose value it reads may write that layout itself and drop the copy."""
    return (node.op == "call_method" and node.target == "contiguous" and len(node.args) == 1
            and node.kwargs == {"memory_format": CHANNELS_LAST})  # fmt: skip


def _groups(conv: torch.fx.Node) -> int:
    groups = conv.args[6] if len(conv.args) > 6 else conv.kwargs.get("groups", 1)
    return groups if isinstance(groups, int) else 0


def choose_channels_last(graph: torch.fx.Graph, setting: bool | None) -> str | None:
    """None where ``graph`` should run channels-last (``FusionConfig.channels_last`` is
    ``setting``), else why not (reported)."""
    if setting is False:
        return "channels_last=False"
    convs = _convolutions(graph)
    if not convs:
        return "no batched 2-d convolution"
    if setting:
        return None
    weights = [example_value(c.args[1]) for c in convs]
    if any(w.device.type != "cuda" for w in weights):
        return "not on CUDA (channels_last=True forces it)"
    if any(w.dtype not in _HALF for w in weights):
        return "not half precision (channels_last=True forces it)"
    nodes = len(graph.nodes)
    if nodes >= _NODES_PER_CONVOLUTION * len(convs):
        return (f"{len(convs)} convolution(s) among {nodes} nodes, fewer than one per "
                f"{_NODES_PER_CONVOLUTION}: the image's conversion would cost more than the "
                "layout saves (Inductor's rule; channels_last=True forces it)")  # fmt: skip
    flops: dict[str, float] = {}
    for conv, weight in zip(convs, weights):
        kind = _conv_kind(conv, weight)
        flops[kind] = flops.get(kind, 0.0) + _flops(conv, weight)
    total = sum(flops.values())
    weighted = sum(_CHANNELS_LAST_TIME[kind] * f for kind, f in flops.items())
    if weighted > total:
        grouped = 100 * flops.get("grouped", 0.0) / total
        return (f"grouped convolutions (more than one input channel per group) do {grouped:.0f}% "
                f"of the work: slower in NHWC by Inductor's weights ({weighted / total:.2f}x; "
                "channels_last=True forces it)")  # fmt: skip
    return None


# Inductor's first rule (decide_layout_opt): a graph with fewer than one convolution per 300
# nodes stays NCHW. Its convolutions do little of its work, and channels-last costs kernels of
# its own: timm ViT-S/16's patch embedding (one convolution over the 3-channel image) ran the
# image's conversion, two of cuDNN's channel-padding kernels and a copy back at batch 8, 103
# kernels a call against Inductor's 102 (H200, c4a113d, vision_h200_c4a113d_b.json). Counted
# on Dynamo's graph (fewer nodes than Inductor's aten graph): ViT-S/16 and DeiT have 417
# nodes for their one convolution, Swin-T 828; LeViT-128S 182 a convolution, ConvNeXt-T 19,
# ResNet-50 8, EfficientNet-B0 7.
_NODES_PER_CONVOLUTION = 300

# Time in NHWC over time in NCHW per kind of convolution, Inductor's inference weights
# (torch/_inductor/graph.py, decide_layout_opt, averaged over TorchBench's convolutions): a
# graph runs channels-last where its convolutions' FLOPs so weighted are no more than
# unweighted. cuDNN's NHWC grouped convolutions were up to 31x slower on some shapes, and
# depthwise ones (one input channel per group) gain. Measured here (H200, fp16, 2026-11-28,
# benchmarks/vision.py): timm ResNeXt-50 32x4d kept NCHW by a rule refusing any grouped
# convolution ran 1.75 ms a batch-8 call against reduce-overhead's 1.03 in NHWC.
_CHANNELS_LAST_TIME = {"grouped": 1.358, "small": 0.783, "in_out": 0.725, "default": 0.823}


def _conv_kind(conv: torch.fx.Node, weight: Tensor) -> str:
    out_channels, in_per_group, kh, kw = (_hint(size) for size in weight.shape)
    if _groups(conv) != 1 and in_per_group > 1:
        return "grouped"
    if out_channels <= 64 and in_per_group <= 64:
        return "small"
    if out_channels * 2 <= in_per_group and kh * kw > 1:
        return "in_out"
    return "default"


def _flops(conv: torch.fx.Node, weight: Tensor) -> float:
    """Multiply-adds of one convolution per image (output pixels x weight size), from size
    hints where sizes are symbolic (no guard)."""
    out = example_value(conv)
    pixels = _hint(out.shape[-1]) * _hint(out.shape[-2])
    return float(pixels * _hint(weight.numel()))


def _hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 1
    return int(size)


def _any_layout(node: torch.fx.Node) -> bool:
    if node.op == "call_function":
        if node.target in _ANY_LAYOUT_FUNCTIONS or is_conv2d(node.target):
            return True
        return isinstance(match(node), OpCall)
    if node.op == "call_method":
        return node.target in _ANY_LAYOUT_METHODS or isinstance(match(node), OpCall)
    return False


def _same_layout(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same_layout, a, b))
    if isinstance(a, Tensor) != isinstance(b, Tensor):
        return False
    if not isinstance(a, Tensor):
        return True  # sizes, numbers: strides do not reach them
    return (a.dim() == b.dim() and all(map(known_equal, a.shape, b.shape))
            and all(map(known_equal, a.stride(), b.stride())))  # fmt: skip


@dataclasses.dataclass
class _Plan:
    """The layout worked out on fake tensors, before anything is rewritten."""

    values: dict[torch.fx.Node, Any]  # nodes whose value's layout changes -> new fake value
    converted: dict[torch.fx.Node, Any]  # conv inputs made channels-last -> their new value
    restored: dict[torch.fx.Node, list[torch.fx.Node]]  # value -> readers given the old layout


def _plan(graph: torch.fx.Graph, convs: list[torch.fx.Node], written: set[int]) -> _Plan | str:
    """The new layout of every value, or why the graph cannot have it (``written``: the
    storages the graph writes into)."""
    plan = _Plan({}, {}, {})
    conv_set = set(convs)

    def current(node: Any) -> Any:
        return plan.values.get(node, example_value(node))

    for node in graph.nodes:
        if node in conv_set:
            x, weight = node.args[0], example_value(node.args[1])
            value = current(x)
            if not known_channels_last(value):
                if x not in plan.converted:  # one conversion, read by every conv of x
                    with value.fake_mode:
                        plan.converted[x] = value.contiguous(memory_format=CHANNELS_LAST)
                value = plan.converted[x]
            with value.fake_mode:
                args = (value, weight.contiguous(memory_format=CHANNELS_LAST),
                        *torch.fx.node.map_arg(node.args[2:], current))  # fmt: skip
                kwargs = torch.fx.node.map_arg(node.kwargs, current)
                value = node.target(*args, **kwargs)
            if not _same_layout(value, example_value(node)):  # (a channels-last model's: same)
                plan.values[node] = value
            continue
        changed = [n for n in node.all_input_nodes if n in plan.values]
        if not changed:
            continue
        if node.op != "output" and _any_layout(node):
            try:
                value = evaluate(node, current)
            except Exception:  # an op that refuses the new layout: it gets the old one
                pass
            else:
                if not _same_layout(value, example_value(node)):
                    plan.values[node] = value
                continue
        for source in changed:
            old = example_value(source)
            if not (isinstance(old, Tensor) and known_contiguous(old)):
                return (f"{node.name} reads {source.name}, whose traced layout would not "
                        "come back with .contiguous()")  # fmt: skip
            plan.restored.setdefault(source, []).append(node)
    # A write into a value whose layout changes (or into a converted input, or through a
    # restored copy) would reach another tensor than eager's: the converted copy, a reshape
    # that copies where eager's was a view, a restored copy other readers do not read.
    for node in (*plan.converted, *plan.values, *plan.restored):
        if storage_id(example_value(node)) in written:
            return f"the graph writes into {node.name} (or a view of it), whose layout would change"
    return plan


def use_channels_last(
    graph: torch.fx.Graph,
    owner: torch.nn.Module,
    inputs: Sequence[Any],
    is_state: Callable[[Any], bool],
) -> LayoutResult:
    """Run ``graph``'s batched 2-d convolutions channels-last (see the module docstring).

    ``inputs`` are the graph's example inputs (the first call's parameters, which the weight
    copies start from); the copies are set on ``owner`` as attributes the new ``get_attr``
    nodes read."""
    result = LayoutResult()
    convs = _convolutions(graph)
    written = written_storages(graph.nodes)
    plan = _plan(graph, convs, written)
    if isinstance(plan, str):
        result.left_alone.append(plan)
        return result
    index = {node: i for i, node in enumerate(placeholders(graph))}
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for conv in convs:
        weight = conv.args[1]
        if weight not in copies:
            copies[weight] = _weight_copy(graph, owner, conv, index, inputs, is_state, written,
                                          result)  # fmt: skip
        conv.args = (conv.args[0], copies[weight], *conv.args[2:])
    for x, value in plan.converted.items():
        readers = [c for c in convs if c.args[0] is x]
        node = _insert_channels_last_copy(graph, x, readers[0], value)
        for conv in readers:
            conv.args = (node, *conv.args[1:])
    for node, value in plan.values.items():
        node.meta["example_value"] = value
    for source, readers in plan.restored.items():
        value = example_value(source)
        with graph.inserting_after(source):
            back = graph.call_method("contiguous", (source,))
        with value.fake_mode:
            back.meta["example_value"] = value.contiguous()
        for reader in readers:
            reader.replace_input_with(source, back)
    result.convolutions = [c.name for c in convs]
    return result


def _weight_copy(
    graph: torch.fx.Graph, owner: torch.nn.Module, conv: torch.fx.Node,
    index: dict[torch.fx.Node, int], inputs: Sequence[Any], is_state: Callable[[Any], bool],
    written: set[int], result: LayoutResult,
) -> torch.fx.Node:  # fmt: skip
    """The node ``conv`` reads its weight through: a channels-last copy (a derived constant)
    of a parameter, a folded weight made channels-last in place, a channels-last copy of a
    weight computed in the graph, or the weight itself (already channels-last; otherwise
    cuDNN converts it each call: reported)."""
    weight = conv.args[1]
    value = example_value(weight)
    if known_channels_last(value):
        return weight  # 1x1 and depthwise weights are both layouts; a channels-last model
    if weight.op == "get_attr" and weight.target.startswith(FOLDED_PREFIX):  # a folded
        # BatchNorm's weight, which the fused graph owns: its buffer takes the layout in
        # place, so the fold's later derivations write into it
        buffer = getattr(owner, weight.target)
        with torch.no_grad():
            buffer.set_(buffer.contiguous(memory_format=CHANNELS_LAST))
        weight.meta["example_value"] = static_fake(value, buffer)
        return weight
    source = inputs[index[weight]] if weight in index else None
    if storage_id(value) in written:
        result.left_alone.append(f"{weight.name}: written by the graph itself (converted each "
                                 "call by cuDNN)")  # fmt: skip
        return weight
    if weight.op != "placeholder":
        # computed in the graph (BiT's weight standardisation, a weight norm): copied
        # channels-last right there, so that fold_parameter_work, which runs later, folds the
        # copy with the work before it into one derived constant where that work reads
        # parameters alone. Left to cuDNN, a ResNet-V2-50x1-BiT call converted its 17
        # standardised 3x3 and 7x7 weights (H200, 2026-12-01)
        with value.fake_mode:
            copied = value.contiguous(memory_format=CHANNELS_LAST)
        return _insert_channels_last_copy(graph, weight, conv, copied)
    if source is None or not is_state(source) or source.is_inference():
        result.left_alone.append(f"{weight.name}: not a parameter or buffer (converted each "
                                 "call by cuDNN)")  # fmt: skip
        return weight
    copy = WeightCopy(weight.name, (index[weight],),
                      torch.empty_like(source, memory_format=CHANNELS_LAST))  # fmt: skip
    copy.derive(inputs)
    attr = f"_infinifuse_channels_last_{weight.name}"
    setattr(owner, attr, copy.buffer)
    with graph.inserting_before(conv):
        node = graph.get_attr(attr)
    with value.fake_mode:
        node.meta["example_value"] = value.contiguous(memory_format=CHANNELS_LAST)
    result.copies.append(copy)
    return node
