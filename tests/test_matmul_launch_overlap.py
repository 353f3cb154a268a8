"""Programmatic dependent launch and the weight prefetch of matmul groups
(``kernels.dependent_launch.USE_PDL``, ``PREFETCH_K``): on Hopper a group's launch overlaps the
previous group's tail, and each program asks L2 for its first weights before it waits. The
results must be the same bits as without either, in eager launches and in a CUDA graph;
elsewhere (a CPU, Triton's interpreter, an older GPU) neither is compiled in."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close

from fusebackend.kernels import dependent_launch, matmul
from fusebackend.kernels.ir import MatmulGroup

_O = MatmulGroup(residual=True)
_GATE_UP = MatmulGroup(siblings=2, norm="rms", eps=1e-5, gate="silu")
_QKV = MatmulGroup(siblings=3, norm="rms", eps=1e-6, bias=True)
_CONV1D = MatmulGroup(norm="layer", eps=1e-5, norm_bias=True, bias=True, weight_layout="kn")


def _launch_meta(x: torch.Tensor) -> dict:
    weight = torch.randn(48, x.shape[-1], device=x.device, dtype=x.dtype)
    residual = x.new_zeros(*x.shape[:-1], 48)
    _, _, meta, _ = matmul._launch(_O, x, None, None, residual, (weight,), ())
    return meta


def test_neither_is_compiled_in_off_the_gpu():
    meta = _launch_meta(torch.randn(1, 64))
    assert meta["PDL"] is False and "launch_pdl" not in meta
    assert meta["PREFETCH"] == 0


def _chain(hidden: int, inner: int, dtype: torch.dtype):
    """Weights and a step of groups whose weights take each path of the prefetch: [N, K]
    pairs and triples, a long K split in slices (narrow down projection), and a Conv1D
    weight stored [K, N] (not prefetched)."""
    g = torch.Generator(device="cuda").manual_seed(3)

    def rand(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5).to(dtype)

    o, norm, gate, up, down = (rand(hidden, hidden), rand(hidden) + 1, rand(inner, hidden),
                               rand(inner, hidden), rand(hidden, inner))  # fmt: skip
    qkv = [rand(n, hidden) for n in (hidden, hidden // 4, hidden // 4)]
    qkv_bias = [rand(n) for n in (hidden, hidden // 4, hidden // 4)]
    conv, conv_bias, ln_w, ln_b = (
        rand(hidden, 3 * hidden),
        rand(3 * hidden),
        rand(hidden),
        rand(hidden),
    )
    ops = {group: matmul.matmul_op(group) for group in (_O, _GATE_UP, _QKV, _CONV1D)}

    def step(x: torch.Tensor) -> list[torch.Tensor]:
        (h,) = ops[_O](x, None, None, x, o)
        (a,) = ops[_GATE_UP](h, norm, None, None, gate, up)
        (y,) = matmul.matmul_op(_O)(a, None, None, h, down)  # K = inner: split-K when narrow
        q, k, v = ops[_QKV](y, norm, None, None, *qkv, *qkv_bias)
        (c,) = ops[_CONV1D](y, ln_w, ln_b, None, conv, conv_bias)
        return [y, q, k, v, c]

    def reference(x: torch.Tensor) -> list[torch.Tensor]:
        def rms(t, w, eps):
            t32 = t.float()
            return w * (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

        h = x + x @ o.t()
        a = torch.nn.functional.silu(rms(h, norm, 1e-5) @ gate.t()) * (rms(h, norm, 1e-5) @ up.t())
        y = h + a @ down.t()
        n = rms(y, norm, 1e-6)
        ln = torch.nn.functional.layer_norm(y, (hidden,), ln_w, ln_b, 1e-5)
        return [y, *(n @ w.t() + b for w, b in zip(qkv, qkv_bias)), ln @ conv + conv_bias]

    return step, reference


def _run(step, x: torch.Tensor, pdl: bool, prefetch: int, graph: bool) -> list[torch.Tensor]:
    saved = dependent_launch.USE_PDL, matmul.PREFETCH_K
    dependent_launch.USE_PDL, matmul.PREFETCH_K = pdl, prefetch
    try:
        if not graph:
            return [t.clone() for t in step(x)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(x)  # compiles and loads the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            outs = step(x)
        for _ in range(3):
            captured.replay()
        torch.cuda.synchronize()
        return [t.clone() for t in outs]
    finally:
        dependent_launch.USE_PDL, matmul.PREFETCH_K = saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_overlapped_launches_give_the_same_bits(dtype, rows):
    hidden, inner = 896, 4864  # Qwen2-0.5B's: its down projection splits K
    step, reference = _chain(hidden, inner, dtype)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert _launch_meta(x)["PDL"] is hopper and _launch_meta(x)["PREFETCH"] == matmul.PREFETCH_K
    plain = _run(step, x, pdl=False, prefetch=0, graph=False)
    for expected, actual in zip(reference(x), plain):
        assert_close(actual, expected, rtol=3e-2, atol=3e-2)
    for graph in (False, True):
        overlapped = _run(step, x, pdl=True, prefetch=256, graph=graph)
        for a, b in zip(plain, overlapped):
            assert torch.equal(a, b), (graph, (a - b).abs().max())
