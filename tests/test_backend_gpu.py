"""GPU-only: the whole backend (Dynamo -> fusion -> CUDA-graph cache) on real models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusebackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class Embedder(nn.Module):
    def __init__(self, move_ids: bool = False, sync: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(1000, 96)
        self.pos = nn.Embedding(64, 96)
        self.move_ids, self.sync = move_ids, sync

    def forward(self, ids):
        if self.move_ids:
            ids = ids.to(self.tok.weight.device)
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        x = F.gelu(self.tok(ids) * math.sqrt(96) + self.pos(pos))
        if self.sync:
            x = x * (x.sum() > 0).item()  # a host sync: cannot be captured
        return x.half()


def _ids(*shape, device="cuda"):
    return torch.randint(0, 1000, shape, device=device)


def test_fused_graph_is_captured_replayed_and_never_stale():
    model = Embedder().cuda().eval()
    with torch.no_grad():
        compiled = torch.compile(model, backend="infinifuse")
        first_ids = _ids(3, 11)
        kept = compiled(first_ids)
        for _ in range(4):
            compiled(_ids(3, 11))  # same shape, other data: replays
        torch.testing.assert_close(kept, model(first_ids), rtol=1e-2, atol=1e-2)
        ids = _ids(3, 11)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = compiled(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.testing.assert_close(out, model(ids), rtol=1e-2, atol=1e-2)
    stats = fusebackend.stats()
    assert stats["recordings"] == 1 and stats["cache_hits"] >= 5
    assert set(stats["fusion_modes"].values()) == {"fusion"}
    assert stats["fusion_successes"] == 1
    assert fusebackend.last_report().groups[0].backend == "triton"


def test_cpu_ids_moved_inside_forward_stay_in_one_captured_graph():
    model = Embedder(move_ids=True).cuda().eval()
    with torch.no_grad():
        compiled = torch.compile(model, backend="infinifuse")
        for _ in range(3):
            ids = _ids(2, 9, device="cpu")
            out = compiled(ids)
            torch.testing.assert_close(out, model(ids), rtol=1e-2, atol=1e-2)
    report = fusebackend.last_report()
    assert report.graphs[0].host_inputs, str(report)
    stats = fusebackend.stats()
    assert set(stats["fusion_modes"].values()) == {"fusion"}, stats
    assert stats["recordings"] == 1


def test_model_without_the_move_fails_like_eager():
    model = Embedder().cuda().eval()
    ids = _ids(2, 9, device="cpu")
    with torch.no_grad(), pytest.raises(Exception) as eager_error:
        model(ids)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception) as compiled_error:
        torch.compile(model, backend="infinifuse")(ids)
    message = str(compiled_error.value)
    assert "cpu" in message and "cuda" in message, message
    assert "cpu" in str(eager_error.value)


@torch._dynamo.config.patch(capture_scalar_outputs=True)  # keep .item() inside the graph
def test_host_sync_in_model_falls_back_to_eager_with_reason():
    model = Embedder(sync=True).cuda().eval()
    with torch.no_grad():
        compiled = torch.compile(model, backend="infinifuse")
        for _ in range(3):
            ids = _ids(2, 5)
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-2, atol=1e-2)
    stats = fusebackend.stats()
    assert stats["capture_failures"] >= 1, stats
    assert set(stats["fusion_modes"].values()) == {"eager"}, stats
    (reason,) = stats["fallback_reasons"].values()
    assert "capture failed" in reason, reason


def test_weight_swap_rerecords_and_follows_new_weight():
    model = Embedder().cuda().eval()
    with torch.no_grad():
        compiled = torch.compile(model, backend="infinifuse")
        ids = _ids(2, 7)
        compiled(ids)
        compiled(ids)
        model.tok.weight.data = torch.randn_like(model.tok.weight)
        out = compiled(ids)
        torch.testing.assert_close(out, model(ids), rtol=1e-2, atol=1e-2)
    assert fusebackend.stats()["rerecords"] >= 1


def test_set_fusion_enabled_switches_without_recompile():
    model = Embedder().cuda().eval()
    with torch.no_grad():
        compiled = torch.compile(model, backend="infinifuse")
        ids = _ids(2, 7)
        compiled(ids)
        graphs_before = len(fusebackend.report._REPORTS)
        fusebackend.set_fusion_enabled(False)
        out = compiled(ids)
        torch.testing.assert_close(out, model(ids), rtol=1e-2, atol=1e-2)
        assert "graph_replay" in fusebackend.stats()["fusion_modes"].values()
        fusebackend.set_fusion_enabled(True)
        compiled(ids)
        assert len(fusebackend.report._REPORTS) == graphs_before  # no Dynamo recompile


def test_clear_cache_returns_memory_to_baseline():
    model = Embedder().cuda().eval()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    with torch.no_grad():
        compiled = torch.compile(model, backend="infinifuse")
        for batch in (1, 2, 4):
            compiled(_ids(batch, 33))
    assert fusebackend.stats()["cache_size"] >= 3
    del compiled
    torch._dynamo.reset()
    fusebackend.clear_cache()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline
    assert fusebackend.stats()["cache_size"] == 0
