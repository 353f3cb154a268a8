"""``python -m fusebackend doctor``: a checklist of what this machine can do.

Mirrors the graph-recording guide it replaces: each line is a check that passes or fails
with the reason; the command exits non-zero when any check fails.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable

__all__ = ["run_doctor"]


def _model(device: str, move_ids: bool):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Embedder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(1000, 128)
            self.pos = nn.Embedding(64, 128)

        def forward(self, ids):
            if move_ids:  # the usual fix for CPU token ids: the weight's device decides
                ids = ids.to(self.tok.weight.device)
            pos = torch.arange(ids.shape[1], device=ids.device)[None]
            return F.gelu(self.tok(ids) * math.sqrt(128) + self.pos(pos))

    return Embedder().to(device).eval()


def run_doctor(print_fn: Callable[[str], None] = print) -> int:
    """Run the checks, print one line each; return the number of failures."""
    failures = 0

    def check(name: str, fn: Callable[[], str | None]) -> bool:
        nonlocal failures
        try:
            detail = fn()
        except Exception as exc:  # a check's failure is its result, not a crash
            failures += 1
            print_fn(f"[FAIL] {name}: {type(exc).__name__}: {exc}")
            if not isinstance(exc, (AssertionError, RuntimeError)):
                print_fn(traceback.format_exc(limit=3))
            return False
        print_fn(f"[ ok ] {name}" + (f": {detail}" if detail else ""))
        return True

    import torch

    import fusebackend

    cuda = check("CUDA visible", lambda: _cuda())
    check("Triton usable", _triton)
    if not cuda:
        print_fn("[skip] GPU checks (no CUDA device)")
        return failures

    state: dict = {}

    def fused_capture() -> str:
        fusebackend.clear_cache()
        fusebackend.reset_stats()
        torch._dynamo.reset()
        model = _model("cuda", move_ids=False)
        ids = torch.randint(0, 1000, (2, 17), device="cuda")  # indices already on the device
        with torch.no_grad():
            compiled = torch.compile(model, backend="infinifuse")
            for _ in range(3):
                compiled(ids)
        stats = fusebackend.stats()
        modes = set(stats["fusion_modes"].values())
        assert stats["recordings"] >= 1, f"nothing was captured: {stats}"
        assert modes == {"fusion"}, f"modes {modes}, reasons {stats['fallback_reasons']}"
        state.update(model=model, compiled=compiled)
        return f"{stats['recordings']} capture(s), mode fusion"

    captured = check("fused embedding captured in a CUDA graph", fused_capture)
    check("device-side input accepted (indices on the GPU)",
          lambda: None if captured else _raise("needs the capture above"))  # fmt: skip

    def no_sync() -> str:
        ids = torch.randint(0, 1000, (2, 17), device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.no_grad():
                for _ in range(5):
                    state["compiled"](ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return "5 replays under torch.cuda.set_sync_debug_mode('error')"

    if captured:
        check("no host sync (sync debug mode 'error')", no_sync)

        def replay_equals_eager() -> str:
            ids = torch.randint(0, 1000, (2, 17), device="cuda")
            with torch.no_grad():
                out, ref = state["compiled"](ids), state["model"](ids)
            torch.testing.assert_close(out, ref)
            return f"max abs diff {(out - ref).abs().max().item():.2e}"

        check("replay equals eager", replay_equals_eager)

    def cpu_ids() -> str:
        fusebackend.reset_stats()
        torch._dynamo.reset()
        model = _model("cuda", move_ids=True)
        with torch.no_grad():
            compiled = torch.compile(model, backend="infinifuse")
            for _ in range(3):
                ids = torch.randint(0, 1000, (2, 17))  # token ids from the CPU
                out = compiled(ids)
            torch.testing.assert_close(out, model(ids))
        modes = set(fusebackend.stats()["fusion_modes"].values())
        assert "eager" not in modes, f"fell back to eager: {fusebackend.stats()}"
        return f"modes {sorted(modes)}"

    check("CPU token ids moved inside forward still captured", cpu_ids)
    return failures


def _raise(message: str) -> None:
    raise RuntimeError(message)


def _cuda() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"


def _triton() -> str:
    import torch
    import triton

    from fusebackend.kernels import triton_usable

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not triton_usable(device):
        raise RuntimeError(
            f"triton {triton.__version__} imports but cannot run on {device} "
            "(without CUDA, set TRITON_INTERPRET=1 to use its interpreter)"
        )
    return f"triton {triton.__version__} on {device}"
