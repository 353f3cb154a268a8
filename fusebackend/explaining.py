"""``explain(fn, *args)``: compile ``fn`` with infinifuse, run it once, return the reports.

Its own module because it needs both ends: backend.py (which records reports in report.py)
and report.py (which imports nothing of the backend), so neither imports the other back.
backend.py is imported at the first call: ``import fusebackend`` stays as light as it was.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

import fusebackend.report as _report
from fusebackend.report import FusionReport

__all__ = ["explain"]


def _uncompiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` itself when it is the result of ``torch.compile`` (a module or a function)."""
    if isinstance(fn, torch._dynamo.eval_frame.OptimizedModule):
        return fn._orig_mod
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def explain(
    fn: Callable[..., Any], *args: Any, options: dict[str, Any] | None = None, **kwargs: Any
) -> FusionReport:
    """Compile ``fn`` with infinifuse, run it once on the arguments and report.

    Returns the report of every graph Dynamo produced during that call: the fused
    groups (nodes absorbed, kernel name, inputs, outputs, generated source) and every
    candidate not fused, with its reason. ``options`` are the backend's options.

    An inference tool: ``fn`` runs under ``torch.no_grad()`` (graphs that need gradients are
    never fused). ``fn`` is traced anew whether or not it was compiled before, by the user
    or by an earlier ``explain`` (a ``torch.compile``d module or function is unwrapped
    first); that compile is kept apart from the user's own (``isolate_recompiles``), so it
    neither reuses nor counts against their compiled entries.
    """

    from fusebackend.backend import infinifuse

    def backend(gm: Any, example_inputs: Any, **backend_kwargs: Any) -> Any:
        # A new callable per explain call: Dynamo reuses a compiled entry only for the
        # backend that made it, so the user's earlier torch.compile(fn, backend="infinifuse")
        # is not served here (reusing it reported "no graph was compiled").
        return infinifuse(gm, example_inputs, **backend_kwargs)

    extra: dict[str, Any] = {}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:  # torch >= 2.13
        extra["isolate_recompiles"] = True
    with _report._REPORTS_LOCK:
        start = _report._recorded
    compiled = torch.compile(_uncompiled(fn), backend=backend, options=options, **extra)
    with torch.no_grad():
        compiled(*args, **kwargs)
    return FusionReport(_report._reports_since(start))
