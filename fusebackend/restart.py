"""Dynamic shapes remembered across restarts: a restarted process traces its dynamic graph first.

Every process pays Dynamo's automatic-dynamic sequence again: a graph static in every size for
the first call, then a recompile dynamic in what changed (sentence-transformers over a sorted
corpus: the length, then the batch; 3 graphs). On a 2-core CPU (2026-11-28, MiniLM-L6 shape,
300 sentences, fusion off) Dynamo took 5.5-6.4 s of infinifuse's 7.8-8.8 s first pass, the
backend 0.02 s; restarted with this profile: 1 graph, Dynamo 2.5 s, first pass 4.6-5.0 s
(docs/ARCHITECTURE.md, "Restarts").

torch's own profile (automatic-dynamic PGO: ``TORCH_COMPILE_JOB_ID``, a pickle under
``TORCHINDUCTOR_CACHE_DIR/dynamo``) does not bring that back for these models: it keys each
frame by its code and ``hash()`` of its closure's code objects (torch 2.13, ``pgo.CodeId``),
which Python salts per process (``PYTHONHASHSEED``; ``hash(None)`` follows ASLR before Python
3.12). A compiled frame that is a closure never matches in a new process: transformers'
decorated ``forward`` (``wrapper``) and ``torch.compile(module)`` itself (``inner``). Measured
with a job id, torch 2.13, Python 3.11: 3 graphs again in the restart (1 only with
``PYTHONHASHSEED=0`` and ASLR off); a plain function's frame: 3, then 1.

So this keeps its own profile, a JSON file: after each Dynamo compile it reads which sizes
automatic dynamic found changing in this process (torch's in-memory PGO state, which Dynamo
keeps whether or not a job id is set), merges them into the file, and at start hands the file's
sources to torch's public ``torch.compiler.config.dynamic_sources``, which makes them dynamic at
their first trace, in whichever frame they appear.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

import torch

__all__ = ["ENV", "RememberedShapes", "default_path", "remember_dynamic_shapes"]

log = logging.getLogger(__name__)

# The environment variable that turns this on when fusebackend is imported (Dynamo imports it
# at torch.compile(backend="infinifuse")): "1" for default_path(), or a file's path.
ENV = "FUSEBACKEND_DYNAMIC_SHAPES"
_FORMAT = 1
# A profile is only used by the torch version (major.minor) that wrote it: Dynamo's source
# names are its own and may change between versions.
_TORCH = ".".join(torch.__version__.split(".")[:2])
_ALL = "all"  # every dim of a tensor (or a number) dynamic


@dataclasses.dataclass(frozen=True)
class RememberedShapes:
    """What ``remember_dynamic_shapes`` found at ``path`` and handed to Dynamo."""

    path: str
    # torch.compiler.config.dynamic_sources entries made from the file (empty: none there yet)
    entries: tuple[str, ...]
    # why the file there was not used (unreadable, another format or torch version); None if
    # it was used or absent. It is rewritten after this process's next compile.
    ignored: str | None = None


_remembered: dict[str, tuple[RememberedShapes, _Recorder]] = {}


def default_path() -> str:
    """``<torch's cache dir>/fusebackend/dynamic_shapes.json``: beside torch's own profile, so
    ``TORCHINDUCTOR_CACHE_DIR`` scopes it as it scopes the other compile caches."""
    from torch._inductor.runtime.runtime_utils import cache_dir

    return os.path.join(cache_dir(), "fusebackend", "dynamic_shapes.json")


def remember_dynamic_shapes(path: str | os.PathLike[str] | None = None) -> RememberedShapes:
    """Trace the sizes an earlier process saw change as dynamic from their first trace, and
    record this process's for the next. Call it before the first compiled call (later, it
    applies to the compiles after it).

    ``path``: the profile file, one per workload (``None``: ``default_path()``). Its sources go
    into ``torch.compiler.config.dynamic_sources`` (added to what is there) for the whole
    process, every frame and backend; an unreadable file, or one of another torch version, is
    ignored with a warning and rewritten. Calling again with the same path returns the first
    call's result (and records again after ``torch._dynamo.reset()``, which removes Dynamo's
    compile callbacks).
    """
    path = os.path.abspath(os.fspath(path if path is not None else default_path()))
    if path in _remembered:  # again: the same result; recording again after a reset
        result, recorder = _remembered[path]
        if recorder not in torch._dynamo.callback_handler.end_callbacks:
            torch._dynamo.callback_handler.register_end_callback(recorder)
        return result
    sources, ignored = _read(path)
    if ignored is not None:
        log.warning("infinifuse: dynamic-shapes profile %s ignored: %s", path, ignored)
    entries = tuple(e for name, dims in sorted(sources.items()) for e in _entries(name, dims))
    current = [e for e in torch.compiler.config.dynamic_sources.split(",") if e.strip()]
    torch.compiler.config.dynamic_sources = ",".join(
        [*current, *(e for e in entries if e not in current)]
    )
    recorder = _Recorder(path, sources, rewrite=ignored is not None)
    torch._dynamo.callback_handler.register_end_callback(recorder)
    result = RememberedShapes(path, entries, ignored)
    _remembered[path] = (result, recorder)
    return result


def _entries(name: str, dims: Any) -> list[str]:
    """dynamic_sources entries for one source: its name as an anchored, escaped regex (torch
    matches entries with ``re.match``; an unescaped name is a regex too, ``['key-name']`` a bad
    character range that would raise inside Dynamo), one entry per dim where only some dims are
    dynamic (``:N``, torch 2.13; a torch without that syntax matches no source with it)."""
    pattern = re.escape(name) + "$"
    return [pattern] if dims == _ALL else [f"{pattern}:{d}" for d in dims]


def _read(path: str) -> tuple[dict[str, Any], str | None]:
    """The file's sources (name -> "all" or dims) and why it was not used (None if it was)."""
    if not os.path.exists(path):
        return {}, None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return {}, f"unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return {}, f"not a format-{_FORMAT} profile"
    if data.get("torch") != _TORCH:
        return {}, f"written by torch {data.get('torch')!r}, this is {_TORCH}"
    sources = data.get("sources")
    if not isinstance(sources, dict) or not all(
        _valid_name(k) and _valid_dims(v) for k, v in sources.items()
    ):
        return {}, "malformed sources"
    return sources, None


