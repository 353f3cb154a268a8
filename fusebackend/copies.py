"""The backend's steps for copies that only reorder elements: folded into the groups that
write or read them (passes/folded_copies.py), or, where no group takes one, run as a row
kernel of its own (passes/lone_copies.py). Both keep the report true to what runs: a group
whose launch the folds changed gets its kernel name and source again, and each copy run on
its own is listed as a group of one node with its kernel."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from fusebackend.kernels import KernelOptions, kernel_source
from fusebackend.kernels.ir import RowProgram
from fusebackend.kernels.launch import launch_rank, layout_for
from fusebackend.kernels.shapes import value_shapes
from fusebackend.passes.folded_copies import fold_copies_into_groups
from fusebackend.passes.fx_util import example_value
from fusebackend.passes.lone_copies import run_lone_copies as replace_lone_copies
from fusebackend.pipeline import Compilation, drop_rejections
from fusebackend.report import GroupReport, row_groups
from fusebackend.row_ops import FusedGroupOp

__all__ = ["fold_copies", "run_lone_copies"]


def fold_copies(c: Compilation) -> list[str]:
    """Copies folded into groups; a group whose launch changed with them (finer row dims,
    rows gathered or placed) gets its report's kernel name and source again, and its op
    that name: what ``explain``, the launch counts and a profile show then agree."""
    assert c.graph is not None
    before = {n: (n.target, n.args) for n in c.graph.nodes if hasattr(n.target, "writing_into")}
    names = drop_rejections(c, lambda g: fold_copies_into_groups(g, c.gm))
    reports = {r.name: k for k, r in enumerate(c.groups)}
    live = set(c.graph.nodes)  # (the pass's dead-code elimination erases a group nobody read)
    for node, traced in before.items():
        op = node.target
        if node not in live or (op, node.args) == traced or op.group not in reports:
            continue
        inputs = [example_value(a) if isinstance(a, torch.fx.Node) else a
                  for a in node.args[: len(op.program.input_dtypes)]]  # fmt: skip
        name, source = _kernel(op.program, inputs, op.options)
        k = reports[op.group]
        c.groups[k] = dataclasses.replace(c.groups[k], kernel_name=name, source=source)
        op.__name__ = op.__qualname__ = name
    return names


def run_lone_copies(c: Compilation) -> list[str]:
    """Copies no group took in, each run as a row kernel (a group of one node, reported)."""
    assert c.graph is not None
    options = KernelOptions(c.config.index_checks, c.config.round_intermediates)

    def make_op(program: RowProgram, copy: torch.fx.Node,
                reference: torch.fx.Graph) -> FusedGroupOp:  # fmt: skip
        source = copy.args[0]
        assert isinstance(source, torch.fx.Node)
        value = example_value(source)
        name, text = _kernel(program, [value], options)
        report = GroupReport(name=f"group{row_groups(c.groups)}", kernel_name=name,
                             nodes=(copy.name,),
                             lookups=(), inputs=(source.name,), outputs=(copy.name,),
                             source=text, backend="triton")  # fmt: skip
        c.groups.append(report)
        op = FusedGroupOp(program, name, reference, value.device, options)
        op.group = c.groups[-1].name
        return op

    return replace_lone_copies(c.graph, make_op)


def _kernel(program: RowProgram, inputs: list, options: KernelOptions) -> tuple[str, str]:
    """(kernel name, source) of ``program`` launched on tensors like ``inputs``."""
    width = value_shapes(program, inputs)[1][-1]
    return kernel_source(program, launch_rank(program, inputs) or 1, options,
                         layout_for(program, width))  # fmt: skip
