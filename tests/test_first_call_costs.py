"""A first compiled call's costs: precompiled kernels are loaded in the compile workers
(triton_api._LoadingExecutor) instead of one by one at their first launches, and the backend's
passes run with Python's garbage collector paused (pipeline.collector_paused)."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

from fusebackend.kernels import launch, triton_api


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: records where it was loaded. Like Triton's,
    it sets its launcher (``_run``) before it loads the binary (``module``)."""

    def __init__(self, fail: bool = False):
        self.loaded_on: list[tuple[str, int | None]] = []
        self.fail = fail
        self.module = None
        self._run = None

    def _init_handles(self):
        self.loaded_on.append((threading.current_thread().name, torch.cuda.current_device()))
        self._run = "a launcher"
        if self.fail:
            raise RuntimeError("the binary does not load")
        self.module = "a module"


# The current device is per thread, as CUDA's is: a worker thread starts on device 0.
_CURRENT = threading.local()


@contextlib.contextmanager
def _device(index):
    before = getattr(_CURRENT, "index", 0)
    _CURRENT.index = index
    try:
        yield
    finally:
        _CURRENT.index = before


def _pretend_cuda(monkeypatch, current: int):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(_CURRENT, "index", 0))
    monkeypatch.setattr(torch.cuda, "device", _device)
    monkeypatch.setattr(_CURRENT, "index", current, raising=False)


def _queued(compile_fn, device: int):
    """``compile_fn`` submitted under ``device``, then run on the queue's threads alone."""
    queue = triton_api._CompileQueue()
    with _device(device):
        future = queue.submit(compile_fn)
    queue.run(threads=2, processes=0)
    return future


def test_a_compiled_kernel_is_loaded_in_the_worker_on_the_compiling_device(monkeypatch):
    _pretend_cuda(monkeypatch, current=0)
    kernel = _FakeCompiled()
    assert _queued(lambda: kernel, device=3).result() is kernel
    ((thread, device),) = kernel.loaded_on
    assert thread.startswith("fusebackend-load") and device == 3


def test_a_kernel_that_fails_to_load_is_returned_for_its_launch_to_raise(monkeypatch, caplog):
    _pretend_cuda(monkeypatch, current=0)
    kernel = _FakeCompiled(fail=True)
    with caplog.at_level("INFO", logger="fusebackend.kernels.triton_api"):
        assert _queued(lambda: kernel, device=0).result() is kernel
    assert len(kernel.loaded_on) == 1
    assert "the binary does not load" in caplog.text
    # Its launcher is unset, so that the launch loads again and raises the load's error
    # (left set, Triton would launch a missing function).
    assert kernel._run is None and kernel.module is None


def test_nothing_is_loaded_before_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    kernel = _FakeCompiled()
    assert _queued(lambda: kernel, device=0).result() is kernel
    assert kernel.loaded_on == []


def test_precompile_all_uses_the_loading_pool(monkeypatch):
    # The jobs' compiles go through AsyncCompileMode's executor: it must be the loading one.
    from triton.runtime import _async_compile

    _pretend_cuda(monkeypatch, current=1)
    kernel = _FakeCompiled()

    def job():
        _async_compile.active_mode.get().submit("key", lambda: kernel, lambda k: None)

    assert launch.precompile_all([job]) == 0
    assert [device for _, device in kernel.loaded_on] == [1]


def _compile_recording_the_collector(monkeypatch, fail: bool = False) -> list[bool]:
    from fusebackend import prepare  # the preparation passes (prepare.PREPARE)

    seen: list[bool] = []
    real = prepare.fold_constants

    def recording(gm):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("a pass failed")
        return real(gm)

    monkeypatch.setattr(prepare, "fold_constants", recording)
    with torch.no_grad():
        torch.compile(lambda x: torch.relu(x * 2), backend="infinifuse")(torch.randn(3, 5))
    return seen


def test_the_passes_run_with_the_collector_paused_and_it_is_back_after(monkeypatch):
    assert gc.isenabled()
    assert _compile_recording_the_collector(monkeypatch) == [False]
    assert gc.isenabled()


