"""The CPU path without Triton's interpreter: groups are found and reported, not rewritten.

A rewritten group would run its torch reference through one more module call per group and
call (+4-5 us per group on a 2-core CPU), so fusion on would be slower than off there. The
graph runs as traced instead; the report still lists each group and says why it is not run
fused.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, compile_fused, eager

import fusebackend
import fusebackend.backend


def residual_rms(x, r, w):
    h = x + r
    return h, F.rms_norm(h, (x.shape[-1],), w, 1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of a CPU-only machine")
def test_groups_are_reported_but_not_rewritten_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, r, w = torch.randn(3, 33), torch.randn(3, 33), torch.randn(33)
    called = mock.Mock(side_effect=AssertionError("a group ran through FusedGroupOp"))
    with mock.patch.object(fusebackend.backend.FusedGroupOp, "__call__", called):
        compiled = compile_fused(residual_rms)
        with torch.no_grad():
            actual = compiled(x, r, w)
    assert_close(actual, eager(residual_rms, x, r, w))
    report = fusebackend.last_report()
    (group,) = report.groups
    assert group.backend == (
        "not rewritten: Triton cannot run on cpu (the CPU needs TRITON_INTERPRET=1)"
    )
    assert group.reductions == ("rms_norm",) and "_row_kernel_" in group.kernel_name
    graph = report.graphs[-1]
    # The traced graph runs once per call: no fused callable, nothing validated against it.
    assert [e["mode"] for e in graph.runtime_modes()] == ["eager"]
    assert fusebackend.stats()["fusion_attempts"] == 0
    assert not called.called
