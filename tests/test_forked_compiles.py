"""The precompile's compile processes (kernels/forked_compiles.py): forked children take the
compiles one at a time, each exactly once; a compile that raises or a child that dies or
hangs loses nothing (the parent compiles afterwards); and with Triton, a kernel compiled in
a child is a cache hit in the parent, which then has nothing left to compile."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

from fusebackend.kernels import forked_compiles, triton_api

pytestmark = pytest.mark.skipif(not forked_compiles.fork_available(), reason="needs fork")


def _marking(directory, index: int, seconds: float = 0.0):
    """A compile that leaves a file named by its index and the process that ran it."""

    def compile_fn():
        time.sleep(seconds)
        (directory / f"{index}.{os.getpid()}").touch()

    return compile_fn


def _ran(directory) -> dict[int, list[int]]:
    runs: dict[int, list[int]] = {}
    for path in directory.iterdir():
        index, pid = path.name.split(".")
        runs.setdefault(int(index), []).append(int(pid))
    return runs


def test_children_run_every_compile_once_between_them(tmp_path):
    # (0.25 s each: one child alone would need 2 s, far longer than the others take to start)
    compiles = [_marking(tmp_path, i, seconds=0.25) for i in range(8)]
    assert forked_compiles.compile_in_children(compiles, processes=4) == (8, 4)
    runs = _ran(tmp_path)
    assert sorted(runs) == list(range(8))
    assert all(len(pids) == 1 for pids in runs.values())  # each index taken once
    pids = {pid for (pid,) in runs.values()}
    assert os.getpid() not in pids and len(pids) > 1  # in children, several of them


def test_a_raising_compile_or_a_dying_child_leaves_the_rest_to_others(tmp_path):
    def raising():
        raise RuntimeError("a compile error")

    def dying():
        os._exit(7)

    compiles = [raising, dying, *(_marking(tmp_path, i, 0.05) for i in range(2, 8))]
    assert forked_compiles.compile_in_children(compiles, processes=3) == (8, 3)
    assert sorted(_ran(tmp_path)) == list(range(2, 8))


def test_a_child_past_the_deadline_is_killed_and_the_call_returns(tmp_path, caplog):
    compiles = [lambda: time.sleep(60), _marking(tmp_path, 1)]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fusebackend.kernels.forked_compiles"):
        forked_compiles.compile_in_children(compiles, processes=2, deadline_s=1.0)
    assert time.monotonic() - start < 30
    assert "killed" in caplog.text
    assert sorted(_ran(tmp_path)) == [1]


def test_a_full_queue_hands_the_children_what_fits(tmp_path, monkeypatch):
    real_write = os.write
    written = []

    def full_after_three(fd, data):
        if len(written) == 3:
            raise BlockingIOError
        written.append(data)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_after_three)
    compiles = [_marking(tmp_path, i) for i in range(6)]
    assert forked_compiles.compile_in_children(compiles, processes=2) == (3, 2)
    assert sorted(_ran(tmp_path)) == [0, 1, 2]


# --- with Triton: compiles for a CUDA target (no GPU needed: LLVM and ptxas only) --------
# In a process of its own without TRITON_INTERPRET: once Triton's interpreter has run a kernel
# in a process it has patched triton.language for itself, and compiles for a GPU there fail.

_KERNEL_SOURCE = """
import triton.language as tl


def scaled_copy(x, out, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    v = tl.load(x + i, mask=i < n, other=0.0).to(tl.float32)
    tl.store(out + i, v * SCALE, mask=i < n)
"""

_CACHE_HITS_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import _async_compile
from triton.runtime.jit import JITFunction
from fusebackend.kernels import triton_api

fn = JITFunction(triton_api.import_source("forked_compiles_test", sys.argv[2]).scaled_copy)
signature = {"x": "*fp16", "out": "*fp32", "n": "i32", "SCALE": "constexpr",
             "BLOCK": "constexpr"}
hits, kernels = [], []
triton.knobs.compilation.listener = lambda cache_hit, **_: hits.append(cache_hit)


def job(k):
    source = ASTSource(fn, signature, {"SCALE": 1.0 + k, "BLOCK": 32})
    compile_fn = lambda: triton.compile(source, target=GPUTarget("cuda", 90, 32))
    return lambda: _async_compile.active_mode.get().submit(("t", k), compile_fn, kernels.append)


failed = triton_api.precompile_all([job(k) for k in range(3)], 2, int(sys.argv[1]))
print(json.dumps({"failed": failed, "names": sorted(k.name for k in kernels),
                  "hashes": len({k.hash for k in kernels}), "hits": hits}))
"""


@pytest.mark.parametrize("processes", [0, 3])
def test_a_kernel_compiled_in_a_child_is_a_cache_hit_here(tmp_path, processes):
    pytest.importorskip("triton")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(root))
    command = [sys.executable, "-c", _CACHE_HITS_SCRIPT, str(processes), _KERNEL_SOURCE]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] == 0 and result["names"] == ["scaled_copy"] * 3, result
    assert result["hashes"] == 3
    # Here, in the parent: cache hits exactly when children compiled first.
    assert result["hits"] == [processes > 0] * 3, result


