"""Compile generated kernels once and launch them: the public ``row_kernel`` launcher.

Triton's JIT reads a kernel's source from its file, so each generated module is written
to a per-user cache directory (named by a hash of its source) and imported from there.
Kernels are cached in-process by (RowProgram, rank, KernelOptions, layout): the program
names no graph node, so the same group in every layer of a model compiles once. Triton
caches the binaries per argument specialisation (dtypes, 16-byte alignment, strides equal
to 1).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusebackend.kernels.codegen import generate_pair_source, generate_source
from fusebackend.kernels.configs import (
    MAX_GRID_Y,
    launch_config,
    layout_for,
)
from fusebackend.kernels.ir import InputRef, KernelOptions, Reduce, Rotate, RowProgram, ValueRef

__all__ = [
    "TensorExample",
    "hinted_examples",
    "kernel_source",
    "launch_rank",
    "layout_for",
    "precompile",
    "precompile_all",
    "row_kernel",
    "row_kernel_pair",
    "triton_usable",
    "value_shapes",
]

log = logging.getLogger(__name__)

_KERNELS: dict[tuple[RowProgram, int, KernelOptions, str, bool], Any] = {}
_LOCK = threading.Lock()


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install must not break the unfused path
        log.info("Triton is not importable (%s); fused groups use the torch reference", exc)
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable(device: torch.device) -> bool:
    """Can generated kernels run for tensors on ``device``?"""
    if not _triton_importable():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and not interpreter_enabled()
    return device.type == "cpu" and interpreter_enabled()


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
            _KERNELS[key] = getattr(_import_source(name, source), name)
        return _KERNELS[key]


def _import_source(name: str, source: str) -> Any:
    directory = os.path.join(tempfile.gettempdir(), f"fusebackend-{os.getuid()}")
    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    path = os.path.join(directory, f"{name}_{digest}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as handle:
            handle.write(source)
        os.replace(tmp, path)  # atomic: concurrent processes never see half a file
    module_spec = importlib.util.spec_from_file_location(f"fusebackend_generated.{name}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def value_shapes(
    program: RowProgram, inputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Size], torch.Size]:
    """(shape of every value, the group's shape), from the input shapes (eager broadcasting).

    The group's shape also covers the operands of reductions, whose rows the kernel reads
    although no value of the program has their width.
    """
    shapes: list[torch.Size] = []
    reduced: list[torch.Size] = []
    for lookup in program.lookups:
        index, table = inputs[lookup.index_slot], inputs[lookup.table_slot]
        shapes.append(torch.Size((*index.shape, table.shape[1])))
    for instr in program.instrs:
        operands = (instr.operand,) if isinstance(instr, Reduce | Rotate) else instr.operands
        operand_shapes = []
        for operand in operands:
            if isinstance(operand, ValueRef):
                operand_shapes.append(shapes[operand.index])
            elif isinstance(operand, InputRef):
                operand_shapes.append(_shape(inputs[operand.slot]))
        if isinstance(instr, Reduce):
            (shape,) = operand_shapes
            if not program.operand_is_narrow(instr.operand):
                reduced.append(shape)
            shapes.append(torch.Size((*shape[:-1], 1)))
        elif isinstance(instr, Rotate):
            (shape,) = operand_shapes
            reduced.append(shape)  # its columns move: it must span the whole row
            if not 0 < instr.shift < shape[-1]:
                raise ValueError(f"a rotation by {instr.shift} of rows {shape[-1]} wide")
            shapes.append(shape)
        else:
            shapes.append(broadcast_shapes(*operand_shapes))
    group_shape = broadcast_shapes(*shapes, *reduced)
    for shape in reduced:
        if shape[-1] != group_shape[-1]:
            raise ValueError(
                f"a reduction or rotation reads rows of width {shape[-1]} in a group of width "
                f"{group_shape[-1]} (shape {tuple(group_shape)})"
            )
    return shapes, group_shape


_NO_DIMS = torch.Size(())


def _shape(value: Any) -> torch.Size:
    """A tensor's shape; a number (a scalar input) has none."""
    return value.shape if isinstance(value, torch.Tensor) else _NO_DIMS


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """Eager's broadcasting of concrete shapes, for the per-call path.

    ``torch.broadcast_shapes`` goes through the symbolic-shape reference implementation:
    24.5 us a call for three shapes on a CPU against 1.7 us for this loop, and the launcher
    broadcasts 6 times per call of a two-lookup chain (an uncaptured call of that chain
    with a no-op kernel went from 164 to 87 us).
    """
    rank = max((len(shape) for shape in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        for dim, size in enumerate(shape, rank - len(shape)):
            if size != 1:
                if out[dim] != 1 and out[dim] != size:
                    raise RuntimeError(
                        f"shapes {[tuple(s) for s in shapes]} cannot be broadcast together"
                    )
                out[dim] = size
    return torch.Size(out)


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


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of ``torch.empty(shape)`` (sizes 0 and 1 step as 1, as torch's do)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@dataclasses.dataclass(frozen=True)
class _ShapeRecipe:
    """How a launch's group shape and output shapes follow from its inputs' sizes, for
    inputs of one pattern (``_pattern``: dtypes, ranks, which dims are 1, row widths).

    ``value_shapes`` broadcasts every value of the program (~35 us for BERT's embeddings
    group of 3 lookups and 2 norms on a CPU); under dynamic shapes a new sequence length
    keeps the pattern, so the broadcast is derived once per pattern and a new length only
    reads the sizes: each group dim's from one input dim, with every other non-1 input dim
    checked equal to it (a mismatch takes the full path, which raises eager's error)."""

    group: tuple[tuple[int, int], ...]  # per group dim: (slot, dim) giving its size; (-1, 0): 1
    checks: tuple[tuple[int, int, int], ...]  # (slot, dim, group dim): non-1 sizes to compare
    outputs: tuple[tuple[int, ...], ...]  # per output: the group dim of each dim, -1 for 1

    def shapes(self, inputs: Sequence[Any]) -> tuple[list[torch.Size], torch.Size] | None:
        group = [1 if slot < 0 else inputs[slot].shape[dim] for slot, dim in self.group]
        for slot, dim, j in self.checks:
            if inputs[slot].shape[dim] != group[j]:
                return None
        outputs = [torch.Size([1 if j < 0 else group[j] for j in dims]) for dims in self.outputs]
        return outputs, torch.Size(group)


def _aligned_dims(program: RowProgram, inputs: Sequence[Any], rank: int):
    """(slot, dim, group dim) of every input dim that lines up with a dim of a group of
    ``rank`` dims (an index's dims with the row dims, a table's width with the last)."""
    for slot, t in enumerate(inputs):
        if slot in program.scalar_inputs:
            continue
        if slot in program.table_slots:
            yield slot, 1, rank - 1
        elif slot in program.index_slots:
            yield from ((slot, d, rank - 1 - t.dim() + d) for d in range(t.dim()))
        else:
            yield from ((slot, d, rank - t.dim() + d) for d in range(t.dim()))


def _recipe(
    program: RowProgram,
    inputs: Sequence[Any],
    outputs: Sequence[torch.Size],
    group_shape: torch.Size,
) -> _ShapeRecipe | None:
    rank = len(group_shape)
    group: list[tuple[int, int] | None] = [None if n != 1 else (-1, 0) for n in group_shape]
    checks = []
    for slot, dim, j in _aligned_dims(program, inputs, rank):
        if j < 0 or inputs[slot].shape[dim] == 1:
            continue
        if group[j] is None:
            group[j] = (slot, dim)
        else:
            checks.append((slot, dim, j))
    if any(g is None for g in group):
        return None  # a size no input gives (cannot happen): the full path every time
    maps = []
    for shape in outputs:
        offset = rank - len(shape)
        maps.append(tuple(-1 if n == 1 and group_shape[offset + i] != 1 else offset + i
                          for i, n in enumerate(shape)))  # fmt: skip
    return _ShapeRecipe(tuple(group), tuple(checks), tuple(maps))  # type: ignore[arg-type]


def _pattern(program: RowProgram, inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What a ``_ShapeRecipe`` holds for: per input its dtype, device, which dims are 1 and
    its row width (not an index's last dim: that is a row dim)."""
    key: list[Any] = []
    for slot, t in enumerate(inputs):
        if slot in program.scalar_inputs:
            key.append(None)
            continue
        ones = tuple(n == 1 for n in t.shape)
        width = None if slot in program.index_slots or not ones else t.shape[-1]
        key.append((t.dtype, t.device, ones, width))
    return tuple(key)


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


def _prepare(
    program: RowProgram,
    inputs: Sequence[torch.Tensor],
    recipes: dict[Any, _ShapeRecipe | None] | None = None,
) -> _Launch:
    """The kernel's arguments for tensors shaped like ``inputs`` (shapes, strides and dtypes
    are read; the tensors themselves are filled in by ``_Plans.run``). ``recipes``: a
    caller's ``_ShapeRecipe`` per input pattern, used and filled in."""
    found = None
    if recipes is not None:
        pattern = _pattern(program, inputs)
        recipe = recipes.get(pattern)
        found = recipe.shapes(inputs) if recipe is not None else None
    if found is not None:
        out_shapes, group_shape = found
    else:
        shapes, group_shape = value_shapes(program, inputs)
        out_shapes = [shapes[v] for v in program.outputs]
        if recipes is not None and pattern not in recipes:
            recipes[pattern] = _recipe(program, inputs, out_shapes, group_shape)
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
        else:
            shape = narrow_shape if slot in program.narrow_inputs else group_shape
            *lead_strides, col_stride = _expand_strides(t.shape, t.stride(), shape)
            entries.append((slot, tuple(lead_strides), (col_stride,)))
    for j, (value, (out_shape, _)) in enumerate(zip(program.outputs, outputs)):
        shape = narrow_shape if value in program.narrow_values else group_shape
        # as the output is allocated: contiguous
        strides = _expand_strides(out_shape, _contiguous_strides(out_shape), shape)
        *lead_strides, col_stride = strides
        entries.append((len(inputs) + j, tuple(lead_strides), (col_stride,)))
    unstrided = program.table_slots | program.scalar_inputs
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
    return _Launch(args, tensors, outputs, len(sizes), rows, width)


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


def _run(kernel: Any, grid: tuple[int, int], args: list[Any], meta: dict[str, Any],
         device: torch.device) -> None:  # fmt: skip
    # Entering torch.cuda.device costs a few us per launch: only where it changes anything.
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def _blocks(layout: str, width: int, block_d: int) -> tuple[int, int]:
    """(column blocks of the grid, chunks per row) for ``layout``."""
    col_blocks = (width + block_d - 1) // block_d if layout == "tile" else 1
    chunks = (width + block_d - 1) // block_d if layout == "chunked" else 1
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
    block_r, block_d, num_warps = launch_config(rows, a.width, layout, bool(program.lookups))
    col_blocks, chunks = _blocks(layout, a.width, block_d)
    grid_a = (a.rows + block_r - 1) // block_r
    tensors = [(place, index + pool_offsets[0]) for place, index in a.tensors]
    if b is None:
        grid, args = (grid_a, col_blocks), a.args
    else:
        grid = (grid_a + (b.rows + block_r - 1) // block_r, col_blocks)
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

    def run(self, sets: Sequence[Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        pool: list[torch.Tensor] = []
        results: list[torch.Tensor] = []
        for inputs, (specs, device) in zip(sets, self.outputs):
            outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
            pool += inputs
            pool += outs
            results += outs
        for plan in self.launches:
            args = list(plan.args)
            for place, index in plan.tensors:
                args[place] = pool[index]
            _run(plan.kernel, plan.grid, args, plan.meta, plan.device)
        return tuple(results)


def _make_plans(
    program: RowProgram,
    options: KernelOptions,
    sets: Sequence[Sequence[torch.Tensor]],
    recipes: dict[Any, _ShapeRecipe | None] | None = None,
) -> _Plans:
    launches = [_prepare(program, inputs, recipes) for inputs in sets]
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
# the ``_ShapeRecipe`` of its pattern, kept in the same dict under ``_RECIPES``.
_MAX_PLANS = 64  # per group: past it (dynamic shapes), the oldest signature's launch goes
_RECIPES = "shape recipes"  # plans[_RECIPES]: pattern -> _ShapeRecipe (or None)


def _device(inputs: Sequence[Any]) -> torch.device:
    return next(t.device for t in inputs if _is_tensor_like(t))


def _launch_sets(
    program: RowProgram,
    options: KernelOptions,
    sets: Sequence[Sequence[torch.Tensor]],
    plans: dict[Any, _Plans] | None,
) -> tuple[torch.Tensor, ...]:
    for inputs in sets:
        check_indices(program, inputs)
    scalars = program.scalar_inputs
    if scalars:  # numbers of any Python type: the kernel takes floats
        sets = [[float(x) if slot in scalars else x for slot, x in enumerate(inputs)]
                for inputs in sets]  # fmt: skip
    if plans is None:
        return _make_plans(program, options, sets).run(sets)
    # launch_config is read here so that a benchmark's sweep, which swaps it, misses
    if scalars:  # a number's value is no part of the plan: it is filled in like a tensor
        signature = tuple((t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor)
                          else float for inputs in sets for t in inputs)  # fmt: skip
    else:
        signature = tuple((t.shape, t.stride(), t.dtype, t.device) for inputs in sets
                          for t in inputs)  # fmt: skip
    key = (launch_config, signature, tuple(len(inputs) for inputs in sets))
    found = plans.get(key)
    if found is None:
        recipes = plans.setdefault(_RECIPES, {})
        found = _make_plans(program, options, sets, recipes)
        if len(plans) >= _MAX_PLANS:
            del plans[next(k for k in plans if k != _RECIPES)]
        if len(recipes) > _MAX_PLANS:
            recipes.clear()
        plans[key] = found
    return found.run(sets)


def row_kernel(
    program: RowProgram,
    inputs: Sequence[torch.Tensor],
    *,
    index_checks: bool = True,
    options: KernelOptions | None = None,
    plans: dict[Any, Any] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Run a fused group: gather the lookups, run the program, return the outputs.

    ``inputs`` are the group's external tensors in slot order (indices, tables and
    operands). Outputs are new contiguous tensors, one per ``program.outputs``.
    ``options`` (default: ``KernelOptions(index_checks=index_checks)``) says how the kernel
    is built. ``plans``: a dict owned by the caller, for this program and options only, in
    which launches are kept per input signature (shapes, strides, dtypes, devices).
    """
    if options is None:
        options = KernelOptions(index_checks=index_checks)
    return _launch_sets(program, options, (inputs,), plans)


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


def precompile_all(jobs: Sequence[Callable[[], None]], threads: int | None = None) -> int:
    """Run every job (``functools.partial(precompile, ...)`` or another kernel's warm-up),
    compiling the distinct kernels concurrently (Triton's ``AsyncCompileMode`` over a thread
    pool: the compiler's passes and ptxas run outside the GIL), and loading each compiled
    kernel in the same worker (``_LoadingExecutor``). Returns the number of jobs that failed
    to warm up or to compile; their kernels compile at their first launch, where an error is
    raised and handled as before.

    ``threads``: by default one per CPU core, up to 32. With 8 threads on the H100 machine's
    16 cores, generate()'s 113 launches of a 22-layer Llama took 2.0-2.1 s (2026-11-23).
    """
    if threads is None:
        threads = max(1, min(32, os.cpu_count() or 8))
    try:
        from triton.runtime import _async_compile
    except ImportError:  # an older Triton: compile at first launch, one by one
        return 0
    if _async_compile.active_mode.get() is not None:
        log.info("another AsyncCompileMode is active; kernels compile at their launches")
        return len(jobs)
    failed, mode = 0, None
    try:
        with _LoadingExecutor(max_workers=threads) as pool:
            mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)
            with mode:
                for job in jobs:
                    try:
                        job()
                    except Exception as exc:  # the launch compiles it and raises there
                        failed += 1
                        log.info("precompile failed (%s); it compiles at its launch", exc)
    finally:
        # The mode switches itself off only after waiting on every compile: an interrupt
        # during that wait would leave it on for this thread, and every later Triton
        # compile here (anyone's) would go to the shut-down pool.
        if mode is not None and _async_compile.active_mode.get() is mode:
            _async_compile.active_mode.set(None)
    return failed + sum(1 for f in mode.raw_futures if f.exception() is not None)


class _LoadingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose jobs, Triton's compiles, also load the kernel they compiled.

    A warm-up (``JITFunction.warmup``) compiles a kernel but leaves its loading to the first
    launch: building its C launcher (with gcc where Triton's cache lacks it, ~0.3 s each)
    and loading the binary onto the device, one kernel after another on the caller's
    thread. Done here, they run concurrently with the other compiles: on an H100 with an
    empty Triton cache, the first runs of a TinyLlama decode step's first call took
    0.29-0.42 s against 3.05-3.52 s with the loads at the launches (2026-11-25,
    ``benchmarks/results/first_call_ab_h100.txt``).
    """

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        # Triton loads a kernel onto the current device: the one the warm-up runs under.
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        return super().submit(_compile_and_load, fn, device, *args, **kwargs)


def _compile_and_load(compile_fn: Callable[..., Any], device: int | None, *args: Any,
                      **kwargs: Any) -> Any:  # fmt: skip
    kernel = compile_fn(*args, **kwargs)
    load = getattr(kernel, "_init_handles", None)  # Triton's CompiledKernel (3.6, 3.7)
    if load is not None and device is not None:
        try:
            with torch.cuda.device(device):
                load()
        except Exception as exc:  # noqa: BLE001  (its first launch raises the error)
            log.info("loading a precompiled kernel failed (%s); its launch raises", exc)
            if getattr(kernel, "module", None) is None and hasattr(kernel, "_run"):
                # Triton sets the launcher before it loads the binary: a load that failed
                # would leave a launcher with no function, and the launch would fail with
                # a TypeError instead of the load's error. Unset, the launch loads again.
                kernel._run = None
    return kernel


def warmup_pointer(dtype: torch.dtype, address: int) -> Any:
    """A tensor as ``JITFunction.warmup`` sees it: a dtype and an address. Triton
    specialises pointers on 16-byte alignment, so a view at a byte offset is given that
    offset as its address (bases count as aligned: fresh allocations are)."""
    return _pointer_class()(dtype, address)


def warmup_pointer_of(tensor: torch.Tensor) -> Any:
    """``tensor`` as its launch will show it to Triton: its dtype at its view's byte offset
    (fake tensors suffice)."""
    return warmup_pointer(tensor.dtype, tensor.storage_offset() * tensor.element_size())


@functools.cache
def _pointer_class() -> type:
    from triton.runtime.jit import MockTensor

    class Pointer(MockTensor):
        def __init__(self, dtype: torch.dtype, address: int) -> None:
            super().__init__(dtype)
            self.address = address

        def data_ptr(self) -> int:  # type: ignore[override]
            return self.address

    return Pointer


def _pairable(a: _Launch, b: _Launch) -> bool:
    return bool(a.args and b.args) and (a.rank, a.width) == (b.rank, b.width)


def precompile(
    program: RowProgram,
    inputs: Sequence[torch.Tensor],
    options: KernelOptions,
    split: int | None = None,
) -> None:
    """Compile the kernel a launch on tensors like ``inputs`` would run, without running it
    (``JITFunction.warmup``), so that a caller can compile several kernels at once (under
    Triton's ``AsyncCompileMode``) instead of one by one at their first launches.

    ``inputs`` need only shapes, strides, offsets and dtypes (Dynamo's fake tensors): the
    warm-up sees each tensor as its dtype at the address of its offset, as if every base
    were 16-byte aligned (fresh allocations are).
    ``split``: the inputs are a pair's, the first ``split`` of them the first set's. A
    group without rows, or a pair that launches twice, is compiled at its launch.
    """
    meta = [_meta(t) for t in inputs]
    sets = [meta] if split is None else [meta[:split], meta[split:]]
    launches = [_prepare(program, part) for part in sets]
    if not launches[0].args or (split is not None and not _pairable(*launches)):
        return  # no rows, or a pair launched twice: compiled at its launches
    plans = _make_plans(program, options, sets)
    (plan,) = plans.launches
    # Triton specialises pointers on 16-byte alignment: an input that is a view at an offset
    # (x[..., 1:]) is warmed up as the launch will see it (assuming 16-byte aligned bases).
    given = [inputs] if split is None else [inputs[:split], inputs[split:]]
    pool: list[Any] = []
    for part, (specs, _) in zip(given, plans.outputs):
        pool += [warmup_pointer_of(t) if _is_tensor_like(t) else 1.0 for t in part]
        pool += [warmup_pointer(dtype, 0) for _, dtype in specs]
    args = list(plan.args)
    for place, index in plan.tensors:
        args[place] = pool[index]
    device = _device(inputs)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _warmup(plan.kernel, plan.grid, args, plan.meta)


def _warmup(kernel: Any, grid: tuple[int, int], args: list[Any], meta: dict[str, Any]) -> None:
    kernel.warmup(*args, grid=grid, **meta)


@dataclasses.dataclass(frozen=True)
class TensorExample:
    """What a precompile reads of a tensor (``precompile``, ``launch_rank``): sizes,
    strides, byte offset, dtype and device, with plain ints where a graph's example value
    had symbolic ones (``hinted_examples``). Hashable: it keys a precompile job as is."""

    shape: torch.Size
    strides: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def storage_offset(self) -> int:
        return self.offset

    def element_size(self) -> int:
        return self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)


def _hint(n: Any) -> int | None:
    """A size as an int: a SymInt's hint (the size Dynamo traced with), or None."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def hinted_examples(values: Sequence[Any], device_type: str | None = "cuda") -> list[Any] | None:
    """A fused node's example values (fake tensors, numbers) as ``precompile`` takes them,
    symbolic sizes, strides and offsets replaced by their hints: the sizes of the call that
    Dynamo traced, so the kernel compiled is the one that call launches; later lengths of
    the same launch config share its binary (row counts and sizes are runtime arguments,
    ``codegen._Writer._unspecialized``). Numbers (a norm's eps) become a float: a float
    argument compiles the same whatever its value. None where a size has no hint or a
    tensor is not on a device of ``device_type`` (None: any)."""
    examples: list[Any] = []
    for value in values:
        if not _is_tensor_like(value):
            examples.append(1.0)
            continue
        if not isinstance(value, torch.Tensor):
            return None
        if device_type is not None and value.device.type != device_type:
            return None
        sizes = [_hint(n) for n in (*value.shape, *value.stride(), value.storage_offset())]
        if any(n is None for n in sizes):
            return None
        rank = value.dim()
        shape, strides, offset = sizes[:rank], sizes[rank:-1], sizes[-1]
        examples.append(TensorExample(torch.Size(shape), tuple(strides), offset, value.dtype,
                                      value.device))  # fmt: skip
    return examples


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
