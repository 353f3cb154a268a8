"""Triton's one-time cost in a process, paid on a thread while Dynamo traces.

The first Triton compile in a process computes ``triton.runtime.cache.triton_key``, part of
every kernel's cache key: a hash of Triton's own sources and of its compiled library
(hundreds of MB, read in 1 MB chunks). On the H100 machine (2026-11-25, cProfile of the
backend's first graph in a process) that was 426 reads and 397 hash updates, 0.80 s of the
backend's time, paid by every process's first compiled call or first ``generate()``.

Triton caches the key for the process, and computing it is file reads and ``hashlib``
updates on large buffers, which both release the GIL. So ``start`` computes it on a daemon
thread when the backend is imported (``torch.compile`` looks the backend up before it
traces the first call), beside Dynamo's trace, and ``wait`` (before the first compile)
joins it, so the key is never computed twice at once. With an empty Triton cache, the
backend's compile of a TinyLlama decode graph took 2.28-2.46 s with the thread against
2.75-2.93 s without it (H100, ``benchmarks/results/first_call_ab_h100.txt``).

Nothing here touches CUDA: a process that forks after importing the backend is unharmed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading

import torch

__all__ = ["start", "wait"]

log = logging.getLogger(__name__)

_THREAD: threading.Thread | None = None
_LOCK = threading.Lock()


def start() -> bool:
    """Begin computing Triton's cache key on a daemon thread, once per process; only where
    kernels will be compiled for a GPU (torch built with CUDA or ROCm, Triton installed, not
    Triton's interpreter). Returns whether a thread was started by this call."""
    global _THREAD
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.version.cuda is None and torch.version.hip is None:
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    with _LOCK:
        if _THREAD is not None:
            return False
        _THREAD = threading.Thread(target=_compute_key, name="fusebackend-triton-key", daemon=True)
        _THREAD.start()
    return True


def wait() -> None:
    """Block until ``start``'s thread (if any) is done."""
    thread = _THREAD
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _compute_key() -> None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # a Triton that keeps its key elsewhere: its first compile pays
        return
    try:
        triton_key()
    except Exception as exc:  # noqa: BLE001  (the first compile computes it and raises there)
        log.debug("computing Triton's cache key in the background failed: %s", exc)
