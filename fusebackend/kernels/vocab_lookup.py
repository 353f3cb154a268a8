"""One launch for a rank's part of a vocab-parallel embedding lookup.

Under tensor parallelism an embedding table is split along the vocabulary (transformers'
``tp_plan="auto"`` shards ``embed_tokens`` as ``Shard(0)``): each rank holds rows
``[start, start + rows)``. DTensor computes a rank's part of ``embedding(ids, table)`` as a
chain of eager kernels (the ids' mask and shift, a clamp, the gather, zeroing the rows of
other ranks' ids), then all-reduces the parts. This kernel is that chain in one launch:
one program per token and column block writes ``table[id - start]`` where the id is this
rank's, zeros elsewhere. The all-reduce stays in the graph (passes/collectives.py).

An id outside ``[0, vocab)`` belongs to no rank: with ``checks`` the kernel is built with
Triton's debug mode and its device-side assert stops the program, as eager CUDA's
embedding does for a whole table (DTensor's eager path returns zeros for it).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fusebackend.kernels.configs import ceil_div
from fusebackend.kernels.family import concrete_cuda_tensor, family, launch_key
from fusebackend.kernels.launch import triton_usable
from fusebackend.kernels.triton_api import warmup_launch

__all__ = ["precompile_vocab_lookup", "vocab_parallel_lookup"]


def vocab_parallel_lookup(
    ids: torch.Tensor, table: torch.Tensor, start: int, vocab: int, checks: bool
) -> torch.Tensor:
    """``table[ids - start]`` for the ids in ``[start, start + len(table))``, zero rows for
    the others: this rank's part of ``embedding(ids, full_table)``, ``[*ids.shape, D]``.

    ``vocab``: rows of the full table (the ids' valid range, for the index check).
    """
    _check_host_ids(ids, vocab)
    if not triton_usable(table.device) or ids.numel() == 0:
        return _reference(ids, table, start)
    out = torch.empty((*ids.shape, table.shape[1]), dtype=table.dtype, device=table.device)
    args, grid, meta = _launch(ids, table, start, vocab, out)
    _kernel(checks)[grid](*args, **meta)
    return out


def _check_host_ids(ids: torch.Tensor, vocab: int) -> None:
    """CPU ids outside ``[0, vocab)`` raise eager's IndexError (on a GPU this check would be
    a host sync: the kernel's device-side assert checks there)."""
    if ids.device.type == "cpu" and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise IndexError(
                f"index out of range in self: embedding index {bad} is outside "
                f"[0, {vocab}) of a vocabulary split across ranks"
            )


def _reference(ids: torch.Tensor, table: torch.Tensor, start: int) -> torch.Tensor:
    """The same in torch ops (no Triton on this device)."""
    local = ids - start
    inside = (local >= 0) & (local < table.shape[0])
    rows = torch.nn.functional.embedding(torch.where(inside, local, 0), table)
    return torch.where(inside.unsqueeze(-1), rows, 0)


def precompile_vocab_lookup(ids, table, start: int, vocab: int, checks: bool) -> None:
    """Compile the kernel that ``vocab_parallel_lookup`` on tensors like these (fake tensors
    suffice) would launch, without running it (``launch.precompile_all``)."""
    out = table.new_empty((*ids.shape, table.shape[1]))
    args, grid, meta = _launch(ids, table, start, vocab, out)
    warmup_launch(_kernel(checks), grid, args, meta, table.device)


def _precompile_job(args: Any) -> Any:
    """The kernel family's precompile job (kernels/family.py) for a launch on ``args``:
    (ids, table, start, vocab, checks), the tensors as example values."""
    ids, table, *rest = args
    values = [ids, table]
    if not all(concrete_cuda_tensor(v) for v in values):
        return None
    key = ("vocab", *rest, *map(launch_key, values))
    return key, functools.partial(precompile_vocab_lookup, *values, *rest)


family("vocab_parallel_lookup", _precompile_job)(vocab_parallel_lookup)


def _launch(ids, table, start, vocab, out) -> tuple[list[Any], tuple[int, int], dict[str, int]]:
    """(arguments, grid, meta-parameters) of the kernel's launch on these tensors."""
    rows, width = table.shape
    # 1024-column programs of 2 warps, as the row kernels' lookups use (kernels/configs.py:
    # whole-row programs paid 4-5% for the index assert on an H100, 1024-wide ones nothing).
    block = min(1024, 1 << max(0, (width - 1).bit_length()))
    flat_ids = ids.reshape(-1)
    args = [flat_ids, table, out, start, rows, vocab, width, table.stride(0), table.stride(1)]
    grid = (flat_ids.numel(), ceil_div(width, block))
    return args, grid, {"BLOCK": block, "num_warps": 2 if block >= 512 else 1}


@functools.cache
def _kernel(checks: bool) -> Any:
    import triton
    import triton.language as tl

    @triton.jit(debug=checks)
    def _vocab_parallel_lookup(
        ids,  # [N] token ids, any integer dtype
        table,  # [rows, width] this rank's rows of the table
        out,  # [N, width] contiguous, the table's dtype
        start,  # first id of this rank's rows
        rows,  # rows of this rank
        vocab,  # rows of the whole table
        width,
        table_row_stride,
        table_col_stride,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        index = tl.load(ids + token).to(tl.int64)
        tl.device_assert((index >= 0) & (index < vocab), "embedding: index out of range")
        local = index - start
        mine = (local >= 0) & (local < rows)
        keep = cols < width
        row = tl.load(
            table + local * table_row_stride + cols * table_col_stride, mask=keep & mine, other=0.0
        )
        tl.store(out + token * width + cols, row, mask=keep)

    return _vocab_parallel_lookup
