"""Triton's compiles run in forked child processes, to fill Triton's on-disk cache before
the precompile (``triton_api.precompile_all``) compiles each kernel again in this process,
where it is now a cache hit, and loads it.

Why processes: Triton's front end (a kernel's Python AST to its first IR) and much of its
pass pipeline hold the GIL, so compiles on threads wait on one another. On the H200
machine's 16 cores (2026-11-30, ``benchmarks/diag/diag_first_call_phases.py --timm
efficientnet_b0 --threads``), EfficientNet-B0's 37 compiles took 11.2 s one after another
and 3.3 s on 16 threads, where each compile ran 3.5x slower than alone.

Why fork: a compile is a closure over the graph's kernels (generated source imported from
files, Triton's JIT functions, a launch's specialisation), which fork hands to a child
without pickling, and a forked child starts in milliseconds where a spawned one imports
torch and Triton (seconds). A child runs nothing but compiles for a target given by hand:
no CUDA call, no torch op, its garbage collector off (a collection could run a finalizer of
the parent's objects), SIGINT and SIGTERM at their defaults (blocked around the fork, so
that neither reaches the caller's code in the child). It leaves with ``os._exit``, running
none of the parent's exit handlers. The children only warm the cache: what one fails to
compile, or what a child that died or passed the deadline left undone, the parent compiles
itself afterwards, and its errors are raised and reported there as without the children.
Where SIGCHLD is ignored (the system reaps children itself, and a pid to kill at the
deadline could be another process's by then), nothing is forked.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import struct
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = ["compile_in_children", "fork_available"]

log = logging.getLogger(__name__)

_RECORD = struct.Struct("=i")  # one compile's index: 4 bytes, below PIPE_BUF, so a write
# and a read of one record are atomic however many children share the pipe

# The children's deadline: a child stuck past it (say, on a lock some other thread held
# at the fork) is killed, and the parent compiles what is left.
DEADLINE_S = 120.0


def fork_available() -> bool:
    """Can this process fork (POSIX)?"""
    return hasattr(os, "fork")


def compile_in_children(
    compiles: Sequence[Callable[[], Any]], processes: int, deadline_s: float = DEADLINE_S
) -> tuple[int, int]:
    """Run ``compiles`` in up to ``processes`` forked children, each child taking the next
    compile no other has taken, and wait for them (killing any left after ``deadline_s``).
    Their results and errors are dropped: the caller compiles each again. Returns (compiles
    handed to the children, children started): (0, 0) where none started (no fork here, a
    fork that failed, SIGCHLD ignored: the system would reap children whose pids this could
    then kill)."""
    if not fork_available() or processes < 1 or not compiles:
        return 0, 0
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        log.info("SIGCHLD is ignored here: the compiles stay on threads")
        return 0, 0
    read, write = os.pipe()
    children: list[int] = []  # the ones not yet reaped
    try:
        try:
            queued = _queue(write, len(compiles))
        finally:
            os.close(write)  # before the fork: no child holds it
        # Every record is written before the fork, so a child meets an empty pipe only
        # once the queue is drained, even where another thread's fork holds a write end.
        os.set_blocking(read, False)
        with warnings.catch_warnings():
            # Python 3.12 warns on forking a process with threads; a child here runs
            # only compiles, and a stuck one is killed at the deadline.
            warnings.simplefilter("ignore", DeprecationWarning)
            for _ in range(min(processes, queued)):
                pid = _fork(compiles, read)
                if pid is None:
                    break
                children.append(pid)
        started = len(children)
        _wait(children, deadline_s)
    except BaseException:
        _kill(children)
        raise
    finally:
        os.close(read)
    return (queued if started else 0), started


def _fork(compiles: Sequence[Callable[[], Any]], read: int) -> int | None:
    """Start one child (``_child``): its pid, or None where the fork failed. SIGINT and
    SIGTERM wait while it forks, so that neither lands in the child before its handlers are
    the default ones (a KeyboardInterrupt there would run the caller's code in the child)."""
    stopping = {signal.SIGINT, signal.SIGTERM}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
    try:
        pid = os.fork()
    except OSError as exc:  # out of memory or processes: fewer children
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        log.info("fork failed (%s): fewer compile processes", exc)
        return None
    if pid == 0:
        _child(compiles, read, stopping, blocked)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return pid


def _queue(write: int, count: int) -> int:
    """Write the indices 0..count-1 into the pipe, as many as fit without blocking."""
    os.set_blocking(write, False)
    for index in range(count):
        try:
            os.write(write, _RECORD.pack(index))
        except BlockingIOError:
            return index
    return count


def _child(
    compiles: Sequence[Callable[[], Any]], read: int, stopping: set[int], blocked: Any
) -> NoReturn:
    """A child's whole life: compile the queued indices until the queue is empty. Its
    garbage collector stays off (a collection could run a finalizer of the parent's objects:
    a CUDA call, or a lock another thread held at the fork); SIGINT and SIGTERM end it."""
    try:
        gc.disable()
        for number in stopping:
            with contextlib.suppress(ValueError):  # (not the main thread: left as it was)
                signal.signal(number, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        while True:
            try:
                record = os.read(read, _RECORD.size)
            except BlockingIOError:
                break  # the queue is drained
            if len(record) != _RECORD.size:
                break
            try:
                compiles[_RECORD.unpack(record)[0]]()
            except Exception:  # noqa: BLE001  (the parent compiles it again and reports)
                pass
    finally:
        os._exit(0)


def _wait(children: list[int], deadline_s: float) -> None:
    """Reap every child (removing it from ``children``), killing those still running at
    the deadline."""
    end = time.monotonic() + deadline_s
    while children:
        children[:] = [pid for pid in children if not _reaped(pid)]
        if children and time.monotonic() > end:
            log.warning(
                "%d compile process(es) passed %.0f s and were killed; the rest of their "
                "compiles run in this process", len(children), deadline_s,
            )  # fmt: skip
            _kill(children)
        elif children:
            time.sleep(0.002)


def _reaped(pid: int) -> bool:
    """Has the child ``pid`` ended (reaped now, or already by someone else)?"""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # another thread's os.wait() reaped it
        return True


def _kill(children: list[int]) -> None:
    """Kill and reap the children not yet reaped (never a reaped pid: it may be reused)."""
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ChildProcessError, ProcessLookupError):  # reaped elsewhere meanwhile
            pass
    children.clear()
