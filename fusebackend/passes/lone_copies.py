"""Copies that no group takes in, run as a row kernel of their own.

A ``.contiguous()``, ``clone`` or copying ``reshape`` of a view that no group writes or reads
(passes/folded_copies.py: its source is a cuBLAS output, its reader a linear) runs as ATen's
copy, and where the view is a permute ATen takes its generic N-d kernel
(``elementwise_kernel<128, 4>``, an element a thread, no vector loads). Swin's packed q/k/v
permuted to (3, windows, heads, N, d) and every attention's output
``transpose(1, 2).reshape(B, N, C)`` are two such copies a block: on an H200 at batch 8 the
two of Swin-T's first stage took 30.7 us, where Inductor's copies of q, k, v and the output,
four Triton kernels, took 14.2 (``benchmarks/diag/diag_swin_rows.py`` at a85573a). A row
kernel of one ``cast`` to the same dtype does the copy instead: it reads each row of the last
dim through the source's strides over the row dims (vector loads where they are aligned) and
writes the copy contiguous, as ``.contiguous()`` does; a ``reshape`` then views that copy.

Left to ATen: a source whose last dim is not unit-stride (a transpose of the last two dims: a
row kernel would read across rows), rows of fewer than 16 elements (not measured), dtypes
other than floating point, copies with a memory format, a ``clone`` that keeps its dense
source's strides (its result is not contiguous), sizes that are not plain ints.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from fusebackend.kernels.ir import InputRef, Instr, RowProgram
from fusebackend.passes.folded_copies import moves_elements_by_copy
from fusebackend.passes.fx_util import example_value, static_layout

__all__ = ["run_lone_copies"]

_MIN_ROW = 16  # elements of the last dim

MakeOp = Callable[[RowProgram, torch.fx.Node, torch.fx.Graph], Any]


def run_lone_copies(graph: torch.fx.Graph, make_op: MakeOp) -> list[str]:
    """Each copy left alone (module docstring) replaced by ``make_op(program, copy,
    reference)`` called on its source; returns the names of the copies replaced.
    ``reference``: the copy as a graph of torch ops, for devices Triton cannot run on."""
    replaced = []
    for node in list(graph.nodes):
        if not _runs_as_row_kernel(node):
            continue
        source = node.args[0]
        value = example_value(source)
        program = RowProgram(input_dtypes=(value.dtype,), lookups=(),
                             instrs=(Instr("cast", (InputRef(0),), value.dtype),),
                             outputs=(0,))  # fmt: skip
        with graph.inserting_before(node):
            call = graph.call_function(make_op(program, node, _reference()), (source,))
            copied = graph.call_function(operator.getitem, (call, 0))
            with getattr(value, "fake_mode", None) or contextlib.nullcontext():
                contiguous = value.contiguous()
            call.meta["example_value"] = (contiguous,)
            copied.meta["example_value"] = contiguous
            result = copied
            if tuple(value.shape) != tuple(example_value(node).shape):  # a reshape: a view
                result = graph.call_method("view", (copied, tuple(example_value(node).shape)))
                result.meta["example_value"] = example_value(node)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        replaced.append(node.name)
    if replaced:
        graph.lint()
    return replaced


def _runs_as_row_kernel(node: torch.fx.Node) -> bool:
    if not moves_elements_by_copy(node) or node.kwargs:
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name not in ("contiguous", "clone", "reshape", "flatten", "unflatten"):
        return False  # a roll moves elements along the row
    value = example_value(node.args[0])
    return (
        example_value(node).is_contiguous()  # a clone keeps a dense source's strides
        and static_layout(value)
        and value.dim() >= 2
        and value.dtype.is_floating_point
        and value.shape[-1] >= _MIN_ROW
        and value.stride(-1) == 1
    )


def _reference() -> torch.fx.Graph:
    graph = torch.fx.Graph()
    source = graph.placeholder("in0_source")
    graph.output((graph.call_method("contiguous", (source,)),))
    return graph