def _valid_name(name: Any) -> bool:
    # dynamic_sources is split at commas and stripped of spaces
    return isinstance(name, str) and bool(name) and "," not in name and not re.search(r"\s", name)


def _valid_dims(dims: Any) -> bool:
    return dims == _ALL or (
        isinstance(dims, list)
        and bool(dims)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims)
    )


def _observed() -> dict[str, Any]:
    """Sources automatic dynamic found changing in this process, from Dynamo's in-memory PGO
    state (every compiled frame: dynamic_sources applies to every frame too)."""
    from torch._dynamo import pgo

    state, dynamic = getattr(pgo, "_CODE_STATE", None), getattr(pgo, "auto_dynamic", None)
    found: dict[str, Any] = {}
    for code_state in (state or {}).values():
        for name, entry in code_state.automatic_dynamic.items():
            size, dims = getattr(entry, "size", None), None
            if isinstance(size, tuple):
                dims = [i for i, s in enumerate(size) if s is dynamic] or None
                if dims is not None and len(dims) == len(size):
                    dims = _ALL
            elif size is dynamic and getattr(entry, "scalar", None) is dynamic:
                dims = _ALL  # a number, or a tensor whose rank changed
            if dims is not None and _valid_name(name):
                found[name] = _merge(found.get(name), dims)
    return found


def _merge(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if a == _ALL or b == _ALL:
        return _ALL
    return sorted(set(a) | set(b))


class _Recorder:
    """Dynamo's compile-end callback: the file's sources merged with this process's, written
    when they change (after each compile, as torch writes its own profile: a process that is
    killed keeps what it found)."""

    def __init__(self, path: str, sources: dict[str, Any], rewrite: bool) -> None:
        self.path, self.sources = path, dict(sources)
        # what the file holds (None: absent or ignored, written after the next compile)
        self.written = None if rewrite or not os.path.exists(path) else dict(sources)
        self.failed = False

    def __call__(self, *_args: Any) -> None:  # CallbackArgs in torch 2.7+, none before
        try:
            for name, dims in _observed().items():
                self.sources[name] = _merge(self.sources.get(name), dims)
            if self.sources != self.written:
                self._write()
                self.written = dict(self.sources)
        except Exception:  # never fail a compile over the profile
            if not self.failed:
                log.warning("infinifuse: dynamic-shapes profile %s not written", self.path,
                            exc_info=True)  # fmt: skip
            self.failed = True

    def _write(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        data = {"format": _FORMAT, "torch": _TORCH, "sources": self.sources}
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(temporary, self.path)  # readers see the old file or the new one, whole


def from_environment() -> RememberedShapes | None:
    """``remember_dynamic_shapes`` as ``FUSEBACKEND_DYNAMIC_SHAPES`` asks ("1": the default
    path; another value: a path), or None where it is unset or empty."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    return remember_dynamic_shapes(None if value == "1" else value)
