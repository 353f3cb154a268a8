"""First-run validation: is the fused graph's result the unfused graph's, within tolerance?"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["TOLERANCES", "mismatch", "one_line"]

# Per-dtype (rtol, atol) for the first-run comparison of fused against unfused outputs. The
# fused kernel computes in fp32 and rounds once; eager rounds every op to fp16/bf16, so the
# two legitimately differ by a few ulps of the storage type per op in the chain. Row kernels
# also sum in another order than eager: a 1-layer Llama of hidden 2048 in fp32 (CPU,
# interpreter) gave logits 1.76e-5 apart where they are near 0, so fp32's atol is 1e-4 (a
# wrong kernel is off by far more than that).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1e-4, 1e-4),
    torch.complex128: (1e-7, 1e-7),
}


def mismatch(actual: Sequence[Any], expected: Sequence[Any], what: str) -> str | None:
    """Why ``actual`` is not ``expected`` within the per-dtype tolerances, or None.

    NaN equals NaN and an infinity equals the infinity of the same sign (assert_close's
    ``equal_nan``; infinities are compared exactly, so -inf against +inf is a mismatch).
    """
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for j, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if isinstance(e, Tensor):
            if not isinstance(a, Tensor):
                return f"{what} {j} is a {type(a).__name__}, expected a tensor"
            # Dtypes not in the table get assert_close's defaults (exact for integers).
            rtol, atol = TOLERANCES.get(e.dtype, (None, None))
            try:
                torch.testing.assert_close(
                    a, e, rtol=rtol, atol=atol, equal_nan=True, check_stride=False
                )
            except AssertionError as exc:
                return f"{what} {j}: {one_line(exc)}"
        elif isinstance(a, Tensor) or a != e:
            return f"{what} {j} is {a!r}, expected {e!r}"
    return None


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
