"""Eval-mode BatchNorm folded into the convolution before it, or else made a per-channel
scale and shift (fused graph only).

``conv(x, W, b)`` followed by ``batch_norm(y, mean, var, gamma, beta, training=False, _, eps)``
is one convolution and a per-channel scale and shift:

    scale = gamma / sqrt(var + eps)         shift = (b - mean) * scale + beta
    bn(conv(x, W, b)) = conv(x, W) * scale + shift = conv(x, W * scale) + shift

so the BatchNorm's kernel disappears from every call (a ResNet-50 has 53 of them), and what
follows the convolution (ReLU, a residual add) meets the convolution's output directly. How
depends on the weight's dtype:

- float32 and float64: into the weights. The convolution runs on ``W' = W * scale`` with bias
  ``shift``: no work is left after it.
- half precision: after the convolution. It runs on the user's ``W`` without bias, then
  ``((y - center) * scale + beta).to(dtype)`` (``center`` the mean less the conv's bias) as
  elementwise ops, in float32 and in eager's order (the mean subtracted first), which fuse
  with the activation after them. Folding into fp16
  weights rounds ``W * scale`` in every layer: a timm ResNet-50 (fp16, random BatchNorm
  statistics, H200, 2026-11-28) then differed from the unfused graph by 3.1% of the output's
  norm, and validation (1%) rejected the fused graph. Except where the convolution then
  runs fused with its ReLU (``conv_activation.fuses_after``): there the fold is what lets
  cuDNN take the bias, the residual and the ReLU, and folded weights are nearer fp32's
  result than eager's unfolded fp16 (ResNet-50 as above on the CPU, 2026-11-30: 2.2%
  against 2.9% of the logits' norm), which validation accepts (``runtime/validation.py``).

``W'``, ``center``, ``scale`` and the shift are derived constants: tensors the fused graph owns
(``get_attr``), computed here from the first call's parameters in float32 (float64 for
float64 weights; ``W'`` and the into-the-weights shift cast to the weight's dtype); the
user's parameters are never changed.
Each call runs ``Refresh`` over the graph's inputs: where a source tensor is another
object or its version counter moved (an in-place edit, ``load_state_dict``), or the
BatchNorm module's ``num_batches_tracked`` moved (a train-mode forward, eager or compiled,
updates the running statistics without moving their version counters), the fold is
derived again into the same buffers, so captured CUDA graphs, which read the buffers'
addresses, stay valid and never return stale values. The check runs before the call, or, for
a replay of a graph that writes no input, after its launch: a replay that read old values is
replayed again and its first outputs dropped (``GraphCache``'s ``stale_after_replay``). The
unfused graph (the runtime's fallback and validation reference) keeps the BatchNorm.

A BatchNorm whose input is not a convolution read only by it (RepVGG's identity branch,
DenseNet's norm after a concatenation, a BatchNorm1d after a linear) becomes the same
``((x - mean) * scale + beta).to(dtype)`` elementwise ops, in float32 (float64 for float64
inputs): they fuse with their neighbours as Inductor fuses ``_native_batch_norm_legit_no_training``,
where aten launched a BatchNorm kernel and its channels-last input cost a copy (timm RepVGG-A2
at fp16, H200, 2026-11-28: 17 BatchNorm and 17 copy kernels a call, see docs/PERFORMANCE.md).

Done only where every source is module state (a parameter or buffer the graph gets as an
input), the BatchNorm is not training, has running statistics and a batched input, and its
eps is a number or (``dynamic=True``) an input's ``.item()``; folded into the convolution only
where also the convolution's output has no other reader; the reason is reported otherwise.
"""

from __future__ import annotations

import dataclasses
import gc
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from fusebackend.passes.conv_activation import fuses_after
from fusebackend.passes.conv_bias import CONVOLUTIONS, is_batched, per_channel
from fusebackend.passes.fx_util import evaluate, example_value, placeholders, static_fake
from fusebackend.passes.mutations import storage_id, written_storages
from fusebackend.passes.traced_sources import holder_of

__all__ = ["FOLDED_PREFIX", "Fold", "FoldResult", "Refresh", "fold_batch_norms"]

