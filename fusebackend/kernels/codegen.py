"""RowProgram -> readable Triton source for one fused row kernel.

Each program instance handles ``BLOCK_R`` rows (the ``lead`` positions of the group's shape
``lead + [D]``, flattened). Three layouts, picked by the launcher (``layout``):

- ``tile``: no reduction. Rows x columns are tiled ``BLOCK_R x BLOCK_D`` (grid over both;
  ``ROWS_AXIS`` says which grid axis steps over the row blocks, the other steps over the
  column blocks).
- ``persistent``: the program reduces along the row and ``D`` fits in registers: one
  column block of ``BLOCK_D = next_power_of_2(D)`` holds whole rows, so every value is
  computed once and a reduction is one ``tl.sum``/``tl.max`` over axis 1 (Liger-Kernel's
  rms_norm layout).
- ``chunked``: wider rows. Each reduction is a loop over the row in ``BLOCK_D`` chunks that
  recomputes the row values it needs from the inputs and accumulates; a last loop computes
  and stores the row outputs (two passes for a norm: reduce, then normalise).

Values are ``[BLOCK_R, BLOCK_D]`` tensors ("row" values) or ``[BLOCK_R, 1]`` ("narrow":
reductions and values of last dim 1), which Triton broadcasts against each other as torch
does. Every tensor is addressed through strides of its view broadcast to the group's shape,
so broadcast operands, non-contiguous indices and ``[1, T]`` position ids against ``[B, T]``
token ids use one code path. Math runs in fp32 (fp64 when any value is fp64); each value is
rounded to its eager dtype (``round_intermediates``) and reductions accumulate in the
compute dtype with masked columns excluded.
"""

from __future__ import annotations

import hashlib

import torch

from fusebackend.kernels.expressions import expression, format_scalar
from fusebackend.kernels.ir import (
    INTEGER_DTYPES,
    Concat,
    Const,
    InputRef,
    Instr,
    KernelOptions,
    Operand,
    Reduce,
    Rotate,
    RowProgram,
    Scan,
    ValueRef,
)
from fusebackend.kernels.signature import TL_DTYPES, parameters, unspecialized

__all__ = ["LAYOUTS", "Scope", "Writer", "check_layout", "generate_source", "kernel_name"]

LAYOUTS = ("tile", "persistent", "chunked")


def kernel_name(program: RowProgram, rank: int, options: KernelOptions, layout: str) -> str:
    digest = hashlib.sha1(repr((program, rank, options, layout)).encode()).hexdigest()[:10]
    kind = "row" if program.has_reduction else "pointwise"
    return f"_{kind}_kernel_{digest}"


def generate_source(
    program: RowProgram, rank: int, options: KernelOptions, layout: str = "tile"
) -> tuple[str, str]:
    """Return (kernel name, Python source of a module defining that Triton kernel).

    ``rank`` is the number of leading (row) dimensions of the group's shape; the
    coordinate arithmetic is unrolled for it. ``options.index_checks`` compiles the
    device-side index assert in (Triton drops ``tl.device_assert`` unless the kernel is
    built in debug mode). ``layout`` is one of ``LAYOUTS`` (see the module docstring).
    """
    check_layout(program, layout)
    return Writer(program, rank, options, layout).write()


