"""Compile generated kernels once and launch them: the public ``row_kernel`` launcher.

Generated source is imported through ``triton_api.import_source`` (Triton's JIT reads a
kernel's source from its file). Kernels are cached in-process by (RowProgram, rank,
KernelOptions, layout): the program names no graph node, so the same group in every layer
of a model compiles once. Triton caches the binaries per argument specialisation (dtypes,
16-byte alignment, strides equal to 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for

from fusebackend.kernels.codegen import generate_source
from fusebackend.kernels.configs import MAX_GRID_Y, ceil_div, launch_config, layout_for
from fusebackend.kernels.family import TensorExample, hinted_examples
from fusebackend.kernels.ir import KernelOptions, RowProgram, broadcast_shapes
from fusebackend.kernels.pair_source import generate_pair_source
from fusebackend.kernels.shapes import ShapeRecipe, shape_pattern, shape_recipe, value_shapes

# The Triton-facing names this module has always offered (backend.py, the hand-written
# kernels, benchmarks and tests import them from here); they live in triton_api.py.
from fusebackend.kernels.triton_api import (
    import_source,
    interpreter_enabled,
    precompile_all,
    triton_usable,
    warmup_pointer,
    warmup_pointer_of,
)
from fusebackend.kernels.triton_api import warmup as _warmup

_import_source = import_source  # benchmarks/diag import it by this name

__all__ = [
    "TensorExample",
    "broadcast_shapes",
    "interpreter_enabled",
    "hinted_examples",
    "kernel_source",
    "launch_rank",
    "layout_for",
    "precompile",
    "precompile_all",
    "row_kernel",
    "row_kernel_pair",
    "run_on_device",
    "triton_usable",
    "value_shapes",
    "warmup_pointer",
    "warmup_pointer_of",
]

_KERNELS: dict[tuple[RowProgram, int, KernelOptions, str, bool], Any] = {}
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1024)
def kernel_source(
    program: RowProgram,
    rank: int,
    options: KernelOptions | None = None,
    layout: str | None = None,
) -> tuple[str, str]:
    """(kernel name, generated source): what ``row_kernel`` compiles (``layout``: by
    default the one for rows that fit in registers). Memoized: every layer's groups ask for
    the same few sources (113 groups, 10 programs in a 22-layer Llama's decode graph)."""
    layout = layout or layout_for(program, 1)
    return generate_source(program, rank, options or KernelOptions(), layout)


def _compiled_kernel(
    program: RowProgram, rank: int, options: KernelOptions, layout: str, pair: bool = False
) -> Any:
    key = (program, rank, options, layout, pair)
    kernel = _KERNELS.get(key)
    if kernel is not None:
        return kernel
    with _LOCK:
        if key not in _KERNELS:
            generate = generate_pair_source if pair else generate_source
            name, source = generate(program, rank, options, layout)
            _KERNELS[key] = getattr(import_source(name, source), name)
        return _KERNELS[key]


def check_indices(spec: RowProgram, inputs: Sequence[torch.Tensor]) -> None:
    """Raise IndexError for an out-of-range index, as eager's CPU embedding does.

    Only for CPU tensors: on the GPU this would be a host sync, and the kernel's
    device-side assert does the job there.
    """
    for lookup in spec.lookups:
        index, table = inputs[lookup.index_slot], inputs[lookup.table_slot]
        if index.device.type != "cpu" or index.numel() == 0:
            continue
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= table.shape[0]:
            bad = low if low < 0 else high
            raise IndexError(
                f"index out of range in self: embedding index {bad} is outside "
                f"[0, {table.shape[0]}) for a table of shape {tuple(table.shape)}"
            )


def _expand_strides(
    size: Sequence[int], stride: Sequence[int], target: Sequence[int]
) -> tuple[int, ...]:
    """The strides of ``t.expand(target)`` for ``t`` of ``size`` and ``stride``, computed
    as torch's ``inferExpandGeometry`` does (a call of expand took ~2 us): kept where the
    size matches (a dim of 1 included), 0 where a dim of 1 broadcasts; a new leading dim
    of 1 steps over the dims after it (0 with none after it), one of more is 0."""
    out = [0] * len(target)
    new = len(target) - len(size)
    for i in reversed(range(len(target))):
        if i >= new:
            n, step = size[i - new], stride[i - new]
        else:
            n, step = 1, target[i + 1] * out[i + 1] if i + 1 < len(target) else 0
        out[i] = step if n == target[i] else 0
    return tuple(out)


# The strides of ``torch.empty(shape)`` (sizes 0 and 1 step as 1), computed without a tensor.
_contiguous_strides = make_contiguous_strides_for


@dataclasses.dataclass
class _Launch:
    """One set of inputs of a kernel: its argument list, with ``None`` where a tensor goes
    (``tensors`` says which: (place in ``args``, index into the set's inputs then its
    outputs)), the shapes and dtypes of the outputs it allocates, and its sizes."""

    args: list[Any]  # empty when there are no rows: nothing to launch
    tensors: list[tuple[int, int]]
    outputs: list[tuple[torch.Size, torch.dtype]]
    rank: int
    rows: int
    width: int
    # Every row of every strided tensor starts at a multiple of 16 elements (Triton then
    # proves its loads and stores aligned and lays whole row pieces out per thread).
    aligned: bool = True


def _prepare(
    program: RowProgram,
    inputs: Sequence[torch.Tensor],
    recipes: dict[Any, ShapeRecipe | None] | None = None,
    out: Sequence[torch.Tensor | None] | None = None,
) -> _Launch:
    """The kernel's arguments for tensors shaped like ``inputs`` (shapes, strides and dtypes
    are read; the tensors themselves are filled in by ``_Plans.run``). ``recipes``: a
    caller's ``ShapeRecipe`` per input pattern, used and filled in. ``out``: per output, a
    tensor to write it into (its strides addressed) or None (a new contiguous tensor)."""
    found = None
    if recipes is not None:
        pattern = shape_pattern(program, inputs)
        recipe = recipes.get(pattern)
        found = recipe.shapes(inputs) if recipe is not None else None
    if found is not None:
        out_shapes, group_shape = found
    else:
        shapes, group_shape = value_shapes(program, inputs)
        out_shapes = [shapes[v] for v in program.outputs]
        if recipes is not None and pattern not in recipes:
            recipes[pattern] = shape_recipe(program, inputs, out_shapes, group_shape)
    lead, width = group_shape[:-1], group_shape[-1]
    narrow_shape = torch.Size((*lead, 1))
    rows = lead.numel()
    outputs = [(shape, program.value_dtype(v)) for shape, v in zip(out_shapes, program.outputs)]
    if rows == 0 or width == 0:
        return _Launch([], [], outputs, len(lead), rows, width)

    # (pool index, strides over the lead dims, the sizes after them) of every tensor
    entries: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    for slot, t in enumerate(inputs):
        if slot in program.scalar_inputs:
            entries.append((slot, (), ()))  # the number itself, filled in at each call
        elif slot in program.index_slots:
            entries.append((slot, _expand_strides(t.shape, t.stride(), lead), ()))
        elif slot in program.table_slots:
            col_stride = 0 if t.shape[1] == 1 else t.stride(1)
            entries.append((slot, (), (t.shape[0], t.stride(0), col_stride)))
        elif slot in program.concat_parts:  # its own range of the dim, the group's elsewhere
            dim = len(group_shape) + program.concat_parts[slot][1]
            shape = torch.Size((*group_shape[:dim], t.shape[dim - len(group_shape)],
                                *group_shape[dim + 1:]))  # fmt: skip
            strides = _expand_strides(t.shape, t.stride(), shape)
            entries.append((slot, strides[:-1], (strides[-1], strides[dim])))
        else:
            shape = narrow_shape if slot in program.narrow_inputs else group_shape
            *lead_strides, col_stride = _expand_strides(t.shape, t.stride(), shape)
            entries.append((slot, tuple(lead_strides), (col_stride,)))
    placed = dict(program.placed_outputs)
    for j, (value, (out_shape, dtype)) in enumerate(zip(program.outputs, outputs)):
        shape = narrow_shape if value in program.narrow_values else group_shape
        given = out[j] if out is not None else None
        if j in placed:  # rows placed by a row number each: given 2-d, or a new contiguous
            _check_rows_destination(j, given, out_shape, dtype)
            row, col = (out_shape[-1], 1) if given is None else given.stride()
            entries.append((len(inputs) + j, (row,), (col,)))
            continue
        if given is None:  # as the output is allocated: contiguous
            strides = _expand_strides(out_shape, _contiguous_strides(out_shape), shape)
        else:
            _check_destination(j, given, out_shape, dtype)
            strides = _expand_strides(out_shape, given.stride(), shape)
        *lead_strides, col_stride = strides
        entries.append((len(inputs) + j, tuple(lead_strides), (col_stride,)))
    unstrided = program.table_slots | program.scalar_inputs | {len(inputs) + j for j in placed}
    strided = [i for i, (slot, _, _) in enumerate(entries) if slot not in unstrided]
    sizes, lead_strides = _collapse_lead(lead, [entries[i][1] for i in strided])
    for i, merged in zip(strided, lead_strides):
        entries[i] = (entries[i][0], merged, entries[i][2])

    args: list[Any] = []
    tensors: list[tuple[int, int]] = []
    for index, strides, rest in entries:
        tensors.append((len(args), index))
        args.extend((None, *strides, *rest))
    args += [*sizes, rows, width]
    for i in program.row_concats:  # rows per index of each one's dim, and that dim's size
        dim = len(lead) + 1 + program.instrs[i].dim
        args += [lead[dim + 1 :].numel(), lead[dim]]
    # (index tensors and narrow [..., 1] values are read one element per row: not rows)
    narrow = program.index_slots | program.narrow_inputs
    narrow |= {len(inputs) + j for j, v in enumerate(program.outputs) if v in program.narrow_values}
    aligned = all(
        s % 16 == 0
        for i, strides in zip(strided, lead_strides)
        if entries[i][0] not in narrow
        for s in strides
    )
    return _Launch(args, tensors, outputs, len(sizes), rows, width, aligned)


def _check_destination(k: int, given: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
    """A tensor given to write output ``k`` into must be that output's shape and dtype."""
    if tuple(given.shape) != tuple(shape) or given.dtype != dtype:
        raise ValueError(
            f"output {k} is {tuple(shape)} {dtype}; the tensor given to write it into is "
            f"{tuple(given.shape)} {given.dtype}"
        )


def _check_rows_destination(k: int, given: Any, shape: torch.Size, dtype: torch.dtype) -> None:
    """A placed output's destination: rows of its width, as many as it has, its dtype."""
    if given is None:
        return
    if given.dim() != 2 or (given.shape[0], given.shape[1]) != (
        shape[:-1].numel(), shape[-1]) or given.dtype != dtype:  # fmt: skip
        raise ValueError(f"output {k} ({tuple(shape)} {dtype}) is placed by row numbers: it "
                         "needs a 2-d tensor of its rows to write into")  # fmt: skip


def _collapse_lead(
    lead: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[list[int], list[tuple[int, ...]]]:
    """Fewer lead dims addressing the same elements: dims of size 1 dropped, and a dim
    merged into the one before it wherever every tensor steps over both as over one
    (outer stride == inner stride x inner size). A decode step's ``[1, 1, D]`` rows become
    one dim: the kernel then splits its row number by no sizes (64-bit divisions per row
    cost ~0.1-0.4 us per small kernel). At least one dim is kept."""
    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for dim, size in enumerate(lead):
        if size == 1:
            continue
        inner = [s[dim] for s in strides]
        if sizes and all(m[-1] == x * size for m, x in zip(merged, inner)):
            sizes[-1] *= size
            for m, x in zip(merged, inner):
                m[-1] = x
        else:
            sizes.append(size)
            for m, x in zip(merged, inner):
                m.append(x)
    if not sizes:
        return [1], [(0,) for _ in strides]
    return sizes, [tuple(m) for m in merged]


def run_on_device(kernel: Any, grid: tuple[int, ...], args: list[Any], meta: dict[str, Any],
                  device: torch.device) -> None:  # fmt: skip
    """``kernel[grid](*args, **meta)`` on ``device``: Triton launches on the current CUDA
    device and its stream, so a tensor on another GPU needs that device made current. A
    ``TypeError`` of the launch is raised again naming the kernel and the arguments given:
    Triton's C launcher says only "function takes exactly 59 arguments (30 given)", which is
    what a fused graph's fallback reason showed on an H200 (2026-12-01) when a kernel ran
    through another kernel's launcher."""
    try:
        # Entering torch.cuda.device costs a few us per launch: only where it changes anything.
        if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
            with torch.cuda.device(device):
                kernel[grid](*args, **meta)
        else:
            kernel[grid](*args, **meta)
    except TypeError as exc:
        name = getattr(getattr(kernel, "fn", None), "__name__", type(kernel).__name__)
        raise TypeError(f"{exc} (launching {name} with {len(args)} arguments and "
                        f"{len(meta)} meta-parameters: {', '.join(meta)})") from exc  # fmt: skip


def _blocks(layout: str, width: int, block_d: int) -> tuple[int, int]:
    """(column blocks of the grid, chunks per row) for ``layout``."""
    col_blocks = ceil_div(width, block_d) if layout == "tile" else 1
    chunks = ceil_div(width, block_d) if layout == "chunked" else 1
    return col_blocks, chunks


@dataclasses.dataclass
class _LaunchPlan:
    """Which kernel, grid and launch options run one launch (a group, or a pair), and its
    arguments with ``None`` where ``tensors`` (place, index into the pool of
    ``_Plans.run``) put a tensor."""

    kernel: Any
    grid: tuple[int, int]
    args: list[Any]
    tensors: list[tuple[int, int]]
    meta: dict[str, Any]  # BLOCK_R, BLOCK_D, CHUNKS, ROWS_AXIS, num_warps, sanitize_overflow
    device: torch.device


def _plan(
    program: RowProgram,
    options: KernelOptions,
    a: _Launch,
    b: _Launch | None,
    device: torch.device,
    pool_offsets: tuple[int, int] = (0, 0),
) -> _LaunchPlan:
    """``pool_offsets``: where the tensors of ``a`` and of ``b`` start in the pool."""
    layout = layout_for(program, a.width)
    rows = a.rows if b is None else max(a.rows, b.rows)
    aligned = a.aligned and (b is None or b.aligned)
    block_r, block_d, num_warps = launch_config(
        rows, a.width, layout, bool(program.lookups), aligned=aligned
    )
    col_blocks, chunks = _blocks(layout, a.width, block_d)
    grid_a = ceil_div(a.rows, block_r)
    tensors = [(place, index + pool_offsets[0]) for place, index in a.tensors]
    if b is None:
        grid, args = (grid_a, col_blocks), a.args
    else:
        grid = (grid_a + ceil_div(b.rows, block_r), col_blocks)
        args = [*a.args, *b.args, grid_a]
        tensors += [(place + len(a.args), index + pool_offsets[1]) for place, index in b.tensors]
    # Rows split into several column blocks: neighbouring programs (grid axis 0 steps
    # first) take neighbouring blocks of one row, as Inductor's flat grid does, unless the
    # row blocks overflow axis 1 (65535). On an H100 (results/diag_row_variants_h100.json,
    # 2026-11-25) SwiGLU on 4096 x 8192 took 68.3 against 71.0 us with rows first (Inductor
    # 68.2 us), tanh GELU on 4096 x 8192 46.6 against 48.5 us (Inductor 47.3 us).
    rows_axis = 0
    if col_blocks > 1 and grid[0] <= MAX_GRID_Y:
        grid, rows_axis = (grid[1], grid[0]), 1
    kernel = _compiled_kernel(program, a.rank, options, layout, pair=b is not None)
    # Debug mode (for the index assert) would also add overflow checks to every 32-bit
    # integer op; the index math that matters is 64-bit, so those are turned off.
    meta = {"BLOCK_R": block_r, "BLOCK_D": block_d, "CHUNKS": chunks, "ROWS_AXIS": rows_axis,
            "num_warps": num_warps, "sanitize_overflow": False}  # fmt: skip
    return _LaunchPlan(kernel, grid, args, tensors, meta, device)


@dataclasses.dataclass
class _Plans:
    """Everything about launching one or two sets of inputs that their shapes, strides and
    dtypes decide: the outputs to allocate per set and the launches (none for sets without
    rows; two for a pair that cannot share one)."""

    outputs: list[tuple[list[tuple[torch.Size, torch.dtype]], torch.device]]
    launches: list[_LaunchPlan]

    def run(
        self,
        sets: Sequence[Sequence[torch.Tensor]],
        out: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Launch on ``sets``; ``out``: the first set's outputs to write into (``_prepare``)."""
        pool: list[torch.Tensor] = []
        results: list[torch.Tensor] = []
        for i, (inputs, (specs, device)) in enumerate(zip(sets, self.outputs)):
            given = out if i == 0 and out is not None else [None] * len(specs)
            outs = [torch.empty(shape, dtype=dtype, device=device) if t is None else t
                    for (shape, dtype), t in zip(specs, given)]  # fmt: skip
            pool += inputs
            pool += outs
            results += outs
        for plan in self.launches:
            args = list(plan.args)
            for place, index in plan.tensors:
                args[place] = pool[index]
            run_on_device(plan.kernel, plan.grid, args, plan.meta, plan.device)
        return tuple(results)


def _make_plans(
    program: RowProgram,
    options: KernelOptions,
    sets: Sequence[Sequence[torch.Tensor]],
    recipes: dict[Any, ShapeRecipe | None] | None = None,
    out: Sequence[Any] | None = None,
) -> _Plans:
    """``out``: as ``_prepare``'s, for the first set (a pair's sets allocate theirs)."""
    launches = [_prepare(program, inputs, recipes, out if i == 0 else None)
                for i, inputs in enumerate(sets)]  # fmt: skip
    devices = [_device(inputs) for inputs in sets]
    offsets, start = [], 0
    for inputs, launch in zip(sets, launches):
        offsets.append(start)
        start += len(inputs) + len(launch.outputs)
    if len(sets) == 2 and _pairable(*launches) and devices[0] == devices[1]:
        plans = [_plan(program, options, *launches, devices[0], (offsets[0], offsets[1]))]
    else:
        plans = [
            _plan(program, options, launch, None, device, (offset, 0))
            for launch, device, offset in zip(launches, devices, offsets)
            if launch.args
        ]
    return _Plans([(launch.outputs, d) for launch, d in zip(launches, devices)], plans)


# A launch's grid, kernel and every argument but the tensors follow from its inputs' shapes,
# strides and dtypes alone. A caller that passes ``plans`` (the backend: one dict per fused
# group) keeps them per such signature, and a call then only allocates the outputs, fills in
# the tensors and launches. Measured on a CPU (the chain of benchmarks/embedding_chain.py,
# no-op kernel, 2026-11-23): an uncaptured call took 95-140 us with the launch built at every
# call and 48 us with it kept (of which Dynamo and the graph cache take most).
# A signature seen for the first time (a new sequence length under dynamic shapes) reuses
# the ``ShapeRecipe`` of its pattern, kept in the same dict under ``_RECIPES``.
_MAX_PLANS = 64  # per group: past it (dynamic shapes), the oldest signature's launch goes
_RECIPES = "shape recipes"  # plans[_RECIPES]: pattern -> ShapeRecipe (or None)


def _device(inputs: Sequence[Any]) -> torch.device:
    return next(t.device for t in inputs if _is_tensor_like(t))


def _launch_sets(
    program: RowProgram,
    options: KernelOptions,
    sets: Sequence[Sequence[torch.Tensor]],
    plans: dict[Any, _Plans] | None,
    out: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:
    for inputs in sets:
        check_indices(program, inputs)
    scalars = program.scalar_inputs
    if scalars:  # numbers of any Python type: the kernel takes floats
        sets = [[float(x) if slot in scalars else x for slot, x in enumerate(inputs)]
                for inputs in sets]  # fmt: skip
    if plans is None:
        return _make_plans(program, options, sets, None, out).run(sets, out)
    # launch_config is read here so that a benchmark's sweep, which swaps it, misses
    if scalars:  # a number's value is no part of the plan: it is filled in like a tensor
        signature = tuple((t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor)
                          else float for inputs in sets for t in inputs)  # fmt: skip
    else:
        signature = tuple((t.shape, t.stride(), t.dtype, t.device) for inputs in sets
                          for t in inputs)  # fmt: skip
    if out is not None:  # where the outputs go is part of the launch
        signature += tuple(None if t is None else (t.shape, t.stride()) for t in out)
    key = (launch_config, signature, tuple(len(inputs) for inputs in sets))
    found = plans.get(key)
    if found is None:
        recipes = plans.setdefault(_RECIPES, {})
        found = _make_plans(program, options, sets, recipes, out)
        if len(plans) >= _MAX_PLANS:
            del plans[next(k for k in plans if k != _RECIPES)]
        if len(recipes) > _MAX_PLANS:
            recipes.clear()
        plans[key] = found
    return found.run(sets, out)


def row_kernel(
    program: RowProgram,
    inputs: Sequence[torch.Tensor],
    *,
    index_checks: bool = True,
    options: KernelOptions | None = None,
    plans: dict[Any, Any] | None = None,
    out: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Run a fused group: gather the lookups, run the program, return the outputs.

    ``inputs`` are the group's external tensors in slot order (indices, tables and
    operands). Outputs are new contiguous tensors, one per ``program.outputs``, except
    where ``out`` (one entry per output) gives a tensor to write an output into, through
    its strides (a view of a concatenation's buffer: passes/concat_writes.py); that tensor
    is then the output returned.
    ``options`` (default: ``KernelOptions(index_checks=index_checks)``) says how the kernel
    is built. ``plans``: a dict owned by the caller, for this program and options only, in
    which launches are kept per input signature (shapes, strides, dtypes, devices).
    """
    if options is None:
        options = KernelOptions(index_checks=index_checks)
    if out is not None and len(out) != len(program.outputs):
        raise ValueError(f"out has {len(out)} entries for {len(program.outputs)} outputs")
    return _launch_sets(program, options, (inputs,), plans, out)


def row_kernel_pair(
    program: RowProgram,
    first: Sequence[torch.Tensor],
    second: Sequence[torch.Tensor],
    options: KernelOptions,
    plans: dict[Any, Any] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Run ``program`` over two sets of inputs in one launch; the outputs of the first set,
    then those of the second. Sets of another rank, width or device than each other, or
    without rows, get a launch each (same results). ``plans``: as for ``row_kernel``."""
    return _launch_sets(program, options, (first, second), plans)


def _pairable(a: _Launch, b: _Launch) -> bool:
    return bool(a.args and b.args) and (a.rank, a.width) == (b.rank, b.width)


def precompile(
    program: RowProgram,
    inputs: Sequence[torch.Tensor],
    options: KernelOptions,
    split: int | None = None,
    out: Sequence[Any] | None = None,
) -> None:
    """Compile the kernel a launch on tensors like ``inputs`` would run, without running it
    (``JITFunction.warmup``), so that a caller can compile several kernels at once (under
    Triton's ``AsyncCompileMode``) instead of one by one at their first launches.

    ``inputs`` need only shapes, strides, offsets and dtypes (Dynamo's fake tensors): the
    warm-up sees each tensor as its dtype at the address of its offset, as if every base
    were 16-byte aligned (fresh allocations are).
    ``split``: the inputs are a pair's, the first ``split`` of them the first set's. A
    group without rows, or a pair that launches twice, is compiled at its launch.
    ``out``: as ``row_kernel``'s (not for a pair).
    """
    meta = [_meta(t) for t in inputs]
    sets = [meta] if split is None else [meta[:split], meta[split:]]
    out_meta = None if out is None else [None if t is None else _meta(t) for t in out]
    launches = [_prepare(program, part, None, out_meta) for part in sets]
    if not launches[0].args or (split is not None and not _pairable(*launches)):
        return  # no rows, or a pair launched twice: compiled at its launches
    plans = _make_plans(program, options, sets, None, out_meta)
    (plan,) = plans.launches
    # Triton specialises pointers on 16-byte alignment: an input that is a view at an offset
    # (x[..., 1:]) is warmed up as the launch will see it (assuming 16-byte aligned bases).
    given = [inputs] if split is None else [inputs[:split], inputs[split:]]
    pool: list[Any] = []
    for part, (specs, _) in zip(given, plans.outputs):
        pool += [warmup_pointer_of(t) if _is_tensor_like(t) else 1.0 for t in part]
        dests = out or [None] * len(specs)
        pool += [warmup_pointer(dtype, 0) if t is None else warmup_pointer_of(t)
                 for (_, dtype), t in zip(specs, dests)]  # fmt: skip
    args = list(plan.args)
    for place, index in plan.tensors:
        args[place] = pool[index]
    device = _device(inputs)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _warmup(plan.kernel, plan.grid, args, plan.meta)


def launch_rank(program: RowProgram, inputs: Sequence[torch.Tensor]) -> int | None:
    """The rank of the kernel that a launch on tensors like ``inputs`` runs (its lead dims
    collapsed, ``_collapse_lead``): symbolic sizes and strides read at their hints (the
    traced call's; Dynamo specialises sizes 1, so the dims that collapse stay those), or
    None where one has no hint."""
    examples = hinted_examples(inputs, device_type=None)
    if examples is None:
        return None
    return _prepare(program, [_meta(t) for t in examples]).rank


def _is_tensor_like(value: Any) -> bool:
    return not isinstance(value, (int, float, torch.SymInt, torch.SymFloat))


def _meta(value: Any) -> Any:
    """A meta tensor shaped like ``value`` (a tensor or a fake one); a number (a scalar
    input) as a float, whose value no compile depends on (Triton types it by annotation)."""
    if not _is_tensor_like(value):
        return 1.0
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