_BATCH_NORMS = {torch.nn.functional.batch_norm}
# Weight dtypes folded into the weights; others get the scale and shift after the conv.
_INTO_WEIGHTS = (torch.float32, torch.float64)
# The attribute names of the derived tensors start with this (the fused graph's get_attrs).
FOLDED_PREFIX = "_infinifuse_folded_"
# The sources of one fold, in this order (None where the module has none).
SOURCES = ("weight", "bias", "mean", "var", "gamma", "beta")


@dataclasses.dataclass
class Fold:
    """One folded convolution + BatchNorm.

    Attributes:
        name: The BatchNorm node's name (for reports).
        sources: Graph input index of each of ``SOURCES`` (None: absent).
        eps: The BatchNorm's eps.
        eps_source: Graph input index of a 0-d tensor holding eps (``dynamic=True`` passes
            module floats as inputs: read each call, derived again if it changed), or None.
        bias: The derived shift (the convolution's bias ``b'`` when folded into the weights).
        weight: The derived weight ``W'`` when folded into the weights, else None.
        scale: The per-channel scale (float32) when applied after the convolution, else None.
        center: Where a scale is: what is subtracted before scaling, the running mean (less
            the convolution's bias), so ``(y - center) * scale + bias`` keeps eager's order
            (``x * scale + (beta - mean * scale)`` cancels two large terms where the mean is
            far from 0: 50x eager's error on a BatchNorm1d of features near 1e4).
        alone: Why the BatchNorm did not fold into a convolution, where it is a scale and
            shift of its own input; None where it folded.
        counter: The BatchNorm module's ``num_batches_tracked``, or None (statistics of no
            module). A train-mode forward updates the running statistics inside aten's
            batch norm, whose schema does not mark them written, so their version counters
            stay put; the module's ``num_batches_tracked.add_(1)`` beside it moves this one's.
    """

    name: str
    sources: tuple[int | None, ...]
    eps: float
    bias: Tensor
    weight: Tensor | None = None
    scale: Tensor | None = None
    eps_source: int | None = None
    alone: str | None = None
    center: Tensor | None = None
    counter: Tensor | None = None

    def derive(self, inputs: Sequence[Any]) -> None:
        """Compute the derived tensors from ``inputs`` into this fold's buffers, in place."""
        # float32, float64 for float64 models (eager's precision); half-precision folds are
        # computed in float32 and rounded once into their buffers
        acc = torch.promote_types(self.bias.dtype, torch.float32)
        weight, bias, mean, var, gamma, beta = (
            None if i is None or (k == 0 and self.weight is None) else inputs[i].detach().to(acc)
            for k, i in enumerate(self.sources)
        )  # (the weight only where it is folded into)
        if self.eps_source is not None:
            self.eps = float(inputs[self.eps_source])
        scale = torch.rsqrt(var + self.eps)
        if gamma is not None:
            scale = scale * gamma
        with torch.no_grad():
            if self.center is not None:  # (y - center) * scale + beta
                self.center.copy_(mean if bias is None else mean - bias)
                self.scale.copy_(scale)
                self.bias.copy_(beta if beta is not None else torch.zeros_like(mean))
                return
            shift = -mean * scale if bias is None else (bias - mean) * scale
            if beta is not None:
                shift = shift + beta
            self.weight.copy_(weight * scale.reshape(-1, *[1] * (weight.dim() - 1)))
            self.bias.copy_(shift)