def check_layout(program: RowProgram, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "tile" and program.has_reduction:
        raise ValueError("a program with a reduction needs the persistent or chunked layout")


def _whole(operand: object) -> bool:
    """A constant that is a whole number (compared with integers as one)."""
    return isinstance(operand, Const) and float(operand.value).is_integer()


class Scope:
    """Where lines go (indent) and which expressions are already computed there."""

    def __init__(self, indent: int) -> None:
        self.indent = indent
        self.names: dict[object, str] = {}


class Writer:
    """Writes one row program's kernel (``write``; kernels/pair_source.py writes the pair
    kernel from its body); kernels/epilogue.py subclasses it to write a program as a device
    function."""

    def __init__(self, program: RowProgram, rank: int, options: KernelOptions, layout: str):
        self.p, self.rank, self.options, self.layout = program, rank, options, layout
        self.compute = TL_DTYPES[program.compute_dtype]
        self.lines: list[str] = []
        self.outer = Scope(1)
        self.loops = 0

    def emit(self, scope: Scope, line: str) -> None:
        self.lines.append("    " * scope.indent + line)

    def write(self) -> tuple[str, str]:
        name = kernel_name(self.p, self.rank, self.options, self.layout)
        params, docs = parameters(self.p, self.rank, self.layout)
        body = self.body()
        lines = self.header(name, unspecialized(self.p, self.rank), [f"{q},  # {d}" for q, d in
                                                           zip(params, docs)])  # fmt: skip
        lines += ["    pid_r = tl.program_id(ROWS_AXIS)", *body]
        return name, "\n".join(lines) + "\n"

    def header(self, name: str, unspecialized: list[str], params: list[str]) -> list[str]:
        return [
            '"""Generated by fusebackend.kernels.codegen; do not edit."""',
            "import triton",
            "import triton.language as tl",
            "",
            "",
            # Row counts change with every batch size and sequence length; specialising on
            # them (==1, %16) would compile a new binary per size for no gain
            # (signature.unspecialized).
            # Debug mode only where there is an index to assert on: a kernel in debug mode ran
            # 5% slower on the H100 (16x2048x2048 chain: 0.125 vs 0.119 ms).
            f"@triton.jit(debug={self.options.index_checks and self._checks_indices}, "
            f"do_not_specialize={unspecialized!r})",
            f"def {name}(",
            *(f"    {q}" for q in params),
            "):",
        ]

    def body(self) -> list[str]:
        """The kernel's statements, for rows from program ``pid_r`` (set by the caller)."""
        p = self.p
        out = self.outer
        self.emit(out, f'"""{self._math_doc()}"""')
        self.emit(out, "rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)")
        self.emit(out, "row_mask = rows < R")
        if self.layout != "chunked":
            self.emit(out, "pid_c = tl.program_id(1 - ROWS_AXIS)  # column block")
            self.emit(out, "cols = pid_c * BLOCK_D + tl.arange(0, BLOCK_D)")
            self.emit(out, "mask = row_mask[:, None] & (cols < D)[None, :]")
        self._coordinates()
        # row offsets first: loops below must find them computed
        for slot in range(len(p.input_dtypes)):
            if slot not in p.table_slots and slot not in p.scalar_inputs:
                self._row_offset(f"in{slot}")
        for k in range(len(p.outputs)):
            self._row_offset(f"out{k}")
        self._concat_coordinates()
        for j, lookup in enumerate(p.lookups):
            self._index(j, lookup.index_slot, lookup.table_slot)
        row_outputs = [k for k, v in enumerate(p.outputs) if v not in p.narrow_values]
        for k, value in enumerate(p.outputs):
            if value in p.narrow_values:
                self._store(out, k, value)
        if row_outputs:
            scope = self._open_pass([p.outputs[k] for k in row_outputs])
            for k in row_outputs:
                self._store(scope, k, p.outputs[k])
        self._index_asserts()
        return self.lines

    # -- documentation ---------------------------------------------------------------------
    def _math_doc(self) -> str:
        p = self.p
        parts = [
            f"v{j} = table{lk.table_slot}[indices{lk.index_slot}]" for j, lk in enumerate(p.lookups)
        ]
        for i, instr in enumerate(p.instrs):
            index = len(p.lookups) + i
            desc = instr.describe(self._describe)
            parts.append(f"v{index} = {desc} -> {str(instr.dtype).replace('torch.', '')}")
        outs = ", ".join(f"v{v}" for v in p.outputs)
        layout = f"layout: {self.layout}"
        return "\n    " + "\n    ".join(parts) + f"\n    outputs: {outs}\n    {layout}\n    "

    @staticmethod
    def _describe(operand: object) -> str:
        if isinstance(operand, ValueRef):
            return f"v{operand.index}"
        if isinstance(operand, InputRef):
            return f"in{operand.slot}"
        if isinstance(operand, Const):
            return operand.literal
        return "None"

    # -- addressing ------------------------------------------------------------------------
    def _coordinates(self) -> None:
        out = self.outer
        if self.rank == 0:
            return
        if self.rank == 1:
            self.emit(out, "c0 = rows")
            return
        # Divide in R's width: Triton passes R as int32 below 2**31 (as Inductor indexes), where
        # a 64-bit division is a ~70-instruction routine per row; the coordinates then widen
        # for the offsets, which can pass 2**31.
        self.emit(out, "rem = rows.to(R.dtype)")
        for d in reversed(range(1, self.rank)):
            self.emit(out, f"c{d} = (rem % size{d}).to(tl.int64)")
            self.emit(out, f"rem = rem // size{d}")
        self.emit(out, "c0 = rem.to(tl.int64)")

    def _row_offset(self, prefix: str) -> str:
        """Name of the [BLOCK_R] vector of row offsets of tensor ``prefix`` (outer scope)."""
        key = ("row_offset", prefix)
        if key not in self.outer.names:
            name = f"ro_{prefix}"
            placing = {f"out{k}": slot for k, slot in self.p.placed_outputs}.get(prefix)
            if placing is not None:  # the row's place: a row number read per row
                row = f"in{placing}_ptr + {self._row_offset(f'in{placing}')}"
                self.emit(self.outer, f"{name} = tl.load({row}, mask=row_mask, other=0)"
                                      f".to(tl.int64) * {prefix}_s0")  # fmt: skip
            else:
                terms = [f"c{d} * {prefix}_s{d}" for d in range(self.rank)]
                self.emit(self.outer, f"{name} = {' + '.join(terms) if terms else 'rows * 0'}")
            self.outer.names[key] = name
        return self.outer.names[key]

    def _offset(self, prefix: str) -> str:
        return f"{self._row_offset(prefix)}[:, None] + cols[None, :] * {prefix}_sc"

    def _concat_coordinates(self) -> None:
        """Each row's index along each row concatenation's dim, from the row number and the
        group's own sizes (the launcher's merged row dims need not keep that dim apart)."""
        for i in self.p.row_concats:
            self.emit(self.outer, f"cc{i} = ((rows.to(R.dtype) // cat{i}_inner) % cat{i}_n)"
                                  ".to(tl.int64)")  # fmt: skip

    # -- lookups ---------------------------------------------------------------------------
    def _index(self, j: int, index_slot: int, table_slot: int) -> None:
        idx, tab, out = f"in{index_slot}", f"in{table_slot}", self.outer
        self.emit(out, f"# lookup v{j}: rows of table {tab} picked by indices {idx}")
        self.emit(
            out,
            f"idx{j} = tl.load({idx}_ptr + {self._row_offset(idx)}, mask=row_mask, other=0)"
            ".to(tl.int64)",
        )
        self.emit(out, f"ok{j} = (idx{j} >= 0) & (idx{j} < {tab}_rows)")

    def _gather(self, scope: Scope, j: int) -> str:
        lookup = self.p.lookups[j]
        tab = f"in{lookup.table_slot}"
        self.emit(scope, "# a bad index is never read (reads 0); the assert is at the end")
        if j in self.p.narrow_values:
            self.emit(
                scope,
                f"v{j} = tl.load({tab}_ptr + idx{j}[:, None] * {tab}_s0, "
                f"mask=row_mask[:, None] & ok{j}[:, None], other=0.0).to({self.compute})",
            )
        else:
            self.emit(
                scope,
                f"v{j} = tl.load({tab}_ptr + idx{j}[:, None] * {tab}_s0 + cols[None, :] * "
                f"{tab}_s1, mask=mask & ok{j}[:, None], other=0.0).to({self.compute})",
            )
        return f"v{j}"

    def _index_asserts(self) -> None:
        # Last, after the stores. Triton follows a tensor assert with a barrier of the whole
        # program; with launch.py's configs an assert here cost nothing measurable on the
        # H200 (16x2048x2048 chain: 0.1095 ms vs 0.1101 ms without checks), one placed right
        # after the gather 1-6% (benchmarks/results/launch_config_h200.json). A fired assert
        # loses the CUDA context, so the stores before it do not matter; the masked gather
        # has already kept every read inside the table.
        for j, lookup in enumerate(self.p.lookups):
            if lookup.checked:
                message = '"embedding index out of range"'
                self.emit(self.outer, f"tl.device_assert(ok{j} | ~row_mask, {message})")

    @property
    def _checks_indices(self) -> bool:
        return any(lookup.checked for lookup in self.p.lookups)

    # -- values ----------------------------------------------------------------------------
    def _scope_for(self, scope: Scope, narrow: bool) -> Scope:
        return self.outer if narrow else scope

    def _operand(self, scope: Scope, operand: Operand) -> str | None:
        if operand is None:
            return None
        if isinstance(operand, Const):
            return operand.literal
        if isinstance(operand, ValueRef):
            return self._value(scope, operand.index)
        return self._load(scope, operand.slot)

    def _load(self, scope: Scope, slot: int) -> str:
        if slot in self.p.scalar_inputs:
            return f"in{slot}"  # a scalar argument, already of its type
        narrow = slot in self.p.narrow_inputs
        scope = self._scope_for(scope, narrow)
        key = ("load", slot)
        if key in scope.names:
            return scope.names[key]
        dtype = self.p.input_dtypes[slot]
        prefix = f"in{slot}"
        if narrow:
            load = (f"tl.load({prefix}_ptr + {self._row_offset(prefix)}[:, None], "
                    "mask=row_mask[:, None], other=0)")  # fmt: skip
        else:
            load = f"tl.load({prefix}_ptr + {self._offset(prefix)}, mask=mask, other=0)"
        cast = "" if dtype == torch.bool else f".to({self._math_type(dtype)})"
        self.emit(scope, f"x{slot} = {load}{cast}")
        scope.names[key] = f"x{slot}"
        return f"x{slot}"

    def _value(self, scope: Scope, index: int) -> str:
        narrow = index in self.p.narrow_values
        scope = self._scope_for(scope, narrow)
        key = ("value", index)
        if key in scope.names:
            return scope.names[key]
        if index < len(self.p.lookups):
            name = self._gather(scope, index)
        else:
            instr = self.p.instrs[index - len(self.p.lookups)]
            if isinstance(instr, Reduce):
                name = self._reduce(index, instr)
            elif isinstance(instr, Rotate):
                name = self._rotate(scope, index, instr)
            elif isinstance(instr, Concat):
                name = self._concat(scope, index, instr)
            elif isinstance(instr, Scan):
                name = self._scan(scope, index, instr)
            else:
                name = self._instr(scope, index, instr)
        scope.names[key] = name
        return name

    def _math_type(self, dtype: torch.dtype) -> str:
        """The type a value of ``dtype`` is computed in: int64 for integers (exact, and
        wrapped to their own width by ``_round``), else the compute dtype."""
        return "tl.int64" if dtype in INTEGER_DTYPES else self.compute

    def _round(self, scope: Scope, index: int, dtype: torch.dtype) -> None:
        rounds = self.options.round_intermediates or index in self.p.outputs
        math = self._math_type(dtype)
        if dtype in INTEGER_DTYPES:  # integers always wrap to their width, as eager's do
            rounds = dtype != torch.int64
        if rounds and TL_DTYPES[dtype] != math:  # as eager does after each op
            self.emit(scope, f"v{index} = v{index}.to({TL_DTYPES[dtype]}).to({math})")

    def _instr(self, scope: Scope, index: int, instr: Instr) -> str:
        dtypes = [self._operand_dtype(op) for op in instr.operands]
        # Integer math (exact, int64) for integer results and for comparisons of integer
        # tensors with whole numbers; other ops see integer operands converted, as eager
        # promotes them. A where's condition stays a bool.
        integral = instr.dtype in INTEGER_DTYPES or (
            instr.dtype == torch.bool
            and any(d in INTEGER_DTYPES for d in dtypes)
            and all(d is not None or op is None or _whole(op) for d, op in
                    zip(dtypes, instr.operands))
        )  # fmt: skip
        exprs = []
        for k, (op, dtype) in enumerate(zip(instr.operands, dtypes)):
            text = self._operand(scope, op)
            if integral and isinstance(op, Const):
                text = str(int(op.value))
            elif integral and dtype == torch.bool and not (instr.name == "where" and k == 0):
                text = f"{text}.to(tl.int64)"
            elif not integral and (
                dtype in INTEGER_DTYPES
                or dtype == torch.bool
                and instr.dtype.is_floating_point
                and instr.name != "where"
            ):
                text = f"{text}.to({self.compute})"
            exprs.append(text)
        expr = expression(instr.name, exprs, instr.param_dict)
        if instr.dtype == torch.bool:
            if instr.name == "cast" and self._operand_dtype(instr.operands[0]) != torch.bool:
                expr = f"({expr} != 0)"
            self.emit(scope, f"v{index} = {expr}  # {instr.name}")
            return f"v{index}"
        math = self._math_type(instr.dtype)
        self.emit(scope, f"v{index} = ({expr}).to({math})  # {instr.name}")
        self._round(scope, index, instr.dtype)
        return f"v{index}"

    def _scan(self, scope: Scope, index: int, scan: Scan) -> str:
        """``tl.cumsum`` along the row (columns past its end come last: no sum of the row
        reads them); chunked, plus the running sum of the chunks before (``carry``, set to
        0 before the loop: ``_open_pass``)."""
        math = self._math_type(scan.dtype)
        x = self._operand(scope, scan.operand)
        if self.p.operand_is_narrow(scan.operand):
            self.emit(scope, f"v{index} = {x}.to({math})  # cumsum over a width-1 operand")
        else:
            carry = f" + carry{index}_{self.loops}" if self.layout == "chunked" else ""
            self.emit(scope, f"s{index} = {x}.to({math})")
            self.emit(scope, f"v{index} = tl.cumsum(s{index}, axis=1){carry}  # cumsum")
            if carry:
                self.emit(scope, f"carry{index}_{self.loops} += tl.sum(s{index}, axis=1, "
                                 "keep_dims=True)")  # fmt: skip
        self._round(scope, index, scan.dtype)
        return f"v{index}"

    def _rotate(self, scope: Scope, index: int, rot: Rotate) -> str:
        """Load the operand at rotated columns: column j reads j + shift, wrapping past D.

        Two masked loads, each at its columns plus a constant (shift, or shift - D): their
        addresses stay contiguous, so Triton can vectorise them, where one load at columns
        picked by ``tl.where`` could not be proven contiguous (element by element loads).
        """
        width = str(rot.width) if rot.width else "D"  # the columns rotated; 0 after them
        prefix, split = f"in{rot.operand.slot}", f"({width} - {rot.shift})"
        first, second = f"first{index}", f"~first{index}"
        if rot.interleaved:  # each pair swapped: even columns read the next, odd the previous
            split = "1"
            self.emit(scope, f"{first} = (cols % 2 == 0)[None, :]  # even columns")
        else:
            self.emit(scope, f"{first} = (cols < {split})[None, :]  # columns of the first part")
        if rot.width:
            inside = f"inside{index}"
            self.emit(scope, f"{inside} = (cols < {width})[None, :]  # the rotated columns")
            first, second = f"({first} & {inside})", f"(~first{index} & {inside})"
        row = f"{prefix}_ptr + {self._row_offset(prefix)}[:, None]"
        parts = []
        for name, cols, keep in (("hi", f"cols + {rot.shift}", first),
                                 ("lo", f"cols - {split}", second)):  # fmt: skip
            parts.append(f"{name}{index}")
            self.emit(
                scope,
                f"{name}{index} = tl.load({row} + ({cols})[None, :] * {prefix}_sc, "
                f"mask=mask & {keep}, other=0).to({self.compute})",
            )
        a, b = (format_scalar(float(s)) for s in rot.signs)
        hi, lo = parts  # (each 0 where its mask is off: past the width, both)
        self.emit(scope, f"v{index} = tl.where({first}, {a} * {hi}, {b} * {lo})  # rotate")
        self._round(scope, index, rot.dtype)
        return f"v{index}"

    def _concat(self, scope: Scope, index: int, cat: Concat) -> str:
        """Each part loaded under the mask of its range of the dim, at the index less its
        offset (a row dim: the row offset less offset x the part's stride along it; the
        columns: like a rotation's loads, contiguous columns plus a constant)."""
        i = index - len(self.p.lookups)
        column = cat.dim == -1
        coord, spread = ("cols", "[None, :]") if column else (f"cc{i}", "[:, None]")
        loads, masks = [], []
        for k, (part, lo, size) in enumerate(zip(cat.operands, cat.offsets, cat.sizes)):
            prefix, last = f"in{part.slot}", k == len(cat.sizes) - 1
            conds = ([f"({coord} >= {lo})"] if k else []) + (
                [] if last else [f"({coord} < {lo + size})"]
            )
            masks.append(f"m{index}_{k}")
            self.emit(scope, f"m{index}_{k} = ({' & '.join(conds)}){spread}  # part {k}")
            row = self._row_offset(prefix)
            if column:
                address = f"{prefix}_ptr + {row}[:, None] + (cols - {lo})[None, :] * {prefix}_sc"
            else:
                address = (f"{prefix}_ptr + ({row} - {lo} * {prefix}_cs)[:, None] + "
                           f"cols[None, :] * {prefix}_sc")  # fmt: skip
            loads.append(f"p{index}_{k}")
            self.emit(scope, f"p{index}_{k} = tl.load({address}, mask=mask & m{index}_{k}, "
                             f"other=0).to({self.compute})")  # fmt: skip
        value = loads[-1]
        for load, mask in zip(reversed(loads[:-1]), reversed(masks[:-1])):
            value = f"tl.where({mask}, {load}, {value})"
        self.emit(scope, f"v{index} = {value}  # cat")
        self._round(scope, index, cat.dtype)
        return f"v{index}"

    def _operand_dtype(self, operand: Operand) -> torch.dtype | None:
        if isinstance(operand, ValueRef):
            return self.p.value_dtype(operand.index)
        if isinstance(operand, InputRef):
            return self.p.input_dtypes[operand.slot]
        return None

    # -- reductions ------------------------------------------------------------------------
    def _reduce(self, index: int, red: Reduce) -> str:
        """Emit reduction ``index`` in the outer scope (its loop first when chunked)."""
        out, c = self.outer, self.compute
        narrow_operand = self.p.operand_is_narrow(red.operand)
        if narrow_operand:  # a reduction over one element is that element
            x = self._operand(out, red.operand)
            self.emit(out, f"acc{index} = {x}  # {red.kind} over a width-1 operand")
            count = "1.0"
        else:
            count = "D"
            init = {"sum": "0.0", "mean": "0.0", "max": 'float("-inf")', "min": 'float("inf")'}
            if self.layout == "chunked":
                self.emit(out, f"acc{index} = tl.full([BLOCK_R, 1], {init[red.kind]}, {c})")
                if red.kind in ("max", "min"):
                    self.emit(out, f"nan{index} = tl.zeros([BLOCK_R, 1], {c})")
                scope = self._open_pass([red.operand])
            else:
                scope = out
            x = self._operand(scope, red.operand)
            masked = f"tl.where(mask, {x}, {init[red.kind]})"
            if red.kind in ("sum", "mean"):
                part = f"tl.sum({masked}, axis=1, keep_dims=True)"
            else:
                part = f"tl.{red.kind}({masked}, axis=1, keep_dims=True)"
            if self.layout == "chunked":
                if red.kind in ("sum", "mean"):
                    self.emit(scope, f"acc{index} += {part}")
                else:
                    self.emit(scope, f"acc{index} = tl.{red.kind}imum(acc{index}, {part})")
            else:
                self.emit(out, f"acc{index} = {part}")
            if red.kind in ("max", "min"):  # tl.max/min skip NaN; torch.amax/amin return it
                nans = f"tl.sum(tl.where(mask & ({x} != {x}), 1.0, 0.0), axis=1, keep_dims=True)"
                if self.layout == "chunked":
                    self.emit(scope, f"nan{index} += {nans}")
                else:
                    self.emit(out, f"nan{index} = {nans}")
                self.emit(out, f'acc{index} = tl.where(nan{index} > 0, float("nan"), acc{index})')
        if red.kind == "mean":
            corr = f" - {float(red.correction)!r}" if red.correction else ""
            self.emit(out, f"v{index} = (acc{index} / ({count}{corr})).to({c})  # mean")
        else:
            self.emit(out, f"v{index} = acc{index}.to({c})  # {red.kind}")
        self._round(out, index, red.dtype)
        return f"v{index}"

    def _open_pass(self, needs: list[Operand] | list[int]) -> Scope:
        """The scope that computes row values: the outer one, or a new loop over chunks.

        In the chunked layout every narrow value the loop needs is emitted first (outside
        it: a reduction's own loop must close before this one opens).
        """
        if self.layout != "chunked":
            return self.outer
        for need in needs:
            self._narrow_deps(need if not isinstance(need, int) else ValueRef(need), set())
        self.loops += 1
        for scan in sorted(self._row_scans(needs)):
            math = self._math_type(self.p.value_dtype(scan))
            self.emit(self.outer, f"carry{scan}_{self.loops} = tl.zeros([BLOCK_R, 1], {math})")
        # A constexpr trip count: Triton 3.6's interpreter cannot loop to a runtime bound
        # (int() of its 1-element scalar array raises under numpy 2), and D is fixed per
        # graph anyway.
        self.emit(self.outer, "for chunk in range(0, CHUNKS):")
        scope = Scope(2)
        self.emit(scope, "cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)")
        self.emit(scope, "mask = row_mask[:, None] & (cols < D)[None, :]")
        return scope

    def _row_scans(self, needs: list[Operand] | list[int]) -> set[int]:
        """The scans a pass computes for ``needs`` (row values, not narrow ones)."""
        found: set[int] = set()
        seen: set[int] = set()  # each value walked once (shared operands form a DAG)
        stack = [n if not isinstance(n, int) else ValueRef(n) for n in needs]
        while stack:
            op = stack.pop()
            if not isinstance(op, ValueRef) or op.index in self.p.narrow_values:
                continue
            if op.index < len(self.p.lookups) or op.index in seen:
                continue
            seen.add(op.index)
            instr = self.p.instrs[op.index - len(self.p.lookups)]
            if isinstance(instr, Scan):
                found.add(op.index)
            stack.extend(instr.operands)
        return found

    def _narrow_deps(self, operand: Operand, seen: set[int]) -> None:
        """Emit (outside any loop) every narrow value that row value ``operand`` reads."""
        if isinstance(operand, InputRef) and operand.slot in self.p.narrow_inputs:
            self._load(self.outer, operand.slot)
            return
        if not isinstance(operand, ValueRef) or operand.index in seen:
            return
        seen.add(operand.index)
        if operand.index in self.p.narrow_values:
            self._value(self.outer, operand.index)
            return
        if operand.index < len(self.p.lookups):
            return
        instr = self.p.instrs[operand.index - len(self.p.lookups)]
        if isinstance(instr, Rotate | Concat):
            return  # reads row inputs, no narrow value
        for op in instr.operands:
            self._narrow_deps(op, seen)

    # -- outputs ---------------------------------------------------------------------------
    def _store(self, scope: Scope, k: int, value: int) -> None:
        v = self._value(scope, value)
        dtype = TL_DTYPES[self.p.value_dtype(value)]
        prefix = f"out{k}"
        if value in self.p.narrow_values:
            # narrow: one value per row, written by the first column block only
            first = " & (pid_c == 0)" if self.layout == "tile" else ""
            self.emit(scope, f"tl.store({prefix}_ptr + {self._row_offset(prefix)}[:, None], "
                             f"{v}.to({dtype}), mask=row_mask[:, None]{first})")  # fmt: skip
        else:
            self.emit(scope, f"tl.store({prefix}_ptr + {self._offset(prefix)}, {v}.to({dtype}), "
                             "mask=mask)")  # fmt: skip
