"""Kernels: a GroupSpec becomes generated Triton source and a compiled launcher.

Never sees an FX graph. Importing this package does not import Triton; the launcher does,
on first use.
"""

from fusebackend.kernels.launch import embedding_chain, kernel_source, triton_usable
from fusebackend.kernels.spec import (
    Const,
    GroupSpec,
    InputRef,
    Instr,
    KernelOptions,
    Lookup,
    ValueRef,
)

__all__ = [
    "Const",
    "GroupSpec",
    "InputRef",
    "Instr",
    "KernelOptions",
    "Lookup",
    "ValueRef",
    "embedding_chain",
    "kernel_source",
    "triton_usable",
]