class Refresh:
    """Run before each call with the graph's inputs: derives again every fold whose source
    tensors changed (another object, an in-place write: the version counter, or new data
    under the same object, ``param.data = t``: the data pointer), so the folded constants
    always follow the parameters.

    A BatchNorm module's ``num_batches_tracked`` is watched beside its sources
    (``Fold.counter``): the running statistics a train-mode forward updates move no version
    counter. A call with nothing changed compares each distinct source's identity, version
    and data pointer once, each kind in one pass over the sources (``stale``: the check
    alone). With a Python function per source, the check took 116 us a call for ResNet-50's
    282 sources and 125 us for MobileNetV3-large's on an H200 (``diag_vision_host.py``,
    2026-11-28), a third to a half of the backend's host time per replay, all of it before
    the replay's launch; the graph cache now runs it after the launch (module docstring).
    Edits through ``param.data`` (``p.data.mul_(2)``) move no version counter and are not
    seen: ``.data`` is a separate tensor to autograd's bookkeeping.

    Any derived constant with a fold's ``sources``, ``eps_source`` and ``derive(inputs)``
    can be refreshed (``channels_last.WeightCopy``)."""

    def __init__(self, folds: Sequence[Fold], inputs: Sequence[Any]) -> None:
        self.folds = list(folds)
        self.derivations = 0  # folds derived again after compile time (tests read it)
        self._eps_folds = [fold for fold in self.folds if fold.eps_source is not None]
        # each distinct source once (a weight can feed a fold and its channels-last copy)
        indices = sorted({i for fold in self.folds for i in fold.sources if i is not None})
        self._position = {index: k for k, index in enumerate(indices)}
        self._gather = _gatherer(indices)
        self._every = list(range(len(indices)))  # the C++ pointer check's indices
        # the BatchNorms' batch counters (``Fold.counter``), each once: not graph inputs
        counters = {id(c): c for fold in self.folds if (c := getattr(fold, "counter", None))
                    is not None}  # fmt: skip
        self._counters = list(counters.values())
        self._remember(inputs)

    def _remember(self, inputs: Sequence[Any]) -> None:
        self._tensors = self._gather(inputs)
        self._versions = list(map(_VERSION, self._tensors))
        self._pointers = list(map(Tensor.data_ptr, self._tensors))
        self._counted = list(map(_VERSION, self._counters))

    def stale(self, inputs: Sequence[Any]) -> bool:
        """Would a call with ``inputs`` derive anything again? (Changes nothing: the graph
        cache asks after a replay's launch, ``GraphCache``'s ``stale_after_replay``.)"""
        if any(float(inputs[fold.eps_source]) != fold.eps for fold in self._eps_folds):
            return True
        return not self._unchanged(self._gather(inputs))

    def _unchanged(self, current: list[Any]) -> bool:
        """Are the sources the same objects, at the same versions and addresses?"""
        return (
            all(map(operator.is_, current, self._tensors))
            and list(map(_VERSION, current)) == self._versions
            and _pointers_equal(current, self._pointers, self._every)
            and list(map(_VERSION, self._counters)) == self._counted
        )

    def __call__(self, inputs: Sequence[Any]) -> None:
        for fold in self._eps_folds:  # a new 0-d tensor every call: compared by value
            if float(inputs[fold.eps_source]) != fold.eps:
                fold.derive(inputs)
                self.derivations += 1
        current = self._gather(inputs)
        if self._unchanged(current):
            return
        changed = {
            k
            for k, (now, then) in enumerate(zip(current, self._tensors, strict=True))
            if now is not then or _stamp(now) != (self._versions[k], self._pointers[k])
        }
        counted = {id(c) for c, then in zip(self._counters, self._counted, strict=True)
                   if c._version != then}  # fmt: skip
        for fold in self.folds:
            trained = id(getattr(fold, "counter", None)) in counted
            if trained or any(self._position[i] in changed for i in fold.sources if i is not None):
                fold.derive(inputs)
                self.derivations += 1
        self._remember(inputs)


