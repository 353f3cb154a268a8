"""Everything that touches Triton's API, in one module: whether Triton imports and can run
here (the probe), importing generated kernel source, and compiling kernels ahead of their
launches (``JITFunction.warmup`` under Triton's private ``AsyncCompileMode``).

Triton is imported inside the functions, never at module level: importing ``kernels``
must not import Triton (a machine without it still compiles graphs, unfused).
``runtime/stats.py`` has its own copy of the import probe (``_triton_importable``): the
runtime imports nothing from ``kernels``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusebackend.kernels.forked_compiles import compile_in_children

__all__ = [
    "import_source",
    "interpreter_enabled",
    "precompile_all",
    "start_cache_key",
    "triton_importable",
    "triton_usable",
    "warmup",
    "warmup_pointer",
    "warmup_pointer_of",
]

log = logging.getLogger(__name__)


@functools.cache
def triton_importable() -> bool:
    """Does Triton import? (Asked once; a failure is logged and remembered.)"""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install must not break the unfused path
        log.info("Triton is not importable (%s); fused groups use the torch reference", exc)
        return False
    return True


def interpreter_enabled() -> bool:
    """Is Triton's interpreter on (``TRITON_INTERPRET=1``: kernels run on the CPU)?"""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable(device: torch.device) -> bool:
    """Can generated kernels run for tensors on ``device``?"""
    if not triton_importable():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and not interpreter_enabled()
    return device.type == "cpu" and interpreter_enabled()


