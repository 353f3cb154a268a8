"""Last-dim rearrangements: ``rotate_half`` of rotary embeddings as one op.

``cat((-x[..., s:], x[..., :s]), dim=-1)`` (transformers' ``rotate_half``, with ``s = D // 2``)
is four FX nodes: two slices (``x[..., :s]`` getitems, or the two parts of one
``chunk``/``split``), a negation and the concatenation. ``match_rotation`` recognises the
concatenation as one ``rotate`` op of ``x`` (a column rotation by ``s`` with a sign per part,
``kernels/ir.Rotate``) and names the other nodes as its parts: they join the group with it and
no instruction of their own (the kernel loads ``x`` at rotated column offsets).

The interleaved spelling (GPT-J's and CodeGen's ``rotate_every_two``), ``stack((-x[..., 1::2],
x[..., ::2]), -1).flatten(-2)``, swaps each pair of columns with a sign per column of the pair:
a ``Rotation`` with ``interleaved`` set, matched at the ``flatten``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx

from fusebackend.passes.concatenation import CAT_FUNCTIONS, cat_arguments
from fusebackend.passes.fx_util import example_value

__all__ = ["Rotation", "is_split", "last_dim_slice", "match_rotation", "rotate"]

_NEG = (operator.neg, torch.neg, torch.negative, torch.Tensor.neg, "neg", "negative")
_SPLITS = (torch.chunk, torch.split, torch.Tensor.chunk, torch.Tensor.split, "chunk", "split")
_FLATTENS = (torch.flatten, torch.Tensor.flatten, "flatten")


@dataclasses.dataclass(frozen=True)
class Rotation:
    """``out[..., j] = signs[0] * source[..., j + shift]`` for ``j < D - shift``, else
    ``signs[1] * source[..., j - (D - shift)]``; ``parts``: the slices and negations
    that only this concatenation reads (a ``chunk``/``split`` node they take parts of is
    not one: its value is a tuple; the rewrite erases it once unused). ``interleaved``:
    ``out[..., 2i] = signs[0] * source[..., 2i + 1]``, ``out[..., 2i + 1] = signs[1] *
    source[..., 2i]`` (shift 1; the parts include the ``stack``)."""

    source: torch.fx.Node
    shift: int
    signs: tuple[int, int]
    parts: tuple[torch.fx.Node, ...]
    interleaved: bool = False
    width: int = 0  # > 0: only the first ``width`` columns rotate, the rest are 0

    @property
    def params(self) -> dict[str, Any]:
        """The ``rotate`` op's params (and ``rotate``'s arguments after the source)."""
        return {"shift": self.shift, "signs": self.signs, "interleaved": self.interleaved,
                "width": self.width}  # fmt: skip


def _is_call(node: Any, targets: tuple[Any, ...]) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_method":
        return node.target in targets
    return node.op == "call_function" and node.target in targets


def is_split(node: torch.fx.Node) -> bool:
    """A ``chunk``/``split`` call (its value is a tuple of views)."""
    return _is_call(node, _SPLITS)


def last_dim_slice(node: torch.fx.Node, ndim: int) -> tuple[torch.fx.Node, int, int] | None:
    """(source, start, stop) when ``node`` takes columns [start, stop) of a tensor's last
    dim and nothing else: ``x[..., a:b]`` or a part of ``x.chunk``/``x.split`` along -1."""
    if not _is_call(node, (operator.getitem,)):
        return None
    base, index = node.args
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or not isinstance(value.shape[-1], int):
        return None
    if _is_call(base, _SPLITS) and isinstance(index, int):
        dim = base.kwargs.get("dim", base.args[2] if len(base.args) > 2 else 0)
        pieces = example_value(base)
        if dim not in (-1, ndim - 1) or not isinstance(pieces, tuple | list):
            return None
        start = sum(int(p.shape[-1]) for p in pieces[:index])
        return base.args[0], start, start + int(pieces[index].shape[-1])
    if not isinstance(base, torch.fx.Node) or not isinstance(index, tuple) or not index:
        return None
    last, rest = index[-1], index[:-1]
    if not isinstance(last, slice) or last.step not in (None, 1):
        return None
    if any(r is not Ellipsis and r != slice(None) for r in rest):
        return None
    if Ellipsis not in rest and len(index) != ndim:
        return None
    source = example_value(base)
    if not isinstance(source, torch.Tensor) or not isinstance(source.shape[-1], int):
        return None
    start, stop, _ = last.indices(source.shape[-1])
    return base, start, stop


def _every_other_column(node: torch.fx.Node, ndim: int) -> tuple[torch.fx.Node, int] | None:
    """(source, start) when ``node`` is ``x[..., start::2]`` (start 0 or 1) and nothing else."""
    if not _is_call(node, (operator.getitem,)):
        return None
    base, index = node.args
    if not isinstance(base, torch.fx.Node) or not isinstance(index, tuple) or not index:
        return None
    last, rest = index[-1], index[:-1]
    if not isinstance(last, slice) or last.step != 2 or last.start not in (None, 0, 1):
        return None
    if any(r is not Ellipsis and r != slice(None) for r in rest):
        return None
    source = example_value(base)
    if not isinstance(source, torch.Tensor) or source.dim() != ndim:
        return None
    width = source.shape[-1]
    if not isinstance(width, int) or width % 2 or last.stop not in (None, width):
        return None
    if Ellipsis not in rest and len(index) != ndim:
        return None
    return base, last.start or 0


def _match_interleaved(node: torch.fx.Node) -> Rotation | str | None:
    """``stack((±x[..., 1::2], ±x[..., ::2]), -1).flatten(-2)`` as an interleaved rotation."""
    args = {**dict(zip(("input", "start_dim", "end_dim"), node.args)), **node.kwargs}
    stacked = args.get("input")
    if args.get("start_dim") != -2 or args.get("end_dim", -1) != -1:
        return None
    if not _is_call(stacked, (torch.stack,)):
        return None
    tensors = stacked.args[0] if stacked.args else stacked.kwargs.get("tensors")
    dim = stacked.kwargs.get("dim", stacked.args[1] if len(stacked.args) > 1 else 0)
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or not isinstance(tensors, list | tuple):
        return None
    if dim not in (-1, value.dim()) or len(tensors) != 2:
        return None
    pieces, parts = [], [stacked]
    for tensor in tensors:
        sign = 1
        if _is_call(tensor, _NEG):
            parts.append(tensor)
            sign, tensor = -1, tensor.args[0]
        found = (
            _every_other_column(tensor, value.dim()) if isinstance(tensor, torch.fx.Node) else None
        )
        if found is None:
            return None
        parts.append(tensor)
        pieces.append((sign, *found))
    (sign0, src0, odd0), (sign1, src1, odd1) = pieces
    if src0 is not src1 or (odd0, odd1) != (1, 0):
        return "a stack of every other column that does not swap pairs is not fused"
    return _own_parts(node, Rotation(src0, 1, (sign0, sign1), tuple(dict.fromkeys(parts)), True))


def _own_parts(node: torch.fx.Node, rotation: Rotation) -> Rotation | str:
    """The rotation, or why not: a part that something besides it reads."""
    for part in rotation.parts:
        if any(user is not node and user not in rotation.parts for user in part.users):
            return f"{part.name} is also used outside the rotation"
    return rotation


def match_rotation(node: torch.fx.Node) -> Rotation | str | None:
    """The rotation a concatenation (or an interleaving ``flatten``, or a call of ``rotate``
    itself: passes/partial_rotary.py puts those in) computes, why it is not one, or None."""
    if _is_call(node, (rotate,)):
        args = dict(zip(("x", "shift", "signs", "interleaved", "width"), node.args))
        args.update(node.kwargs)
        return Rotation(args["x"], args["shift"], tuple(args["signs"]), (),
                        args.get("interleaved", False), args.get("width", 0))  # fmt: skip
    if _is_call(node, _FLATTENS):
        return _match_interleaved(node)
    if not _is_call(node, CAT_FUNCTIONS):
        return None
    tensors, dim = cat_arguments(node)
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or not isinstance(tensors, list | tuple):
        return "cat of values that are not tensors"
    ndim = value.dim()
    if dim not in (-1, ndim - 1) or len(tensors) != 2:
        return "a cat that is not a rotate_half (two parts along the last dim) is not fused"
    pieces, parts = [], []
    for tensor in tensors:
        sign = 1
        if _is_call(tensor, _NEG):
            parts.append(tensor)
            sign, tensor = -1, tensor.args[0]
        found = last_dim_slice(tensor, ndim) if isinstance(tensor, torch.fx.Node) else None
        if found is None:
            return "a cat of parts that are not slices of one tensor's last dim is not fused"
        parts.append(tensor)
        pieces.append((sign, *found))
    (sign0, src0, a0, b0), (sign1, src1, a1, b1) = pieces
    width = example_value(src0).shape[-1]
    if src0 is not src1 or not (b0 == width and a1 == 0 and b1 == a0 and 0 < a0 < width):
        return "a cat of slices that do not rotate one tensor's columns is not fused"
    return _own_parts(node, Rotation(src0, a0, (sign0, sign1), tuple(dict.fromkeys(parts))))


def rotate(
    x: torch.Tensor, shift: int, signs: tuple[int, int], interleaved: bool = False,
    width: int = 0,
) -> torch.Tensor:  # fmt: skip
    """The torch reference of a ``Rotation`` (what the matched nodes compute). ``width``:
    the first ``width`` columns rotated as a row of their own, zeros after them."""
    if width:
        rotated = rotate(x[..., :width], shift, signs, interleaved)
        return torch.cat((rotated, torch.zeros_like(x[..., width:])), dim=-1)
    if interleaved:
        odd, even = x[..., 1::2], x[..., ::2]
        return torch.stack((signs[0] * odd, signs[1] * even), dim=-1).flatten(-2)
    first, second = x[..., shift:], x[..., :shift]
    first = -first if signs[0] < 0 else first
    second = -second if signs[1] < 0 else second
    return torch.cat((first, second), dim=-1)