_VERSION = operator.attrgetter("_version")
# C++ check used by torch's cudagraph trees (CUDA builds only): all(tensors[i].data_ptr() ==
# ptrs[i] for i in indices).
_DATA_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def _gatherer(indices: Sequence[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """``inputs -> [inputs[i] for i in indices]``, by one C-level itemgetter."""
    if not indices:
        return lambda inputs: []
    if len(indices) == 1:
        return lambda inputs: [inputs[indices[0]]]
    getter = operator.itemgetter(*indices)
    return lambda inputs: list(getter(inputs))


def _pointers_equal(tensors: list[Tensor], pointers: list[int], every: list[int]) -> bool:
    if _DATA_PTRS_EQUAL is not None:
        return _DATA_PTRS_EQUAL(tensors, pointers, every)
    return list(map(Tensor.data_ptr, tensors)) == pointers


def _stamp(t: Tensor) -> tuple[int, int]:
    """What changes when a tensor's values may have: its version counter (in-place writes)
    and its data pointer (``.data =`` keeps the object and its version)."""
    return t._version, t.data_ptr()


@dataclasses.dataclass
class FoldResult:
    """What ``fold_batch_norms`` did: the folds made, and the BatchNorms left (with why)."""

    folds: list[Fold] = dataclasses.field(default_factory=list)
    left_alone: list[str] = dataclasses.field(default_factory=list)

    def refresh(self, inputs: Sequence[Any]) -> Refresh | None:
        return Refresh(self.folds, inputs) if self.folds else None


def _refusal(
    bn: torch.fx.Node, index: dict[torch.fx.Node, int], inputs: Sequence[Any],
    is_state: Callable[[Any], bool], written: set[int],
) -> str | None:  # fmt: skip
    """Why ``bn`` cannot become a per-channel scale and shift at all (None: it can)."""
    training, eps = _bn_arg(bn, 5, "training"), _bn_arg(bn, 7, "eps", 1e-5)
    if training is not False:
        return "training mode (batch statistics)"
    if not isinstance(eps, (int, float)) and _eps_input(eps, index, inputs) is None:
        return "eps is neither a number nor a graph input's .item()"
    mean, var, _, _ = _bn_sources(bn)
    if mean is None or var is None:
        return "no running statistics"
    x = example_value(bn.args[0] if bn.args else bn.kwargs.get("input"))
    if getattr(x, "fake_mode", None) is None or x.dim() < 2:
        return "its input has no batched example tensor"
    return _sources_refusal(_bn_sources(bn), index, inputs, is_state, written)


def _conv_refusal(
    conv: Any, index: dict[torch.fx.Node, int], inputs: Sequence[Any],
    is_state: Callable[[Any], bool], written: set[int],
) -> str | None:  # fmt: skip
    """Why a BatchNorm cannot fold into ``conv``, its input (None: it can)."""
    if not isinstance(conv, torch.fx.Node) or conv.target not in CONVOLUTIONS:
        return "its input is not a convolution"
    if len(conv.users) != 1:
        return "the convolution's output has other readers"
    if getattr(example_value(conv), "fake_mode", None) is None:
        return "the convolution has no example tensor"
    if not is_batched(conv):
        return "an unbatched convolution or a keyword weight (the channels are another dim)"
    return _sources_refusal(_conv_sources(conv), index, inputs, is_state, written)


def _sources_refusal(
    nodes: Sequence[Any], index: dict[torch.fx.Node, int], inputs: Sequence[Any],
    is_state: Callable[[Any], bool], written: set[int],
) -> str | None:  # fmt: skip
    """Why these weights or statistics cannot be derived from (None: they can)."""
    for node in nodes:
        if node is None:
            continue
        if not isinstance(node, torch.fx.Node) or node not in index:
            return "a weight or statistic is not a graph input"
        if not is_state(inputs[index[node]]):
            return f"{node.name} is not a parameter or buffer"
        if inputs[index[node]].is_inference():
            return f"{node.name} is an inference tensor (no version counter: edits unseen)"
        if storage_id(example_value(node)) in written:  # derived before the call's write
            return f"{node.name} is written by the graph itself"
    return None


def _eps_input(eps: Any, index: dict[torch.fx.Node, int], inputs: Sequence[Any]) -> int | None:
    """The graph input index of ``eps`` where it is ``input.item()`` of a 0-d tensor input (how
    Dynamo passes a module's float under ``dynamic=True``), else None."""
    if not (isinstance(eps, torch.fx.Node) and eps.op == "call_method" and eps.target == "item"):
        return None
    source = eps.args[0]
    if not isinstance(source, torch.fx.Node) or source not in index:
        return None
    value = inputs[index[source]]  # read each call: on the host only (no device sync)
    ok = isinstance(value, Tensor) and value.dim() == 0 and value.device.type == "cpu"
    return index[source] if ok else None


def _bn_arg(bn: torch.fx.Node, position: int, name: str, default: Any = None) -> Any:
    if len(bn.args) > position:
        return bn.args[position]
    return bn.kwargs.get(name, default)


def _conv_sources(conv: torch.fx.Node) -> tuple[Any, Any]:
    weight = conv.args[1] if len(conv.args) > 1 else conv.kwargs.get("weight")
    bias = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
    return weight, bias


def _bn_sources(bn: torch.fx.Node) -> tuple[Any, Any, Any, Any]:
    mean = bn.args[1] if len(bn.args) > 1 else bn.kwargs.get("running_mean")
    var = bn.args[2] if len(bn.args) > 2 else bn.kwargs.get("running_var")
    return mean, var, _bn_arg(bn, 3, "weight"), _bn_arg(bn, 4, "bias")


def fold_batch_norms(
    graph: torch.fx.Graph,
    owner: torch.nn.Module,
    inputs: Sequence[Any],
    is_state: Callable[[Any], bool],
) -> FoldResult:
    """Fold each eval BatchNorm of ``graph`` into its convolution (see the module docstring).

    ``inputs`` are the graph's example inputs (real tensors: the first call's parameters);
    the derived tensors are set on ``owner`` (the module the fused graph is built from) as
    attributes the new ``get_attr`` nodes read.
    """
    result = FoldResult()
    index = {node: i for i, node in enumerate(placeholders(graph))}
    written = written_storages(graph.nodes)
    for bn in [n for n in graph.nodes if n.op == "call_function" and n.target in _BATCH_NORMS]:
        why = _refusal(bn, index, inputs, is_state, written)
        if why is not None:
            result.left_alone.append(f"{bn.name}: {why}")
            continue
        x = bn.args[0] if bn.args else bn.kwargs.get("input")
        not_into_conv = _conv_refusal(x, index, inputs, is_state, written)
        into_conv = not_into_conv is None
        weight, bias = _conv_sources(x) if into_conv else (None, None)
        sources = tuple(
            None if node is None else index[node] for node in (weight, bias, *_bn_sources(bn))
        )
        eps = _bn_arg(bn, 7, "eps", 1e-5)
        eps_source = None if isinstance(eps, (int, float)) else _eps_input(eps, index, inputs)
        eps = float(eps) if eps_source is None else float(inputs[eps_source])
        mean = inputs[sources[2]]
        if into_conv and (inputs[sources[0]].dtype in _INTO_WEIGHTS or fuses_after(x, bn)):
            example = inputs[sources[0]]
            fold = Fold(bn.name, sources, eps, bias=example.new_empty(example.shape[0]),
                        weight=torch.empty_like(example),  # (keeps a channels-last layout)
                        eps_source=eps_source)  # fmt: skip
        else:  # float32 (float64 for float64 inputs), as eager's BatchNorm computes it
            acc = torch.float64 if example_value(x).dtype == torch.float64 else torch.float32
            wide = {"dtype": acc, "device": mean.device}
            fold = Fold(bn.name, sources, eps, bias=torch.empty(mean.shape[0], **wide),
                        scale=torch.empty(mean.shape[0], **wide), eps_source=eps_source,
                        alone=not_into_conv, center=torch.empty(mean.shape[0], **wide))  # fmt: skip
        fold.derive(inputs)
        if fold.weight is not None:
            new_weight, shift = _constants(graph, owner, x, x, fold, ("weight", "bias"))
            x.args = (x.args[0], new_weight, shift, *x.args[3:])
            x.kwargs = {k: v for k, v in x.kwargs.items() if k not in ("weight", "bias")}
            bn.replace_all_uses_with(x)
        else:
            center, scale, shift = _constants(
                graph, owner, bn, x, fold, ("center", "scale", "bias")
            )
            if into_conv:
                x.args = (*x.args[:2], None, *x.args[3:])
                x.kwargs = {k: v for k, v in x.kwargs.items() if k != "bias"}
            bn.replace_all_uses_with(_scale_and_shift(graph, x, center, scale, shift, after=shift))
        graph.erase_node(bn)
        result.folds.append(fold)
    nodes = list(index)  # (the placeholders, in input order)
    counters = _batch_counters([(inputs[fold.sources[2]], nodes[fold.sources[2]])
                                for fold in result.folds])  # fmt: skip
    for fold in result.folds:
        fold.counter = counters.get(id(inputs[fold.sources[2]]))
    return result


# running mean -> its module's num_batches_tracked, as found (by identity, kept only while
# the mean lives)
_COUNTER_OF = WeakIdKeyDictionary()


def _batch_counters(means: list[tuple[Tensor, torch.fx.Node]]) -> dict[int, Tensor]:
    """``num_batches_tracked`` of the BatchNorm module holding each running mean (given with
    its placeholder), by the mean's id (``Fold.counter``). Found in the module's buffer dict:
    where Dynamo read the mean from (``traced_sources.holder_of``), else through one pass
    of the garbage collector over every tracked object, for all the means left at once (0.3
    s with timm and transformers imported, 363k objects, on a loaded 2-core CPU,
    2026-11-30). At compile time only, and remembered per mean: a recompile (a new batch
    size, Dynamo's dynamic-shape retrace) looks only for means not seen before."""
    missing = []
    for mean, node in means:
        if mean not in _COUNTER_OF and not _remember_counter(holder_of(node), mean):
            missing.append(mean)
    if missing:
        for holder in gc.get_referrers(*missing):
            _remember_counter(holder, holder.get("running_mean") if isinstance(holder, dict)
                              else None)  # fmt: skip
    return {id(mean): _COUNTER_OF[mean] for mean, _ in means if mean in _COUNTER_OF}


def _remember_counter(holder: Any, mean: Any) -> bool:
    """Where ``holder`` is a buffer dict holding ``mean`` (the very tensor) as its running mean
    beside a batch counter, remember that counter for the mean; say whether it did."""
    if not (isinstance(holder, dict) and isinstance(mean, Tensor)
            and holder.get("running_mean") is mean):  # fmt: skip
        return False
    counter = holder.get("num_batches_tracked")
    if not isinstance(counter, Tensor):
        return False
    _COUNTER_OF[mean] = counter
    return True


def _constants(
    graph: torch.fx.Graph, owner: torch.nn.Module, before: torch.fx.Node, x: torch.fx.Node,
    fold: Fold, parts: tuple[str, ...],
) -> list[torch.fx.Node]:  # fmt: skip
    """``get_attr`` nodes (before ``before``) of the fold's tensors ``parts``, set on ``owner``;
    their fake tensors are made in the fake mode of ``x``'s example."""
    nodes = []
    for part in parts:
        tensor = getattr(fold, part)
        attr = f"{FOLDED_PREFIX}{fold.name}_{part}"
        setattr(owner, attr, tensor)
        with graph.inserting_before(before):
            node = graph.get_attr(attr)
        node.meta["example_value"] = _fake_like(x, tensor)
        nodes.append(node)
    return nodes


def _scale_and_shift(
    graph: torch.fx.Graph,
    x: torch.fx.Node,
    center: torch.fx.Node,
    scale: torch.fx.Node,
    shift: torch.fx.Node,
    after: torch.fx.Node,
) -> torch.fx.Node:
    """``((x - center) * scale + shift).to(dtype)`` per channel (dim 1 of a batched ``x``),
    placed after ``after``; returns its last node."""
    out = example_value(x)
    previous = after

    def append(op: str, target: Any, args: tuple[Any, ...]) -> torch.fx.Node:
        nonlocal previous
        with graph.inserting_after(previous):
            node = graph.create_node(op, target, args)
        node.meta["example_value"] = evaluate(node)
        previous = node
        return node

    center_view = append("call_method", "view", (center, per_channel(out)))
    scale_view = append("call_method", "view", (scale, per_channel(out)))
    shift_view = append("call_method", "view", (shift, per_channel(out)))
    centered = append("call_function", operator.sub, (x, center_view))
    scaled = append("call_function", operator.mul, (centered, scale_view))
    shifted = append("call_function", operator.add, (scaled, shift_view))
    if example_value(shifted).dtype == out.dtype:  # (a cast to its own dtype aliases it)
        return shifted
    return append("call_method", "to", (shifted, out.dtype))


def _fake_like(node: Any, tensor: Tensor) -> Any:
    """A fake tensor like ``tensor`` in the fake mode of ``node``'s example (so later passes
    read shapes and dtypes from the new node as from any other)."""
    if not isinstance(node, torch.fx.Node):
        return None
    example = node.meta.get("example_value")
    return None if getattr(example, "fake_mode", None) is None else static_fake(example, tensor)
