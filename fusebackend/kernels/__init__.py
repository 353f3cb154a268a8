"""Kernels: a RowProgram becomes generated Triton source and a compiled launcher.

Never sees an FX graph. Importing this package does not import Triton; the launcher does,
on first use.
"""

from fusebackend.kernels.ir import (
    Const,
    InputRef,
    Instr,
    KernelOptions,
    Lookup,
    Reduce,
    RowProgram,
    ValueRef,
)
from fusebackend.kernels.launch import kernel_source, row_kernel, row_kernel_pair, triton_usable

__all__ = [
    "Const",
    "InputRef",
    "Instr",
    "KernelOptions",
    "Lookup",
    "Reduce",
    "RowProgram",
    "ValueRef",
    "kernel_source",
    "row_kernel",
    "row_kernel_pair",
    "triton_usable",
]
