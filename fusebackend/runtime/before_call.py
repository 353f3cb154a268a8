"""A graph cache's before-call hook, and when it runs.

The hook (``GraphCache``'s ``before_call``) keeps the constants a fused graph derives from its
inputs (folded BatchNorms, channels-last weight copies: ``batch_norm_folding.Refresh``) in step
with them, writing them in place so captured graphs stay valid. It runs before the call,
unless the cache was also given its check (``stale_after_replay``: whether the hook has work,
changing nothing) and the graph writes no input. Then a call that replays a captured entry
launches first and checks after, while the device runs the replay; where the check says stale,
the hook runs (its writes queue behind that replay) and the graph is replayed once more, the
first outputs dropped. Every other path (a miss, a capture, a re-record, a direct run, a routed
call) runs the hook first (``settle``). The check then adds nothing to the latency before a
replay's launch: it had taken 116 us a call for ResNet-50's 282 derived-constant sources on an
H200 (``benchmarks/diag/diag_vision_host.py``, 2026-11-28), ahead of ~370 us of kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["BeforeCall"]


class BeforeCall:
    """Args: ``hook`` (None: nothing to run), ``check`` (None: never deferred) and whether the
    graph writes its inputs (a replay that writes must not run twice: never deferred)."""

    __slots__ = ("_hook", "_check", "deferrable")

    def __init__(
        self,
        hook: Callable[[Sequence[Any]], None] | None,
        check: Callable[[Sequence[Any]], bool] | None,
        writes_inputs: bool,
    ) -> None:
        self._hook, self._check = hook, check
        self.deferrable = hook is not None and check is not None and not writes_inputs

    def start(self, args: Sequence[Any]) -> bool:
        """At a call's start: run the hook, or return True where it is deferred."""
        if self.deferrable:
            return True
        if self._hook is not None:
            self._hook(args)
        return False

    def settle(self, deferred: bool, args: Sequence[Any]) -> bool:
        """Before a path other than a plain replay: run a deferred hook now; returns False
        (nothing deferred any more)."""
        if deferred:
            self._hook(args)  # type: ignore[misc]
        return False

    def stale_after(self, deferred: bool, args: Sequence[Any]) -> bool:
        """After a replay's launch: whether the replay read stale constants; if so the hook
        has run (queued after it) and the caller replays again."""
        if not deferred or not self._check(args):  # type: ignore[misc]
            return False
        self._hook(args)  # type: ignore[misc]
        return True