def test_a_collector_the_user_paused_stays_paused(monkeypatch):
    gc.disable()
    try:
        assert _compile_recording_the_collector(monkeypatch) == [False]
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_is_back_after_a_backend_error():
    with pytest.raises(Exception, match="unknown infinifuse option"), torch.no_grad():
        torch.compile(lambda x: x * 2, backend="infinifuse", options={"not_an_option": 1})(
            torch.randn(3)
        )
    assert gc.isenabled()


@pytest.mark.fusion_failure_expected
def test_the_collector_is_back_after_a_pass_that_raised(monkeypatch):
    # (a pass's error leaves the graph to run as traced: backend.infinifuse)
    assert _compile_recording_the_collector(monkeypatch, fail=True) == [False]
    assert gc.isenabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_precompiled_kernels_are_loaded_before_the_first_launch():
    # A fresh kernel (its constant is new to this process): its load must happen in the
    # precompile's workers, not on the calling thread at its first launch.
    import triton

    scale = 1.0 + torch.rand(()).item()
    loads: list[str] = []
    triton.knobs.runtime.kernel_load_start_hook = lambda *a, **k: loads.append(
        threading.current_thread().name
    )
    try:
        table = torch.randn(50, 40, device="cuda")
        ids = torch.randint(0, 50, (3, 7), device="cuda")

        def fn(ids, table):
            return torch.relu(torch.nn.functional.embedding(ids, table) * scale) + 1.0

        with torch.no_grad():
            out = torch.compile(fn, backend="infinifuse")(ids, table)
        torch.testing.assert_close(out, fn(ids, table))
    finally:
        triton.knobs.runtime.kernel_load_start_hook = None
    assert loads, "the fused kernel was not compiled in this test"
    assert threading.main_thread().name not in loads, loads


def test_a_new_kernel_family_is_precompiled_with_no_change_to_the_backend(monkeypatch):
    # fusion.precompile asks each node's target for its job (kernels/family.py): a launcher
    # carrying the protocol is warmed up once per key, counted by its describe().
    from fusebackend import fusion
    from fusebackend.kernels.family import family, launch_key

    built = []

    def job_for(args):
        (x,) = args
        return ("mine", launch_key(x)), lambda: built.append(tuple(x.shape))

    @family("my_kernel", job_for)
    def my_kernel(x):
        return x

    jobs = []
    monkeypatch.setattr(fusion, "precompile_all", lambda js: jobs.extend(js) or 0)
    graph = torch.fx.Graph()
    for shape in [(2, 3), (2, 3), (4, 3)]:
        node = graph.placeholder(f"x{len(graph.nodes)}")
        node.meta["example_value"] = torch.empty(shape)
        graph.call_function(my_kernel, (node,))
    # its launches counted; no launch paths: the family has no launch_path
    assert fusion.precompile(graph) == ({"my_kernel": 3}, {})
    for job in jobs:
        job()
    assert built == [(2, 3), (4, 3)]


def test_the_heaviest_compiles_are_handed_out_first(monkeypatch):
    # The compile processes take the jobs' compiles in line: a family's compile_weight puts
    # its jobs ahead of lighter ones, equal weights keep the graph's order.
    from fusebackend import fusion
    from fusebackend.kernels.family import family, launch_key

    def job_for(name):
        def job(args):
            (x,) = args
            return (name, launch_key(x)), lambda: order.append((name, x.shape[0]))

        return job

    @family("light", job_for("light"))
    def light(x):
        return x

    @family("heavy", job_for("heavy"), lambda args: 2.0 + args[0].shape[0])
    def heavy(x):
        return x

    order, jobs = [], []
    monkeypatch.setattr(fusion, "precompile_all", lambda js: jobs.extend(js) or 0)
    graph = torch.fx.Graph()
    for kernel, rows in [(light, 1), (heavy, 1), (light, 2), (heavy, 3), (light, 3)]:
        node = graph.placeholder(f"x{len(graph.nodes)}")
        node.meta["example_value"] = torch.empty(rows, 4)
        graph.call_function(kernel, (node,))
    fusion.precompile(graph)
    for job in jobs:
        job()
    assert order == [("heavy", 3), ("heavy", 1), ("light", 1), ("light", 2), ("light", 3)]


