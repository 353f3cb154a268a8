"""GPU-only checks of the fused kernels: device results, CUDA-graph capture, no host sync,
and the device-side index assert. Run on a CUDA machine: pytest -m gpu."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusebackend
from fusebackend.kernels import row_kernel
from fusebackend.kernels.ir import Const, InputRef, Instr, Lookup, RowProgram, ValueRef

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


class TokPos(nn.Module):
    def __init__(self, vocab: int, max_pos: int, dim: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_pos, dim)
        self.bias = nn.Parameter(torch.randn(dim))
        self.scale = math.sqrt(dim)

    def forward(self, ids, pos_ids):
        return F.gelu(self.tok(ids) * self.scale + self.pos(pos_ids)) * 0.5 + self.bias


def _chain_spec(dtype: torch.dtype) -> RowProgram:
    # v0 = tab[ids]; v1 = v0 * 2.5; v2 = v1 + bias
    return RowProgram(
        input_dtypes=(torch.int64, dtype, dtype),
        lookups=(Lookup(0, 1),),
        instrs=(
            Instr("mul", (ValueRef(0), Const("2.5")), dtype),
            Instr("add", (ValueRef(1), InputRef(2)), dtype),
        ),
        outputs=(2,),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_compiled_chain_on_device_matches_eager(dtype, index_dtype):
    model = TokPos(1000, 64, 131).cuda().to(dtype).eval()
    ids = torch.randint(0, 1000, (3, 37), device="cuda", dtype=index_dtype)
    pos = torch.arange(37, device="cuda", dtype=index_dtype)[None]
    with torch.no_grad():
        report = fusebackend.explain(model, ids, pos, options={"cudagraphs": False})
        compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})
        out = compiled(ids, pos)
        ref = model(ids, pos)
    assert report.groups and report.groups[0].backend == "triton"
    assert len(report.groups[0].lookups) == 2
    assert out.device.type == "cuda"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "batch, seq, dim",
    [
        (2, 5, 24),  # several rows per program, 4 warps
        (3, 7, 2500),  # three column blocks (BLOCK_D is at most 1024 in small groups)
        (1, 1, 3072),  # a decode row: three 1024-wide programs of 8 warps
        (3, 1100, 700),  # 2.3M elements: above launch.py's small-group limit, 2 warps
        (1, 2100, 4100),  # 8.6M elements, five 1024-column blocks, 2 warps
    ],
)
def test_every_launch_config_regime_matches_eager(batch, seq, dim):
    from fusebackend.kernels import configs, launch

    rows = batch * seq
    block_r, block_d, warps = launch.launch_config(rows, dim, gathers=True)
    if rows * dim <= configs.SMALL_GROUP_ELEMENTS:
        assert block_d <= 1024 and warps == max(1, min(8, block_r * block_d // 128))
    else:
        assert block_d <= 1024 and warps == 2
    assert block_r >= 1
    model = TokPos(1000, seq, dim).cuda().half().eval()
    ids = torch.randint(0, 1000, (batch, seq), device="cuda")
    pos = torch.arange(seq, device="cuda")[None]
    with torch.no_grad():
        compiled = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})
        out = compiled(ids, pos)
        ref = model(ids, pos)
    assert fusebackend.last_report().groups[0].backend == "triton"
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("windows", "heads", "width"), [(37, 3, 49), (5, 2, 197), (3, 1, 250)])
def test_unaligned_rows_in_one_warp_match_eager(dtype, windows, heads, width):
    # Rows of 49, 197 or 250 start off the 16-element grid: one warp per program
    # (configs.UNALIGNED_ROW_ELEMENTS), its reductions within the warp, on the device.
    from fusebackend.kernels import launch

    asked = []
    real = launch.launch_config

    def spy(*args, **kwargs):
        config = real(*args, **kwargs)
        asked.append((kwargs.get("aligned", True), config))
        return config

    scores = torch.randn(windows, heads, width, width, device="cuda").to(dtype)
    bias = torch.randn(1, heads, width, width, device="cuda").to(dtype)
    compiled = torch.compile(lambda a, b: (a + b).softmax(-1), backend="infinifuse",
                             options={"cudagraphs": False})  # fmt: skip
    launch.launch_config = spy
    try:
        with torch.no_grad():
            out = compiled(scores, bias)
    finally:
        launch.launch_config = real
    (aligned, (_, _, warps)), *_ = asked
    assert not aligned and warps == 1, asked
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, (scores + bias).softmax(-1), rtol=rtol, atol=atol)


def test_kernel_is_capturable_in_cuda_graph_without_host_sync():
    dtype = torch.float16
    spec = _chain_spec(dtype)
    table = torch.randn(5000, 257, device="cuda", dtype=dtype)
    bias = torch.randn(257, device="cuda", dtype=dtype)
    static_ids = torch.randint(0, 5000, (4, 9), device="cuda")
    row_kernel(spec, [static_ids, table, bias])  # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        torch.cuda.set_sync_debug_mode("error")
        try:
            row_kernel(spec, [static_ids, table, bias])  # any host sync raises here
            with torch.cuda.graph(graph, stream=stream):
                (static_out,) = row_kernel(spec, [static_ids, table, bias])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for _ in range(3):
        new_ids = torch.randint(0, 5000, (4, 9), device="cuda")
        static_ids.copy_(new_ids)
        graph.replay()
        expected = table[new_ids] * 2.5 + bias
        torch.testing.assert_close(static_out, expected, rtol=1e-2, atol=1e-2)


def test_out_of_range_index_is_a_device_side_assert():
    # A device-side assert poisons the CUDA context, so it runs in its own process.
    code = textwrap.dedent(
        """
        import torch
        from fusebackend.kernels import row_kernel
        from fusebackend.kernels.ir import Const, RowProgram, InputRef, Instr, Lookup, ValueRef
        f32 = torch.float32
        spec = RowProgram((torch.int64, f32, f32), (Lookup(0, 1),), (
            Instr("mul", (ValueRef(0), Const("2.5")), f32),
            Instr("add", (ValueRef(1), InputRef(2)), f32)), (2,))
        table = torch.randn(10, 8, device="cuda")
        bias = torch.randn(8, device="cuda")
        ids = torch.tensor([[1, 2, 10]], device="cuda")
        out = row_kernel(spec, [ids, table, bias])[0]
        torch.cuda.synchronize()
        print("NO ERROR", out.sum().item())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    assert "NO ERROR" not in proc.stdout
    assert "assert" in (proc.stderr + proc.stdout).lower()
