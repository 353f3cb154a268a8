"""A whole-tensor ``any`` or ``all`` split into rows first (fused graph).

T5 in fp16 checks ``torch.isinf(h).any()`` after every sublayer, a flag that picks the
clamp bound. In eager that is three launches a sublayer (``abs``, a compare, the reduction),
and a row group cannot take a reduction over every dim: its programs each hold whole rows.
``x.any()`` of a tensor of two or more dims is ``x.any(-1, keepdim=True).any()``: the row
reduction joins the group computing ``x`` (``isinf`` and its rows' ``any``: one kernel), and
the rest reduces one bool per row. ``all`` alike. Exact: both are logical reductions.

Split only where the last dim is a static size above 1 and nothing else is asked of the
call (no ``dim``, no ``out``).
"""

from __future__ import annotations

import torch
import torch.fx

from fusebackend.passes.fx_util import call_evaluated, example_value

__all__ = ["split_full_reductions"]

_SPELLINGS = {torch.any: torch.any, torch.Tensor.any: torch.any, "any": torch.any,
              torch.all: torch.all, torch.Tensor.all: torch.all, "all": torch.all}  # fmt: skip


def split_full_reductions(graph: torch.fx.Graph) -> list[str]:
    """Rewrite each whole-tensor ``any``/``all`` as a last-dim one and the rest (module
    docstring); returns the names of the nodes split."""
    split = []
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method") or node.kwargs:
            continue
        reduce = _SPELLINGS.get(node.target)
        if reduce is None or len(node.args) != 1 or not isinstance(node.args[0], torch.fx.Node):
            continue
        value = example_value(node.args[0])
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        width = value.shape[-1]
        if not isinstance(width, int) or width < 2:
            continue
        with graph.inserting_before(node):
            rows = call_evaluated(graph, reduce, (node.args[0], -1), {"keepdim": True})
            whole = call_evaluated(graph, reduce, (rows,))
        node.replace_all_uses_with(whole)
        graph.erase_node(node)
        split.append(node.name)
    if split:
        graph.lint()
    return split