def import_source(name: str, source: str) -> Any:
    """Import generated kernel source as a module. Triton's JIT reads a kernel's source from
    its file, so the module is written to a per-user cache directory (named by a hash of
    its source) and imported from there."""
    directory = os.path.join(tempfile.gettempdir(), f"fusebackend-{os.getuid()}")
    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    path = os.path.join(directory, f"{name}_{digest}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as handle:
            handle.write(source)
        os.replace(tmp, path)  # atomic: concurrent processes never see half a file
    module_spec = importlib.util.spec_from_file_location(f"fusebackend_generated.{name}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def warmup(kernel: Any, grid: tuple[int, int], args: list[Any], meta: dict[str, Any]) -> None:
    """Compile ``kernel`` for these arguments without launching it (``JITFunction.warmup``)."""
    kernel.warmup(*args, grid=grid, **meta)


def warmup_launch(
    kernel: Any, grid: tuple[int, ...], args: Sequence[Any], meta: dict[str, Any], device: Any
) -> None:
    """Compile a hand-written ``kernel`` for a launch on ``args`` (tensors may be fake: each
    is shown to Triton as its dtype and alignment) on ``device``, without launching it."""
    args = [warmup_pointer_of(x) if isinstance(x, torch.Tensor) else x for x in args]
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        warmup(kernel, grid, args, meta)


_cache_key_thread: threading.Thread | None = None


def start_cache_key() -> None:
    """Start computing Triton's own cache key, once per process, on a background thread.

    Triton's first compile in a process hashes its compiler's files and its ~0.5 GB library
    (``triton_key``): 0.33 s of EfficientNet-B0's first call on the H200 machine
    (2026-11-30). Started when a graph for the GPU arrives, it overlaps the passes (file
    reads and hashing release the GIL); ``precompile_all`` waits for it before compiling.
    """
    global _cache_key_thread
    if _cache_key_thread is not None or not triton_importable():
        return

    def compute() -> None:
        try:
            from triton.runtime.cache import triton_key

            triton_key()
        except Exception as exc:  # noqa: BLE001  (the first compile computes it, and raises)
            log.info("Triton's cache key failed in the background (%s)", exc)

    thread = threading.Thread(target=compute, name="fusebackend-triton-key", daemon=True)
    thread.start()  # (kept only once started: precompile_all joins it)
    _cache_key_thread = thread


def precompile_all(
    jobs: Sequence[Callable[[], None]], threads: int | None = None, processes: int | None = None
) -> int:
    """Run every job (``functools.partial(launch.precompile, ...)`` or another kernel's warm-up),
    compiling the distinct kernels they ask for (Triton's ``AsyncCompileMode``) ahead of their
    launches: first in ``processes`` forked processes, which fill Triton's cache
    (``forked_compiles``: a compile holds the GIL for much of its work), then each once more
    on a pool of ``threads``, now a cache hit, which also loads the kernel (``_CompileQueue``).
    Returns the number of jobs that failed to warm up or to compile; their kernels compile
    at their first launch, where an error is raised and handled as before.

    ``threads`` and ``processes``: by default one per CPU core, up to 32; ``processes`` below
    2 compiles on the threads alone (as does a single compile). On the threads alone (8 of
    the H100 machine's 16 cores), generate()'s 113 launches of a 22-layer Llama took
    2.0-2.1 s (2026-11-23); a TinyLlama decode step's 9 compiles took 2.57 s on threads and
    2.32 s with the processes (H200, 2026-11-30).
    """
    cores = max(1, min(32, os.cpu_count() or 8))
    threads = cores if threads is None else threads
    processes = cores if processes is None else processes
    try:
        from triton.runtime import _async_compile
    except ImportError:  # an older Triton: compile at first launch, one by one
        return 0
    if _async_compile.active_mode.get() is not None:
        log.info("another AsyncCompileMode is active; kernels compile at their launches")
        return len(jobs)
    if _cache_key_thread is not None:
        _cache_key_thread.join()  # computed twice otherwise: the first compile needs it
    failed, mode, queue = 0, None, _CompileQueue()
    try:
        mode = _async_compile.AsyncCompileMode(queue, ignore_errors=True)
        with mode:
            try:
                for job in jobs:
                    try:
                        job()
                    except Exception as exc:  # the launch compiles it and raises there
                        failed += 1
                        log.info("precompile failed (%s); it compiles at its launch", exc)
                queue.run(threads, processes)
            finally:
                queue.cancel_pending()
    finally:
        # The mode switches itself off only after waiting on every compile: an interrupt
        # during that wait would leave it on for this thread, and every later Triton
        # compile here (anyone's) would go to a pool that is gone.
        if mode is not None and _async_compile.active_mode.get() is mode:
            _async_compile.active_mode.set(None)
    return failed + sum(1 for f in mode.raw_futures if f.exception() is not None)


class _CompileQueue(concurrent.futures.Executor):
    """The executor Triton's ``AsyncCompileMode`` submits the precompile's compiles to. It
    holds them until ``run``, which compiles them all in forked processes first (to fill
    Triton's cache), then each again on a thread pool, where it is a cache hit, and loads
    the compiled kernel there (``_compile_and_load``).

    A warm-up (``JITFunction.warmup``) compiles a kernel but leaves its loading to the first
    launch: building its C launcher (with gcc where Triton's cache lacks it, ~0.3 s each)
    and loading the binary onto the device, one kernel after another on the caller's
    thread. Done on the pool, they run concurrently: on an H100 with an empty Triton cache,
    the first runs of a TinyLlama decode step's first call took 0.29-0.42 s against
    3.05-3.52 s with the loads at the launches (2026-11-25,
    ``benchmarks/results/first_call_ab_h100.txt``).
    """

    def __init__(self) -> None:
        self.pending: list[tuple[Callable[[], Any], int | None, concurrent.futures.Future]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        # Triton loads a kernel onto the current device: the one the warm-up runs under.
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.pending.append((functools.partial(fn, *args, **kwargs), device, future))
        return future

    def run(self, threads: int, processes: int) -> None:
        """Compile and load everything submitted; each future gets its kernel or error."""
        compiles = [compile_fn for compile_fn, _, _ in self.pending]
        if processes > 1 and len(compiles) > 1:
            start = time.perf_counter()
            in_children = [functools.partial(_compile_for_the_cache, c) for c in compiles]
            try:
                queued, children = compile_in_children(in_children, processes)
            except Exception as exc:  # noqa: BLE001  (they only warm the cache: compiled below)
                log.warning("the compile processes failed (%s); compiling on threads", exc)
            else:
                log.info("%d of %d compile(s) ran in %d process(es) in %.2f s", queued,
                         len(compiles), children, time.perf_counter() - start)  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(max(1, threads), "fusebackend-load") as pool:
            for compile_fn, device, future in self.pending:
                pool.submit(_settle, future, compile_fn, device)
        self.pending.clear()

    def cancel_pending(self) -> None:
        """Cancel what ``run`` did not settle (a job or the processes raised first), telling
        the futures' waiters: ``as_completed``, in the mode's exit, sees a cancelled future
        only once notified, and would wait forever."""
        for _, _, future in self.pending:
            if future.cancel():  # (False: settled or being settled on the pool)
                with contextlib.suppress(RuntimeError):  # (notified already)
                    future.set_running_or_notify_cancel()
        self.pending.clear()


def _compile_for_the_cache(compile_fn: Callable[[], Any]) -> None:
    """A compile process's job: the kernel into Triton's cache, and its C launcher too
    (built with the C compiler where the cache lacks it, as loading would do here, but
    unoptimised: ``_unoptimised_build``). The binary's loading onto the device, a CUDA call,
    is left to this process."""
    kernel = compile_fn()
    source, metadata = getattr(kernel, "src", None), getattr(kernel, "metadata", None)
    if source is not None and metadata is not None:
        from triton import knobs
        from triton.runtime.driver import driver

        before = knobs.build.impl  # (one the user set is kept)
        knobs.build.impl = before or _unoptimised_build
        try:
            driver.active.launcher_cls(source, metadata)
        finally:
            knobs.build.impl = before


def _unoptimised_build(name: str, source: str, folder: str, library_dirs: list[str],
                       include_dirs: list[str], libraries: list[str]) -> str:  # fmt: skip
    """A kernel's C launcher built as Triton builds it (``triton.runtime.build``: the same
    compiler, libraries and headers) but at ``-O0`` instead of ``-O3``. The launcher only
    unpacks a launch's arguments for the driver; at ``-O0`` its build took 0.082 s against
    0.145 s (gcc, this repository's CPU machine, 2026-11-30), and each compile process builds
    one per kernel. It is cached by its source, like Triton's own."""
    from triton import knobs

    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler found for a Triton launcher: set CC")
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme  # (Debian's Python)
    python_include = sysconfig.get_paths(scheme=scheme)["include"]
    library = os.path.join(folder, name + sysconfig.get_config_var("EXT_SUFFIX"))
    command = [compiler, source, "-O0", "-shared", "-fPIC", "-Wno-psabi", "-o", library]
    # (a file name, libcuda.so.1, is linked by name; a bare name, cuda, as -lcuda)
    command += [f"-l:{lib}" if re.search(r"\.so(\.\d+)*$", lib) or lib.endswith(".a")
                else f"-l{lib}" for lib in libraries]  # fmt: skip
    command += [f"-L{d}" for d in library_dirs]
    headers = (*include_dirs, folder, python_include, *knobs.build.backend_dirs)
    command += [f"-I{d}" for d in headers if d]
    subprocess.check_call(command, stdout=subprocess.DEVNULL)
    return library


def _settle(future: concurrent.futures.Future, compile_fn: Callable[[], Any],
            device: int | None) -> None:  # fmt: skip
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(_compile_and_load(compile_fn, device))
    except BaseException as exc:  # noqa: BLE001  (handed to the future, raised where read)
        future.set_exception(exc)


def _compile_and_load(compile_fn: Callable[[], Any], device: int | None) -> Any:
    kernel = compile_fn()
    load = getattr(kernel, "_init_handles", None)  # Triton's CompiledKernel (3.6, 3.7)
    if load is not None and device is not None:
        try:
            with torch.cuda.device(device):
                load()
        except Exception as exc:  # noqa: BLE001  (its first launch raises the error)
            log.info("loading a precompiled kernel failed (%s); its launch raises", exc)
            if getattr(kernel, "module", None) is None and hasattr(kernel, "_run"):
                # Triton sets the launcher before it loads the binary: a load that failed
                # would leave a launcher with no function, and the launch would fail with
                # a TypeError instead of the load's error. Unset, the launch loads again.
                kernel._run = None
    return kernel


def warmup_pointer(dtype: torch.dtype, address: int) -> Any:
    """A tensor as ``JITFunction.warmup`` sees it: a dtype and an address. Triton
    specialises pointers on 16-byte alignment, so a view at a byte offset is given that
    offset as its address (bases count as aligned: fresh allocations are)."""
    return _pointer_class()(dtype, address)


def warmup_pointer_of(tensor: torch.Tensor) -> Any:
    """``tensor`` as its launch will show it to Triton: its dtype at its view's byte offset
    (fake tensors suffice)."""
    return warmup_pointer(tensor.dtype, tensor.storage_offset() * tensor.element_size())


@functools.cache
def _pointer_class() -> type:
    from triton.runtime.jit import MockTensor

    class Pointer(MockTensor):
        def __init__(self, dtype: torch.dtype, address: int) -> None:
            super().__init__(dtype)
            self.address = address

        def data_ptr(self) -> int:  # type: ignore[override]
            return self.address

    return Pointer
