"""First-run validation: is the fused graph's result the unfused graph's, within tolerance?"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["ELEMENT_FRACTION", "TOLERANCES", "mismatch", "one_line"]

# Per-dtype (rtol, atol) for the first-run comparison of fused against unfused outputs.
# Floating tensors are compared as a whole: ||fused - unfused|| <= rtol * ||unfused|| +
# atol * sqrt(numel) over the finite elements. An element-wise check was too strict: the
# fused kernels compute in fp32 and round once where eager rounds every op, and over a
# 22-layer fp16 Llama those differences grow. On an H100 (2026-11-23) it rejected a correct
# fused decode step over 1 logit of 32000 that was 0.0115 apart, and Inductor's own logits
# differ from eager's by 2.9e-3 relative on that model. A wrong kernel (a missing term, a
# wrong weight, an unwritten row) is off by far more than rtol in norm.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (3e-2, 1e-2),
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-9),
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-9),
}
# On top of the norm, no single element may be off by more than this fraction of the
# tensor's largest magnitude (plus atol): a few garbage elements hide in a large norm.
ELEMENT_FRACTION = 0.1


def mismatch(actual: Sequence[Any], expected: Sequence[Any], what: str) -> str | None:
    """Why ``actual`` is not ``expected`` within the per-dtype tolerances, or None.

    NaN must meet NaN and an infinity the infinity of the same sign, at the same positions.
    Dtypes without a tolerance (integers, bool) must be equal.
    """
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for j, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if isinstance(e, Tensor):
            if not isinstance(a, Tensor):
                return f"{what} {j} is a {type(a).__name__}, expected a tensor"
            why = _tensor_mismatch(a, e)
            if why is not None:
                return f"{what} {j}: {why}"
        elif isinstance(a, Tensor) or a != e:
            return f"{what} {j} is {a!r}, expected {e!r}"
    return None


def _tensor_mismatch(a: Tensor, e: Tensor) -> str | None:
    if a.shape != e.shape or a.dtype != e.dtype or a.device != e.device:
        return (
            f"{a.dtype}{list(a.shape)} on {a.device}, expected {e.dtype}{list(e.shape)} "
            f"on {e.device}"
        )
    if e.dtype not in TOLERANCES:
        return None if torch.equal(a, e) else f"not equal ({e.dtype} is compared exactly)"
    rtol, atol = TOLERANCES[e.dtype]
    a, e = a.detach(), e.detach()
    finite = torch.isfinite(e)
    if not torch.equal(finite, torch.isfinite(a)):
        return "NaN or infinity at other positions"
    # Non-finite positions: NaN meets NaN (NaN != NaN, so compare the NaN masks) and an
    # infinity meets the same infinity.
    if not torch.equal(a.isnan(), e.isnan()) or not torch.equal(a[a.isinf()], e[a.isinf()]):
        return "NaN or infinity differs"
    wide = torch.complex128 if e.is_complex() else torch.float64
    diff = (a[finite].to(wide) - e[finite].to(wide)).abs()
    ref = e[finite].to(wide).abs()
    if diff.numel() == 0:
        return None
    diff_norm, ref_norm = diff.norm().item(), ref.norm().item()
    if diff_norm > rtol * ref_norm + atol * diff.numel() ** 0.5:
        return (
            f"relative difference {diff_norm / ref_norm if ref_norm else float('inf'):.3g} "
            f"(norm; up to {rtol:g} allowed for {e.dtype})"
        )
    worst, bound = diff.max().item(), ELEMENT_FRACTION * ref.max().item() + atol
    if worst > bound:
        return f"one element {worst:.3g} apart (up to {bound:.3g} allowed for {e.dtype})"
    return None


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
