"""The row family's ops: the callables a fused row group (and a pair of them) becomes in the
rewritten FX graph, with their precompile jobs (kernels/family.py's protocol)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from fusebackend.kernels import (
    KernelOptions,
    RowProgram,
    row_kernel,
    row_kernel_pair,
    triton_usable,
)
from fusebackend.kernels.family import concrete_cuda_tensor, launch_key
from fusebackend.kernels.launch import hinted_examples, precompile

__all__ = ["FusedGroupOp", "FusedPairOp"]


class FusedGroupOp:
    """The callable a fused group becomes in the rewritten FX graph.

    Runs the generated Triton kernel when Triton can run on the group's device (a CUDA
    device, or the CPU through ``TRITON_INTERPRET=1``), otherwise the group's original
    torch ops (``reference``), so a CPU-only machine still gets correct results.

    ``writing_into`` makes the variant that writes some outputs into tensors passed after
    its inputs (views of a concatenation's buffer: passes/concat_writes.py).
    """

    def __init__(
        self,
        program: RowProgram,
        kernel_name: str,
        reference: torch.fx.Graph,
        device: torch.device,
        options: KernelOptions,
    ) -> None:
        self.program = program
        self._reference_graph = reference
        self.options = options
        self.device = device
        self.use_triton = triton_usable(device)
        self.group = ""  # its GroupReport's name, for the report of a paired launch
        self.plans: dict = {}  # launches per input signature (kernels/launch.py)
        self.__name__ = kernel_name  # FX's generated code calls the node after this name
        self.__qualname__ = kernel_name
        # Outputs written into the tensors passed after the inputs, in their order; outputs
        # the program repeats (past the reference's own, each naming the one it repeats).
        self.into: tuple[int, ...] = ()
        self.repeats: tuple[int, ...] = ()

    def writing_into(self, into: Sequence[int], repeats: Sequence[int]) -> FusedGroupOp:
        """This group as an op that also outputs copies of its outputs ``repeats`` (appended
        in that order), and writes its outputs ``into`` (numbers among all of them) into the
        tensors passed after its inputs, returning those tensors as these outputs."""
        program = self.program
        extra = tuple(program.outputs[k] for k in repeats)
        op = FusedGroupOp(dataclasses.replace(program, outputs=(*program.outputs, *extra)),
                          self.__name__, self._reference_graph, self.device,
                          self.options)  # fmt: skip
        op.group = self.group
        op.into, op.repeats = tuple(into), tuple(repeats)
        return op

    @functools.cached_property
    def reference(self) -> torch.fx.GraphModule:
        """The group's torch ops as a module, compiled on first use (passes/rewrite.py)."""
        return torch.fx.GraphModule(torch.nn.Module(), self._reference_graph)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.into:
            if self.use_triton:
                return row_kernel(self.program, args, options=self.options, plans=self.plans)
            return tuple(self.reference(*args))
        count = len(args) - len(self.into)
        inputs, targets = args[:count], args[count:]
        if self.use_triton:
            out: list[torch.Tensor | None] = [None] * len(self.program.outputs)
            for k, target in zip(self.into, targets):
                out[k] = target
            return row_kernel(self.program, inputs, options=self.options, plans=self.plans,
                              out=out)  # fmt: skip
        outs = list(self.reference(*inputs))
        outs += [outs[k] for k in self.repeats]
        for k, target in zip(self.into, targets):
            outs[k] = target.copy_(outs[k])
        return tuple(outs)

    def describe(self) -> str:
        return self.__name__

    def precompile_job(self, args: Sequence[Any]) -> Any:
        """The kernel family's precompile job (kernels/family.py)."""
        return _row_precompile_job(self.use_triton, self.program, self.options, None, args,
                                   self.into)  # fmt: skip

    def __repr__(self) -> str:
        return f"FusedGroupOp({self.__name__})"


class FusedPairOp:
    """Two fused groups of one kernel run by one launch (passes/pairing.py): called on the
    first group's inputs then the second's, returns the first's outputs then the second's."""

    def __init__(self, first: FusedGroupOp, second: FusedGroupOp, split: int) -> None:
        self.first, self.second, self.split = first, second, split
        self.use_triton = first.use_triton and second.use_triton
        self.plans: dict = {}  # launches per input signature (kernels/launch.py)
        self.__name__ = f"{first.__name__}_pair"
        self.__qualname__ = self.__name__

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first, second = inputs[: self.split], inputs[self.split :]
        if self.use_triton:
            return row_kernel_pair(
                self.first.program, first, second, self.first.options, self.plans
            )
        return (*self.first(*first), *self.second(*second))

    def describe(self) -> str:
        return self.__name__

    def precompile_job(self, args: Sequence[Any]) -> Any:
        """The kernel family's precompile job (kernels/family.py)."""
        first = self.first
        return _row_precompile_job(self.use_triton, first.program, first.options, self.split, args)

    def __repr__(self) -> str:
        return f"FusedPairOp({self.__name__})"


def _row_precompile_job(
    use_triton: bool,
    program: RowProgram,
    options: KernelOptions,
    split: int | None,
    values: Sequence[Any],
    into: Sequence[int] = (),
) -> Any:
    """(key, job) compiling a row launch on ``values`` (a pair's: ``split``; the last of
    them written ``into`` those outputs: ``FusedGroupOp.writing_into``), or None."""
    if not use_triton:
        return None
    if not all(concrete_cuda_tensor(v) for v in values):
        # Symbolic shapes (dynamic=True, Dynamo's recompiles) or a number (a norm's eps):
        # compiled for the traced call's sizes (their hints), whose binary later lengths
        # of the same launch config share; none where a size has no hint
        values = hinted_examples(values)
        if values is None:
            return None
    key = ("group", program, options, split, tuple(into), *map(launch_key, values))
    if not into:
        return key, functools.partial(precompile, program, values, options, split)
    count = len(values) - len(into)
    out: list[Any] = [None] * len(program.outputs)
    for k, target in zip(into, values[count:]):
        out[k] = target
    return key, functools.partial(precompile, program, values[:count], options, None, out)
