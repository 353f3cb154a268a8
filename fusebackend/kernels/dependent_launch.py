"""Programmatic dependent launch (PDL, Hopper and newer): a kernel may start before the
previous one on its stream has ended.

The previous kernel releases its successor (``gdc_launch_dependents``) once each of its
programs is past its main loop; the successor's programs do what reads nothing the previous
kernel writes (a matmul group asks L2 for its first weights), then wait for the previous
kernel's end and the visibility of its writes (``gdc_wait``) before their first read of
anything it may have written. A kernel launched this way after one that never releases it
starts when that one ends, as without PDL. Each launcher reads ``USE_PDL`` at each call, so
a captured CUDA graph keeps what it was captured with; ``benchmarks/suite`` (backend
``infinifuse-nopdl``) and ``benchmarks/diag/diag_matmul_pdl.py`` flip it to measure it.

Measured on an H100 (``diag_matmul_pdl.py``: 22 TinyLlama-shape MLP blocks, 66 matmul-group
launches in one CUDA graph): 836 us without, 808 with PDL, 785 with PDL and the matmul
groups' weight prefetch (``matmul_pdl_prefetch_h100.json``). Released at the start of each
program instead, the successors' waiting programs made the chain slower: 904 against 825 us
(``matmul_pdl_early_release_h100.json``).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["USE_PDL", "nvidia_gpu", "pdl_launch"]

USE_PDL = True


def pdl_launch(device: torch.device) -> bool:
    """Whether a kernel on ``device`` is launched as a programmatic dependent (and so must
    wait inside before its first read of what earlier kernels wrote)."""
    return USE_PDL and nvidia_gpu(device) and _supported(device.index)


def nvidia_gpu(device: torch.device) -> bool:
    """An NVIDIA GPU: griddepcontrol and the kernels' inline PTX (a ROCm build of torch
    also names its GPUs "cuda")."""
    return device.type == "cuda" and torch.version.hip is None


@functools.cache
def _supported(index: int | None) -> bool:
    """griddepcontrol exists from compute capability 9.0 (Hopper)."""
    return torch.cuda.get_device_capability(index) >= (9, 0)
