"""Test set-up: run generated Triton kernels through the interpreter when there is no GPU.

TRITON_INTERPRET must be set before torch or triton is imported, hence at the top here.
"""

import os
import shutil


def _cuda_present() -> bool:
    # Decided without importing torch: torch must not be imported before the variable is set.
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")


if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def _list_interpreter_builtins_once() -> None:
    """Triton's interpreter patches ``triton.language``'s builtins at every kernel launch and
    again at every call of a ``@triton.jit`` helper, for every program of the grid, and each
    patch walks the modules with ``inspect.getmembers`` (about 1.4 ms a call). Here the
    builtins' names are listed once per module and looked up by name after that; the same
    members are patched the same way. One zoo Llama call under the interpreter: 0.58 of 2.6 s
    was that walk (cProfile, 2026-12-01, Triton 3.6.0). Where the interpreter's internals
    differ (another Triton), nothing is changed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or patch_attr is None or is_builtin is None:
        return
    names: dict[int, tuple[str, ...]] = {}

    def patch_builtin(pkg, builder, scope):
        # Listed at a kernel launch, before anything is patched: a helper's call (the only
        # call made while patched) comes after its kernel's launch has listed every module.
        listed = names.get(id(pkg))
        if listed is None:
            listed = tuple(name for name, member in inspect.getmembers(pkg) if is_builtin(member))
            names[id(pkg)] = listed
        for name in listed:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


if os.environ.get("TRITON_INTERPRET") == "1":
    _list_interpreter_builtins_once()


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_runtime(request):
    """Each test compiles from scratch (Dynamo's caches would hide recompiles) and starts
    with an empty runtime: no captured graphs, zeroed stats, fusion switched on.

    A pass that raises makes the graph run unfused (a user's model still runs), which
    would let a test that only compares outputs pass over the bug: every such graph fails
    the test unless it carries ``@pytest.mark.fusion_failure_expected``."""
    import fusebackend
    from fusebackend import report

    def reset_runtime():
        fusebackend.set_fusion_enabled(True)
        fusebackend.clear_cache()
        fusebackend.reset_stats()

    torch._dynamo.reset()
    reset_runtime()
    before = report._recorded
    yield
    failed = [g.path for g in report._reports_since(before)
              if "fusion failed" in g.path or "preparation failed" in g.path]  # fmt: skip
    if failed and request.node.get_closest_marker("fusion_failure_expected") is None:
        pytest.fail(f"a fusion pass raised: {failed[0]}")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # a test's queued replays finish before its graphs are freed
    reset_runtime()
    torch._dynamo.reset()


@pytest.fixture
def fused_graphs(monkeypatch):
    """The fused graphs (GraphModules; None where nothing fused) the backend builds while the
    test runs, in order."""
    from fusebackend import fusion

    made = []
    real = fusion.fuse

    def keep(*args, **kwargs):
        fused = real(*args, **kwargs)
        made.append(fused.graph)
        return fused

    monkeypatch.setattr(fusion, "fuse", keep)
    return made
