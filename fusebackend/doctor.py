"""``python -m fusebackend doctor``: a checklist of what this machine can do.

Each line is a check that passes (``[ ok ]``) or fails (``[FAIL]``) with its reason, or a
fact (``[info]``) or a skipped part (``[skip]``) with why. The command exits non-zero only
when a check fails, that is when something is broken:

- Without CUDA: the backend compiles a small embedding model on the CPU, finds its group and
  matches eager. That is what works there: the group is reported but the graph is not
  rewritten (the traced ops run as they are; Triton's interpreter runs the generated kernel
  only with ``TRITON_INTERPRET=1``) and nothing is captured in a CUDA graph. A CPU-only
  machine is not broken.
- With CUDA, the full GPU checklist: Triton usable on the device, the fused
  embedding captured in a CUDA graph, no host sync in replays, replay equals eager, CPU
  token ids moved inside ``forward`` still captured.
"""

from __future__ import annotations

import importlib.util
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

    print_fn(f"[info] torch {torch.__version__}, {_triton_version()}")
    if torch.cuda.is_available():
        _gpu_checklist(check)
        return failures
    print_fn(
        "[info] no CUDA device (torch.cuda.is_available() is False): the backend runs on "
        f"the CPU, {_cpu_group_runner()}, no CUDA graphs"
    )
    check("backend on the CPU: group found, equal to eager", _cpu_backend)
    print_fn(
        "[skip] GPU checks (Triton kernels, CUDA-graph capture, replay, host syncs): no CUDA device"
    )
    return failures


def _cpu_group_runner() -> str:
    from fusebackend.kernels import launch

    if launch.interpreter_enabled():
        return "fused groups run their Triton kernels in Triton's interpreter (slow)"
    return (
        "groups are found but not rewritten: the traced ops run as they are "
        "(TRITON_INTERPRET=1 would run the kernels in the interpreter)"
    )


# The Triton versions the test suite ran with (pyproject.toml's test extra: CI has 3.6.0,
# torch 2.13's CUDA build pins 3.7.1). Others may work; they are untested (a report saw
# 3.9's interpreter disagree with torch on fp32 -> bf16 rounding).
TESTED_TRITON = ((3, 6), (3, 7))


def _triton_version() -> str:
    try:
        import triton
    except ModuleNotFoundError:
        return "Triton not installed (groups are found and reported; no kernel runs)"
    except Exception as exc:  # a broken Triton leaves the backend's unfused/reference path
        return f"Triton not importable ({type(exc).__name__}: {exc})"
    return f"triton {triton.__version__} ({triton_tested(triton.__version__)})"


def triton_tested(version: str) -> str:
    """Whether ``version`` is one the tests ran with, in words."""
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = ()
    tested = " or ".join(f"{a}.{b}.x" for a, b in TESTED_TRITON)
    if major_minor in TESTED_TRITON:
        return f"tested: the suite runs with {tested}"
    return f'UNTESTED: the suite runs with {tested}; pip install -e ".[test]" installs one'


def _cpu_backend() -> str:
    """Compile the embedding model on the CPU; its one group fused, no capture, equal to eager."""
    import torch

    import fusebackend
    from fusebackend.kernels import launch

    fusebackend.clear_cache()
    fusebackend.reset_stats()
    torch._dynamo.reset()
    model = _model("cpu", move_ids=False)
    ids = torch.randint(0, 1000, (2, 17))
    with torch.no_grad():
        compiled = torch.compile(model, backend="infinifuse")
        for _ in range(2):
            out = compiled(ids)
        torch.testing.assert_close(out, model(ids))
    report = fusebackend.last_report()
    stats = fusebackend.stats()
    groups = report.groups
    assert len(groups) == 1, f"expected one fused group:\n{report}"
    modes = set(stats["fusion_modes"].values())
    # Without the interpreter the group is found but not rewritten: the traced graph runs.
    rewritten = not groups[0].backend.startswith("not rewritten")
    expected = {"fusion"} if rewritten else {"eager"}
    assert modes == expected, f"modes {modes}, reasons {stats['fallback_reasons']}"
    if launch.interpreter_enabled():
        if importlib.util.find_spec("numpy") is None:
            raise RuntimeError("TRITON_INTERPRET=1 is set but numpy, which it needs, is missing")
    where = groups[0].backend
    return f"group: {where}; {stats['recordings']} CUDA-graph captures"


def _gpu_checklist(check: Callable[[str, Callable[[], str | None]], bool]) -> None:
    """The CUDA machine's checks, each through ``check`` (which counts the failures)."""
    import torch

    import fusebackend

    check("CUDA visible", _cuda)
    check("Triton usable on the GPU", _triton)
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

    def replay_equals_eager() -> str:
        ids = torch.randint(0, 1000, (2, 17), device="cuda")
        with torch.no_grad():
            out, ref = state["compiled"](ids), state["model"](ids)
        torch.testing.assert_close(out, ref)
        return f"max abs diff {(out - ref).abs().max().item():.2e}"

    def needs_capture() -> None:
        raise RuntimeError("needs the capture above")

    # Without a capture these have nothing to replay: each fails, naming the cause.
    check("no host sync (sync debug mode 'error')", no_sync if captured else needs_capture)
    check("replay equals eager", replay_equals_eager if captured else needs_capture)

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


def _cuda() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"


def _triton() -> str:
    import torch
    import triton

    from fusebackend.kernels import launch, triton_usable

    device = torch.device("cuda")
    if not triton_usable(device):
        why = (
            "TRITON_INTERPRET=1 is set: unset it on a GPU machine"
            if launch.interpreter_enabled()
            else "see fusebackend.kernels.triton_usable"
        )
        raise RuntimeError(
            f"triton {triton.__version__} imports but cannot run on {device} ({why})"
        )
    return f"triton {triton.__version__} on {device}"
