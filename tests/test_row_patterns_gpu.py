"""GPU: every row pattern at the full row widths (persistent up to 8192, chunked above),
decode and prefill row counts, each ONE group, equal to eager on the device; and a row
kernel captured in a CUDA graph. Run on a CUDA machine: pytest -m gpu."""

from __future__ import annotations

import pytest
import torch
from helpers import FLOAT_DTYPES, assert_close, eager, run_fused, single_group
from test_row_patterns import PATTERNS, _args

import fusebackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _to_cuda(args):
    return tuple(a.cuda() for a in args)


# Each dtype gets two (width, lead) cases, so that across the three dtypes every pattern meets
# one-element rows, a tile width, a persistent width, a non-power-of-two width just over a
# power of two, the largest persistent width, a chunked width, and zero rows. The full product
# (796 cases, ~3.8 s each to compile) ran past a 10-minute device call on an H100, 2026-11-23.
CASES = {
    torch.float32: [(127, (3, 37)), (11008, (1, 1))],
    torch.float16: [(1, (1, 1)), (4097, (3, 37))],
    torch.bfloat16: [(768, (0, 4)), (8192, (1, 1))],
}
DEVICE_CASES = [(dtype, w, lead) for dtype, cases in CASES.items() for w, lead in cases]


@pytest.mark.parametrize(("dtype", "width", "lead"), DEVICE_CASES, ids=str)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_on_device(name, dtype, width, lead):
    fn, reductions, lookups = PATTERNS[name]
    g = torch.Generator().manual_seed(width)
    args = _to_cuda(_args(name, lead, width, dtype, g))
    expected = eager(fn, *args)
    actual, report = run_fused(fn, *args, options={"cudagraphs": False})
    override = {}
    if dtype == torch.float32 and reductions:
        override = {"rtol": 1e-5, "atol": 1e-5}  # see test_row_patterns' docstring
    elif dtype == torch.bfloat16 and reductions:
        override = {"rtol": 2e-2, "atol": 0.0625}
    assert_close(actual, expected, **override)
    group = single_group(report)
    assert len(group.reductions) == reductions and len(group.lookups) == lookups, str(report)
    assert group.kernel_name.startswith("_row_kernel_" if reductions else "_pointwise_kernel_")


def test_row_kernel_in_cuda_graph_equals_eager():
    fn = PATTERNS["residual_rms"][0]
    g = torch.Generator().manual_seed(0)
    args = _to_cuda(_args("residual_rms", (1, 1), 4096, torch.float16, g))
    expected = eager(fn, *args)
    compiled = torch.compile(fn, backend="infinifuse", options={"validate": False})
    with torch.no_grad():
        for _ in range(3):  # capture, then replays
            actual = compiled(*args)
    assert_close(actual, expected)
    modes = [e["mode"] for e in fusebackend.last_report().graphs[-1].runtime_modes()]
    assert modes == ["fusion"], modes


@pytest.mark.parametrize(("dtype", "width", "lead"), DEVICE_CASES, ids=str)
@pytest.mark.parametrize("name", ["fp32", "log", "scaled_masked"])
def test_softmax_on_device(name, dtype, width, lead):
    from test_row_rope_softmax import SOFTMAX, _mask

    g = torch.Generator().manual_seed(width)
    lead = (2, *lead)  # softmax over attention scores: a batch and a head dimension
    x = (torch.randn(*lead, width, generator=g) * 3).to(dtype).cuda()
    mask = _mask(lead, width, dtype, g).cuda()
    expected = eager(SOFTMAX[name], x, mask)
    actual, report = run_fused(SOFTMAX[name], x, mask, options={"cudagraphs": False})
    override = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    assert_close(actual, expected, **override)
    assert len(single_group(report).reductions) == 1, str(report)


@pytest.mark.parametrize("width", [2, 128])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_rope_on_device(dtype, width):
    from test_row_rope_softmax import _rope_tolerance, rope_slices

    g = torch.Generator().manual_seed(width)
    q = torch.randn(2, 8, 33, width, generator=g).to(dtype).cuda()
    angles = torch.rand(33, width, generator=g) * 6.3
    cos, sin = angles.cos().to(dtype).cuda(), angles.sin().to(dtype).cuda()
    expected = eager(rope_slices, q, cos, sin)
    actual, report = run_fused(rope_slices, q, cos, sin, options={"cudagraphs": False})
    assert_close(actual, expected, **_rope_tolerance(dtype))
    assert len(single_group(report).moves) == 1, str(report)
