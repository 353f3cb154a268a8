"""On which call a new input signature is captured: the ``capture_on_call`` option.

A capture costs several runs' worth of host time (on an H200, 2026-12-01,
``diag_sentence_passes.py``: 6.2 and 10.8 ms a capture for MiniLM-L6- and BERT-base-shaped
encoders at batch 32, its largest parts cuBLAS' ``addmm`` under capture and
``cudaGraphInstantiate`` in a ``--trace-captures`` run), and pays back only when the
signature comes again. With a fixed ``capture_on_call`` (an int) every new signature is
captured on that call. With ``None`` (the default) it is decided per signature:

- a graph's first signature is captured on its 2nd call: a model called once (a script, a
  timed first call) costs one run;
- a signature one step further along a growing sequence than the graph's previous new one
  (``extends``: a decode step over a cache that grows by a token a step) is captured on its
  2nd call: such a signature does not come back within the sequence. A 4-layer Llama's
  48 decode steps over a DynamicCache at new lengths took 0.354 s so, 0.397 s with each
  step captured on its first call (``diag_growing_decode.py``, H200, 4ae618c; eager's
  2.86 s);
- any other new signature (shapes that vary: a corpus's lengths, single queries) is captured
  on its first call, so that a corpus encoded again replays every length. MiniLM-L6 and
  BERT-base shapes, 1000 sentences on an H200 (2026-12-01, 7a84fe4): the second pass took
  0.186 and 0.232 s this way (5 captures left in it: each Dynamo graph's first shape),
  0.257 and 0.343 s with ``capture_on_call=2`` (14 captures); eager's 0.27-0.30 and
  0.38-0.47 s.
"""

from __future__ import annotations

from fusebackend.runtime.keys import Key

__all__ = ["CaptureCall", "extends", "recurring_call"]

# The call a signature that is not captured at once is captured on: its first recurrence.
_RECURRING = 2


def recurring_call(option: int | None) -> int:
    """The call on which a signature left uncaptured on its first call is captured, for the
    ``capture_on_call`` option ``option``: the option itself, or the first recurrence."""
    return option if option is not None else _RECURRING


class CaptureCall:
    """Which call of a new signature captures it, for one graph cache.

    Args:
        fixed: The ``capture_on_call`` option: that call for every signature, or None to
            decide per signature (module docstring).
    """

    def __init__(self, fixed: int | None) -> None:
        self._fixed = fixed
        self._previous: Key | None = None
        self.recurring = recurring_call(fixed)

    def first_miss(self, key: Key) -> int:
        """The call that captures ``key``, a signature this cache has no entry for; each
        such miss is remembered as the graph's previous new signature."""
        previous, self._previous = self._previous, key
        if self._fixed is not None:
            return self._fixed
        if previous is None or extends(previous, key):
            return _RECURRING
        return 1

    def clear(self) -> None:
        """Forget the previous new signature (``GraphCache.clear``)."""
        self._previous = None


def extends(before: Key, after: Key) -> bool:
    """Whether ``after`` is ``before`` one step further along a growing sequence: every size
    that differs (a tensor dim, an int input) grew by one common positive step, at least one
    did, and nothing else differs. A decode step over a growing KV cache: the cache, the mask
    and the sizes Dynamo passes as ints all grow by one token (by k for k tokens a step)."""
    if before.fused != after.fused or len(before.inputs) != len(after.inputs):
        return False
    step = 0
    for old, new in zip(before.inputs, after.inputs):
        if old == new:
            continue
        if len(old) == 4 and len(new) == 4:  # (shape, stride, dtype, device)
            if old[2:] != new[2:] or len(old[0]) != len(new[0]):
                return False
            pairs = zip(old[0], new[0])
        elif len(old) == 2 and old[0] is int and new[0] is int:  # (int, value)
            pairs = iter(((old[1], new[1]),))
        else:
            return False
        for a, b in pairs:
            if a != b:
                if b <= a or (step and b - a != step):
                    return False
                step = b - a
    return step > 0
