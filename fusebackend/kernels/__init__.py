"""Kernels: a RowProgram becomes generated Triton source and a compiled launcher.

Never sees an FX graph. Importing this package does not import Triton; the launcher does,
on first use, through ``triton_api.py`` (the one module that touches Triton's API).
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
