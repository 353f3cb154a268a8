"""Pads by zero amounts dropped (passes/empty_pads.py).

timm's Swin pads each block's normed input to its window size, by zeros at 224 x 224: the pad
is dropped from the fused graph and outputs equal eager's. A pad whose dropping could be
seen stays: of a graph input, with its input written in place later, with both its input and
its result returned, and a pad by real amounts or in another mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, compile_fused, run_fused

import fusebackend


def _dropped() -> list[str]:
    return fusebackend.last_report().graphs[-1].rewrites.get("empty_pads", [])


def _pads_left() -> int:
    graph = fusebackend.last_report().graphs[-1].runtime._fused.graph  # what runs fused
    return sum(n.op == "call_function" and n.target is torch._C._nn.pad for n in graph.nodes)


def swin_partition(x, weight, bias, window: int = 3):
    """Swin's block start: LayerNorm, pad to the window (by nothing here), windows."""
    b, h, w, c = x.shape
    y = F.layer_norm(x, (c,), weight, bias)
    y = F.pad(y, (0, 0, 0, (window - w % window) % window, 0, (window - h % window) % window))
    y = y.view(b, h // window, window, w // window, window, c).permute(0, 1, 3, 2, 4, 5)
    return y.contiguous().view(-1, window * window, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swin_window_pad_by_nothing_is_dropped(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 9, 10, generator=g).to(dtype)
    weight, bias = torch.randn(10, generator=g).to(dtype), torch.randn(10, generator=g).to(dtype)
    out, _ = run_fused(swin_partition, x, weight, bias)
    assert_close(out, swin_partition(x, weight, bias))
    assert len(_dropped()) == 1, str(fusebackend.last_report())
    assert _pads_left() == 0


def test_what_is_left_as_traced():
    # (each graph has a group, so the fused graph's passes run on it)
    def an_input(x):
        return torch.sigmoid(x) * 2.0, F.pad(x, (0, 0))  # the user's own tensor returned?

    def written_later(x):
        t = torch.sigmoid(x) * 2.0
        y = F.pad(t, (0, 0))
        t[:, 0] = 0.0  # (left in place) the pad's copy keeps the old column
        return y + 1.0, t

    def both_returned(x):
        t = torch.sigmoid(x) * 2.0
        return t, F.pad(t, (0, 0))

    def real_amounts(x):
        return F.pad(torch.sigmoid(x) * 2.0, (1, 0)) + 1.0

    def another_mode(x):
        return F.pad((torch.sigmoid(x) * 2.0)[None], (0, 0), mode="replicate") + 1.0

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for fn in (an_input, written_later, both_returned, real_amounts, another_mode):
        torch._dynamo.reset()
        with torch.no_grad():
            got = compile_fused(fn)(x)
            assert_close(got, fn(x.clone()))
        report = fusebackend.last_report()
        assert report.graphs[-1].path == "fused", (fn.__name__, str(report))
        assert _dropped() == [], (fn.__name__, str(report))
        outs = got if isinstance(got, tuple) else (got,)
        ptrs = [t.data_ptr() for t in outs]
        assert x.data_ptr() not in ptrs and len(set(ptrs)) == len(ptrs), fn.__name__
