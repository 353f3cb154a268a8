"""In-place effects of a graph on its inputs, applied exactly once per call.

A new signature runs its graph more than once before the call returns: the fused graph and
the unfused reference (validation), the warm-up runs and the capture itself. Each of them
would write the graph's in-place updates (a KV cache, a position counter, a buffer) again.
One object per call, ``Effects``, owns that:

    effects = Effects(args, mutated)  # snapshot: the mutated inputs' values before the call
    trial = effects.isolate()         # a run on private clones of the snapshot
    ...                               # warm-up and capture may dirty the inputs in place
    effects.commit(trial, user_args)  # the winner's values into the caller's tensors, once

``commit`` writes every mutated input last, so whatever ran in between (a fused run that
raised halfway, warm-ups that wrote a parameter in place, a capture that failed) leaves no
trace: the caller's tensors hold exactly one run's update.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["Effects", "RngState", "shared_storages", "storage_ptr", "write_back"]


class Effects:
    """The in-place effects of one call on its mutated tensor inputs.

    Args:
        args: The inputs as the graph reads them (padded to a bucket, moved to the device);
            nothing may have run on them yet.
        mutated: Indices of the inputs the graph writes.
    """

    def __init__(self, args: Sequence[Any], mutated: Iterable[int]) -> None:
        self._args = list(args)
        self.indices = [i for i in mutated if i < len(args) and isinstance(args[i], Tensor)]
        # Inputs that share a storage with a mutated input (a = base, b = base[1:]) are
        # snapshot and isolated as one storage, so a write through one is seen through the
        # other and written back once. Cloned one by one, b's stale copy was written back
        # after a's update and erased it.
        self._shared = shared_storages(self._args, self.indices)
        in_shared = {i for group in self._shared for i in group}
        self._before = {i: _clone(args[i]) for i in self.indices if i not in in_shared}
        self._before_shared = [_storage_bytes(args[group[0]]).clone() for group in self._shared]
        self._released = False

    def isolate(self) -> list[Any]:
        """The inputs, with each mutated one replaced by a private copy of its snapshot."""
        assert not self._released, "isolate() after release()"
        out = list(self._args)
        for i, before in self._before.items():
            out[i] = _clone(before)
        for group, before in zip(self._shared, self._before_shared, strict=True):
            storage = before.clone().untyped_storage()
            for i in group:
                x = self._args[i]
                out[i] = x.new_empty(0).set_(storage, x.storage_offset(), x.shape, x.stride())
        return out

    def release(self) -> None:
        """Drop the snapshot once no run needs a fresh copy of it: a new signature then holds
        at most two copies of a written input at once (the fused run's and the reference
        run's), one during capture; with a multi-GB KV cache each copy counts."""
        self._before = {}
        self._before_shared = []
        self._released = True

    def commit(self, winner: Sequence[Any], user_args: Sequence[Any]) -> None:
        """Write the winning run's mutated inputs into the caller's tensors (sliced back
        from a padded batch). Called once per call, after everything else that ran."""
        shared = {i for group in self._shared for i in group}
        write_back([i for i in self.indices if i not in shared], winner, user_args)
        for group in self._shared:
            src, dst = winner[group[0]], user_args[group[0]]
            if storage_ptr(src) != storage_ptr(dst):
                _storage_bytes(dst).copy_(_storage_bytes(src))

    def own_outputs(
        self, outputs: Sequence[Any], winner: Sequence[Any], user_args: Sequence[Any]
    ) -> Sequence[Any]:
        """Outputs that are (views of) the winner's private copies, as the caller's tensors.

        A graph that returns a mutated input (``cache.index_copy_(...)`` returns ``cache``)
        must hand back the caller's tensor, as eager does, not a copy that later calls never
        update. Call after ``commit``.
        """
        if not self.indices:
            return outputs
        by_storage = {}
        for i in self.indices:
            if winner[i] is not user_args[i] and isinstance(user_args[i], Tensor):
                by_storage[storage_ptr(winner[i])] = i
        by_storage.pop(0, None)  # empty tensors have no storage to tell apart
        mapped = []
        for out in outputs:
            i = by_storage.get(storage_ptr(out)) if isinstance(out, Tensor) else None
            if i is not None:
                out = _rebase(out, winner[i], user_args[i])
            mapped.append(out)
        return tuple(mapped) if isinstance(outputs, tuple) else mapped


def storage_ptr(x: Tensor) -> int:
    """Where ``x``'s whole storage starts (0 for an empty one): tensors sharing it agree."""
    return x.untyped_storage().data_ptr()


def _storage_bytes(x: Tensor) -> Tensor:
    """The whole storage under ``x`` as a flat uint8 tensor."""
    storage = x.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=x.device).set_(storage, 0, (storage.nbytes(),))


def shared_storages(args: Sequence[Any], mutated: Sequence[int]) -> list[tuple[int, ...]]:
    """Groups of tensor inputs (2 or more) that share a storage with a mutated input."""
    by_storage: dict[tuple[torch.device, int], list[int]] = {}
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and a.untyped_storage().nbytes() > 0:
            by_storage.setdefault((a.device, storage_ptr(a)), []).append(i)
    groups = []
    for members in by_storage.values():
        if len(members) > 1 and any(i in mutated for i in members):
            groups.append(tuple(members))
    return groups


def _clone(x: Tensor) -> Tensor:
    # empty_like keeps the strides of a dense tensor, so a view of the copy maps back onto
    # the caller's tensor by offsets (own_outputs).
    return torch.empty_like(x).copy_(x)


def _rebase(out: Tensor, copy: Tensor, user: Tensor) -> Tensor:
    """``out`` (a view of ``copy``) as the same view of ``user``, when the layouts agree."""
    if out is copy:
        return user
    if copy.shape != user.shape or copy.stride() != user.stride() or copy.dtype != user.dtype:
        return out  # padded or re-laid out: the values are right, the aliasing is lost
    offset = user.storage_offset() + out.storage_offset() - copy.storage_offset()
    return user.as_strided(out.shape, out.stride(), offset)


class RngState:
    """The CPU generator's state and, for a CUDA graph, that device's, to replay draws."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        on_cuda = device is not None and torch.cuda.is_available()
        self.cuda = torch.cuda.get_rng_state(device) if on_cuda else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def write_back(
    mutated: Iterable[int], call_args: Sequence[Any] | Mapping[int, Any], user_args: Sequence[Any]
) -> None:
    """Copy mutated inputs that ran on a copy (padded, moved, cloned, a replay's static
    buffer) into the caller's; a padded copy is sliced back to the caller's batch."""
    for i in mutated:
        if i >= len(user_args):
            continue
        src, dst = call_args[i], user_args[i]
        if src is dst or not isinstance(dst, Tensor):
            continue
        dst.copy_(src if src.shape == dst.shape or dst.dim() == 0 else src[: dst.shape[0]])