def test_a_depthwise_compile_weighs_the_taps_it_unrolls():
    # a window over 3 x 3 unrolls one row of taps (its rows in a loop): it compiles faster
    # than a 3 x 3, whose nine taps are unrolled, and slower than a row kernel
    from fusebackend.kernels.depthwise_conv import depthwise_conv2d
    from fusebackend.kernels.family import compile_weight

    x = torch.empty(1, 8, 9, 9)
    weight = {k: compile_weight(depthwise_conv2d, (x, torch.empty(8, 1, k, k))) for k in (3, 5, 7)}
    assert weight[3] > weight[7] > weight[5] > 1.0


def test_a_compile_weight_that_raises_or_is_symbolic_counts_as_one(monkeypatch):
    # only an order rests on it: it must not fail a compile, nor add a guard on a size
    from fusebackend.kernels.family import compile_weight, family

    def raises(args):
        raise IndexError("no such argument")

    @family("raising", lambda args: None, raises)
    def raising(x):
        return x

    shape_env = torch.fx.experimental.symbolic_shapes.ShapeEnv()
    size = shape_env.create_unbacked_symint()

    @family("symbolic", lambda args: None, lambda args: size / 2)
    def symbolic(x):
        return x

    assert compile_weight(raising, ()) == 1.0
    assert compile_weight(symbolic, ()) == 1.0
    assert compile_weight(family("plain", lambda args: None)(lambda x: x), ()) == 1.0


def test_tritons_cache_key_is_computed_once_on_a_background_thread(monkeypatch):
    pytest.importorskip("triton")
    from triton.runtime import cache

    names: list[str] = []
    monkeypatch.setattr(cache, "triton_key", lambda: names.append(threading.current_thread().name))
    monkeypatch.setattr(triton_api, "_cache_key_thread", None)
    triton_api.start_cache_key()
    triton_api.start_cache_key()  # once per process
    triton_api._cache_key_thread.join()
    assert names == ["fusebackend-triton-key"]


def test_tritons_cache_key_starts_as_dynamo_starts_compiling_in_a_cuda_process(monkeypatch):
    """The key starts as a Dynamo compile starts, before its trace reaches the backend
    (whichever backend), where the process already uses CUDA; where it does not, nothing
    starts and no GPU is asked for (that would initialise CUDA before a fork)."""
    from fusebackend import backend, fusion

    events: list[str] = []
    monkeypatch.setattr(fusion, "start_cache_key", lambda: events.append("key"))
    monkeypatch.setattr(fusion, "triton_usable",
                        lambda device: events.append("asked") or device.type == "cuda")  # fmt: skip
    initialised = [False]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised[0])

    def spy(gm, example_inputs):
        events.append("graph")
        return gm.forward

    torch._dynamo.reset()  # (drops Dynamo's callbacks: a graph of infinifuse's registers again)
    torch.compile(lambda x: x * 2 + 1, backend="infinifuse")(torch.ones(3))
    events.clear()
    torch.compile(lambda x: x * 3 + 1, backend=spy)(torch.ones(3))
    assert events == ["graph"]
    initialised[0] = True
    torch.compile(lambda x: x * 4 + 1, backend=spy)(torch.ones(3))
    assert events == ["graph", "asked", "key", "graph"]
    backend.register_cache_key_start()  # registered once only
    events.clear()
    torch.compile(lambda x: x * 5 + 1, backend=spy)(torch.ones(3))
    assert events == ["asked", "key", "graph"]  # (start_cache_key acts on its first call only)

    def fail() -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(fusion, "warm_compiler_early", fail)  # never fails a user's compile
    assert torch.compile(lambda x: x * 6 + 1, backend=spy)(torch.ones(3)).tolist() == [7.0] * 3


def test_the_cache_key_start_is_registered_with_dynamo_at_import():
    """Dynamo imports the backend at ``torch.compile(backend="infinifuse")``: the callback is
    there before the first trace (a fresh process: this one reset Dynamo long ago)."""
    import subprocess
    import sys

    script = (
        "import torch._dynamo\n"
        "from torch._dynamo.callback import callback_handler\n"
        "torch._dynamo.lookup_backend('infinifuse')\n"
        "import fusebackend.backend as backend\n"
        "print(backend._start_cache_key_at_compile in callback_handler.start_callbacks)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"