def test_a_fork_that_fails_leaves_fewer_children_and_no_error(tmp_path, monkeypatch):
    real_fork, forks = os.fork, []

    def fork_once():
        if forks:
            raise OSError(12, "Cannot allocate memory")
        forks.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", fork_once)
    compiles = [_marking(tmp_path, i) for i in range(5)]
    assert forked_compiles.compile_in_children(compiles, processes=4) == (5, 1)
    runs = _ran(tmp_path)
    assert sorted(runs) == list(range(5)) and len({pid for (pid,) in runs.values()}) == 1


def test_when_no_child_starts_nothing_is_compiled_and_nothing_raises(tmp_path, monkeypatch):
    def no_fork():
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    assert forked_compiles.compile_in_children([_marking(tmp_path, 0)], processes=2) == (0, 0)
    assert _ran(tmp_path) == {}  # the caller compiles it all itself


def test_no_child_is_forked_where_sigchld_is_ignored(tmp_path, monkeypatch):
    # The system would reap such children itself, and their pids could be reused by the
    # time they were killed at the deadline.
    import signal

    monkeypatch.setattr(signal, "getsignal", lambda number: signal.SIG_IGN)
    assert forked_compiles.compile_in_children([_marking(tmp_path, 0)], processes=2) == (0, 0)
    assert _ran(tmp_path) == {}


def test_children_reaped_elsewhere_end_the_wait(tmp_path, monkeypatch):
    # Another thread's os.wait() may reap them first: waitpid raises ChildProcessError.
    def reaped_elsewhere(pid, options):
        raise ChildProcessError(10, "No child processes")

    real_waitpid = os.waitpid
    monkeypatch.setattr(os, "waitpid", reaped_elsewhere)
    start = time.monotonic()
    done = forked_compiles.compile_in_children([_marking(tmp_path, 0, 0.2)], processes=1)
    assert done == (1, 1) and time.monotonic() - start < 30
    monkeypatch.setattr(os, "waitpid", real_waitpid)
    os.wait()  # (this test's own child, not left a zombie)


class _Kernel:
    """Stands in for a compiled kernel: what ``triton_api._compile_for_the_cache`` reads."""

    src, metadata = "a source", "its metadata"


def test_a_child_builds_the_compiled_kernels_launcher_too_unoptimised(monkeypatch):
    from triton import knobs
    from triton.runtime.driver import driver

    built = []

    def launcher_cls(self, *args):
        built.append((args, knobs.build.impl))

    monkeypatch.setattr(driver, "_active", type("Driver", (), {"launcher_cls": launcher_cls})())
    triton_api._compile_for_the_cache(_Kernel)
    assert built == [(("a source", "its metadata"), triton_api._unoptimised_build)]
    assert knobs.build.impl is None  # put back: only the child's launcher builds change

    def users_build(*args):
        raise AssertionError("not called by the fake driver")

    monkeypatch.setattr(knobs.build, "impl", users_build)
    triton_api._compile_for_the_cache(_Kernel)
    assert built[-1][1] is users_build  # a build the user set is kept


_EXTENSION_SOURCE = """
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "%s", NULL, -1, methods};
PyMODINIT_FUNC PyInit_%s(void) { return PyModule_Create(&module); }
"""


def test_the_unoptimised_launcher_build_makes_a_loadable_module_at_O0(tmp_path, monkeypatch):
    import importlib.util
    import shutil
    import sysconfig

    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no Python headers")
    name = "fusebackend_launcher_test"
    source = tmp_path / f"{name}.c"
    source.write_text(_EXTENSION_SOURCE % (name, name))
    commands = []
    real_check_call = subprocess.check_call

    def recording(command, **kwargs):
        commands.append(command)
        return real_check_call(command, **kwargs)

    monkeypatch.setattr(subprocess, "check_call", recording)
    library = triton_api._unoptimised_build(name, str(source), str(tmp_path), [], [], ["m"])
    (command,) = commands
    assert "-O0" in command and "-O3" not in command
    assert "-lm" in command  # (a bare name; a file name would be linked as -l:libm.so.6)
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.answer() == 42


def _submitting(compile_fn, then=None):
    """A precompile job that submits ``compile_fn`` as Triton's warm-up would, then calls
    ``then`` (which may raise)."""
    from triton.runtime import _async_compile

    def job():
        _async_compile.active_mode.get().submit(id(compile_fn), compile_fn, lambda k: None)
        if then is not None:
            then()

    return job


def test_an_interrupted_job_raises_at_once_and_leaves_no_mode_behind():
    from triton.runtime import _async_compile

    def interrupt():
        raise KeyboardInterrupt

    outcome = []

    def precompile():
        try:
            triton_api.precompile_all([_submitting(_Kernel), _submitting(_Kernel, interrupt)], 2, 2)
        except KeyboardInterrupt:
            outcome.append("interrupted")
        outcome.append(_async_compile.active_mode.get())

    worker = threading.Thread(target=precompile, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the precompile waited forever on compiles never run"
    assert outcome == ["interrupted", None]


def test_compile_processes_that_fail_leave_the_compiles_to_the_threads(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(triton_api, "compile_in_children", broken)
    compiled = []

    def compile_fn(name):
        return lambda: compiled.append(name) or _Kernel

    jobs = [_submitting(compile_fn("a")), _submitting(compile_fn("b"))]
    with caplog.at_level(logging.WARNING, logger="fusebackend.kernels.triton_api"):
        assert triton_api.precompile_all(jobs, 2, 4) == 0
    assert sorted(compiled) == ["a", "b"] and "Too many open files" in caplog.text
