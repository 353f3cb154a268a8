"""Pads by nothing dropped (fused graph).

``F.pad(x, (0, 0, 0, 0))`` returns a copy of ``x``: one more kernel that reads and writes the
whole tensor. Models pad to a multiple of a window whatever the size, and at most sizes the
amounts are zero: timm's Swin pads every block's input to its window size and each patch
merging's to even sizes, 15 copies a call for Swin-T at 224 x 224 (traced on the CPU; the
amounts are plain ints in the graph). Such a pad is replaced by its input.

The result then aliases the input, so a pad stays where that could be seen: its input or
its result (or any tensor sharing their storage) written in place anywhere in the graph, a
graph input padded (the result could be returned as the user's own tensor), or both the
input and the result returned (two outputs sharing memory). A pad of another mode than
``constant``, or with amounts that are not all the int 0 (symbolic sizes), stays too.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from fusebackend.passes.fx_util import example_value, reaches_output
from fusebackend.passes.mutations import storage_id, written_storages

__all__ = ["drop_empty_pads"]

_PADS = (torch._C._nn.pad, F.pad, torch.constant_pad_nd)
# Methods and functions whose result can be a view of their first argument (output reach).
_VIEW_METHODS = {"view", "reshape", "permute", "transpose", "unsqueeze", "squeeze", "flatten",
                 "expand", "contiguous", "view_as", "reshape_as", "narrow", "t"}  # fmt: skip
_VIEW_FUNCTIONS = {torch.reshape, torch.permute, torch.transpose, torch.flatten, torch.narrow,
                   torch.unsqueeze, torch.squeeze, operator.getitem}  # fmt: skip


def drop_empty_pads(graph: torch.fx.Graph) -> list[str]:
    """Replace each pad by zero amounts with its input (module docstring); returns the names
    of the pads dropped."""
    written = written_storages(graph.nodes)
    dropped = []
    for pad in [n for n in graph.nodes if n.op == "call_function" and n.target in _PADS]:
        source = _empty_pad_source(pad)
        if source is None or source.op == "placeholder":
            continue
        if {storage_id(example_value(source)), storage_id(example_value(pad))} & written:
            continue
        if reaches_output(source, _may_alias) and reaches_output(pad, _may_alias):
            continue
        pad.replace_all_uses_with(source)
        graph.erase_node(pad)
        dropped.append(pad.name)
    if dropped:
        graph.lint()
    return dropped


def _empty_pad_source(pad: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor ``pad`` copies, where it pads by zero amounts in constant mode."""
    args = list(pad.args)
    source = args[0] if args else pad.kwargs.get("input")
    amounts = args[1] if len(args) > 1 else pad.kwargs.get("pad")
    mode = args[2] if len(args) > 2 else pad.kwargs.get("mode", "constant")
    if not isinstance(source, torch.fx.Node) or mode != "constant":
        return None
    if not isinstance(amounts, list | tuple) or not all(type(a) is int and a == 0 for a in amounts):
        return None
    return source


def _may_alias(node: torch.fx.Node) -> bool:
    """Can ``node``'s value be a view of its first argument (the ops above)?"""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS
