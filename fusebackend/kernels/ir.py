"""The row program: a plain, hashable description of one fused group (the kernel IR).

A row program computes values of shape ``lead + [D]`` ("row" values) or ``lead + [1]``
("narrow" values: row reductions with keepdim, operands whose last dim is 1) for every row
of ``lead``. It names no FX node: inputs are numbered slots, values are numbered in program
order, ops carry canonical names and hashable params. So the same group in two layers of a
model is the same program and compiles to one kernel (the program is the compiled-kernel
cache key, with the rank and the build options).

Values: the first ``len(lookups)`` values are the gathered table rows, one per lookup;
instruction ``i`` defines value ``len(lookups) + i``. Instructions are elementwise
(``Instr``: an op of the table in ``passes/ops.py``, written by ``kernels/expressions.py``)
reductions along the last dim (``Reduce``), prefix sums along it (``Scan``), column
rotations of an external operand (``Rotate``: rotary embeddings' ``rotate_half``) or
concatenations of external operands (``Concat``: ``torch.cat``). Each value is rounded to
its ``dtype`` as eager rounds it (all math runs in fp32, fp64 when any value is fp64;
integer values in int64: passes/integers.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "Concat",
    "Const",
    "INTEGER_DTYPES",
    "InputRef",
    "Instr",
    "GATES",
    "KernelOptions",
    "Lookup",
    "ACTIVATIONS",
    "MAX_ROWS",
    "MAX_SIBLINGS",
    "MatmulGroup",
    "NORMS",
    "Reduce",
    "Rotate",
    "RowProgram",
    "Scan",
    "ValueRef",
    "accumulate_dtype",
    "broadcast_shapes",
    "format_scalar",
]


# Integer dtypes a row program computes exactly, in int64 (passes/integers.py says which ops)
INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def format_scalar(value: Any) -> str:
    """A Python number as a Triton literal (fp32 math; non-finite values spelled out)."""
    value = float(value)
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(value)


@dataclasses.dataclass(frozen=True)
class InputRef:
    """An external tensor read elementwise (broadcast to the group's shape by strides)."""

    slot: int


@dataclasses.dataclass(frozen=True)
class ValueRef:
    """A value computed inside the kernel."""

    index: int


@dataclasses.dataclass(frozen=True)
class Const:
    """A Python number, already written as a Triton literal (``Const.of(0.5)``)."""

    literal: str

    @classmethod
    def of(cls, value: Any) -> Const:
        return cls(format_scalar(value))

    @property
    def value(self) -> float:
        """The number the literal spells (``format_scalar`` read back)."""
        text = self.literal  # a float's repr, or float("nan"), float("inf"), float("-inf")
        if text.startswith('float("'):
            return float(text[len('float("') : -len('")')])
        return float(text)


Operand = InputRef | ValueRef | Const | None  # None: an optional operand left out (clamp)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """``table[indices]``: rows of a 2-D table gathered by an integer index tensor.

    ``checked``: the indices come from the model (token ids), so an out-of-range one trips
    the kernel's assert (``KernelOptions.index_checks``); False for indices the backend
    built and checked itself (the row order of a copy folded into a group:
    passes/folded_copies.py), which need neither the assert nor the debug build."""

    index_slot: int
    table_slot: int
    checked: bool = True


@dataclasses.dataclass(frozen=True)
class Instr:
    """``value = op(*operands, **params)``, elementwise, rounded to ``dtype``."""

    name: str  # canonical op name (passes/ops.py); kernels/expressions.py writes it
    operands: tuple[Operand, ...]
    dtype: torch.dtype
    params: tuple[tuple[str, Any], ...] = ()  # sorted (name, value) pairs, hashable

    spans_row = False  # reads its operands elementwise (ShapeRecipe, value_shapes)

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)

    def shape(self, operand_shapes: Sequence[torch.Size]) -> torch.Size:
        """The value's shape: its operands' broadcast (constants have none)."""
        return broadcast_shapes(*operand_shapes)

    def is_narrow(self, narrow: Callable[[Operand], bool]) -> bool:
        """Is the value of width 1 (every operand is)?"""
        return all(narrow(op) for op in self.operands)

    def describe(self, name: Callable[[Operand], str]) -> str:
        """The value's math, as the kernel's docstring lists it."""
        args = ", ".join(name(op) for op in self.operands)
        extra = "".join(f", {k}={v!r}" for k, v in self.params)
        return f"{self.name}({args}{extra})"


@dataclasses.dataclass(frozen=True)
class Reduce:
    """A reduction of ``operand`` along the last dim, keepdim: a narrow value.

    ``mean`` divides the sum by ``N - correction`` (N: the operand's last dim), so
    ``var(x, correction=c)`` is ``mean((x - mean(x))**2, correction=c)``. The sum
    accumulates in fp32 (fp64 for fp64 programs); masked columns never contribute.
    """

    kind: str  # "sum", "mean", "max" or "min"
    operand: InputRef | ValueRef
    dtype: torch.dtype
    correction: float = 0.0

    spans_row = True  # reads whole rows of its operand (unless that is narrow)

    @property
    def operands(self) -> tuple[InputRef | ValueRef]:
        return (self.operand,)

    def shape(self, operand_shapes: Sequence[torch.Size]) -> torch.Size:
        (shape,) = operand_shapes
        return torch.Size((*shape[:-1], 1))

    def is_narrow(self, narrow: Callable[[Operand], bool]) -> bool:
        return True  # keepdim: one value per row

    def describe(self, name: Callable[[Operand], str]) -> str:
        corr = f", correction={self.correction:g}" if self.correction else ""
        return f"{self.kind}({name(self.operand)}, dim=-1{corr})"


@dataclasses.dataclass(frozen=True)
class Scan:
    """An inclusive prefix sum of ``operand`` along the last dim (``cumsum``): a row value.

    Integer scans add in int64 (exact); floating ones accumulate in fp32 (fp64 for fp64
    programs) and round each sum to ``dtype``, as eager's cumsum does. A chunked kernel
    carries each row's running sum from chunk to chunk."""

    operand: InputRef | ValueRef
    dtype: torch.dtype

    spans_row = True  # reads whole rows of its operand (unless that is narrow)

    @property
    def operands(self) -> tuple[InputRef | ValueRef]:
        return (self.operand,)

    def shape(self, operand_shapes: Sequence[torch.Size]) -> torch.Size:
        (shape,) = operand_shapes
        return shape

    def is_narrow(self, narrow: Callable[[Operand], bool]) -> bool:
        return narrow(self.operand)  # a prefix sum over one element is that element

    def describe(self, name: Callable[[Operand], str]) -> str:
        return f"cumsum({name(self.operand)}, dim=-1)"


@dataclasses.dataclass(frozen=True)
class Rotate:
    """A column rotation of an external operand, with a sign per part (a row value).

    ``value[..., j] = signs[0] * x[..., j + shift]`` for ``j < D - shift``, else
    ``signs[1] * x[..., j - (D - shift)]``: ``cat((-x[..., s:], x[..., :s]), -1)``, the
    ``rotate_half`` of rotary embeddings (shift ``D // 2``, signs ``(-1, 1)``). The kernel
    loads ``x`` at permuted column offsets, so only an input can be rotated: a value
    computed in the kernel sits in other threads' registers at the permuted columns.
    ``interleaved``: each pair of columns swapped instead (GPT-J's ``rotate_every_two``):
    ``value[..., 2i] = signs[0] * x[..., 2i + 1]``, ``value[..., 2i + 1] = signs[1] *
    x[..., 2i]`` (shift 1). ``width`` > 0: the first ``width`` columns are rotated as a row
    of their own (``D`` read as ``width``) and the others are 0 (a partial rotary
    embedding's pass-through columns, passes/partial_rotary.py).
    """

    operand: InputRef
    shift: int
    signs: tuple[int, int]
    dtype: torch.dtype
    interleaved: bool = False
    width: int = 0

    spans_row = True  # its columns move: the operand must span the whole row

    @property
    def operands(self) -> tuple[InputRef]:
        return (self.operand,)

    def shape(self, operand_shapes: Sequence[torch.Size]) -> torch.Size:
        (shape,) = operand_shapes
        rotated = self.width or shape[-1]
        if self.width and not self.width < shape[-1]:
            raise ValueError(f"the first {self.width} columns of rows {shape[-1]} wide rotated")
        if self.interleaved and rotated % 2:
            raise ValueError(f"pairs of columns swapped in rows {rotated} wide")
        if not 0 < self.shift < rotated:
            raise ValueError(f"a rotation by {self.shift} of rows {rotated} wide")
        return shape

    def is_narrow(self, narrow: Callable[[Operand], bool]) -> bool:
        return False  # a rotation needs a row of width > 1

    def describe(self, name: Callable[[Operand], str]) -> str:
        a, b = self.signs
        width = f", width={self.width}" if self.width else ""
        if self.interleaved:
            return f"swap_pairs({name(self.operand)}, signs=({a}, {b}){width})"
        return f"rotate({name(self.operand)}, shift={self.shift}, signs=({a}, {b}){width})"


@dataclasses.dataclass(frozen=True)
class Concat:
    """``torch.cat(operands, dim)`` of external operands, read where they lie (a value).

    ``dim`` counts from the end of the value's shape (-1: the row's columns, else a row
    dim). Part ``k`` holds the ``sizes[k]`` indices from ``sum(sizes[:k])`` along it: the
    kernel loads each part under the mask of its range, at the index less its offset. The
    sizes are constants of the program (static shapes only). Only inputs can be parts: a
    value computed in the kernel is not at an address the kernel can offset.
    """

    operands: tuple[InputRef, ...]
    dim: int
    sizes: tuple[int, ...]
    dtype: torch.dtype

    spans_row = False  # each part is read over the group's shape (its own range of ``dim``)

    def __post_init__(self) -> None:
        if self.dim >= 0 or len(self.operands) != len(self.sizes) or len(self.sizes) < 2:
            raise ValueError(f"Concat: a negative dim and one size per part, not {self}")

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each part starts along ``dim``."""
        return tuple(sum(self.sizes[:k]) for k in range(len(self.sizes)))

    def shape(self, operand_shapes: Sequence[torch.Size]) -> torch.Size:
        first = list(operand_shapes[0])
        dim = len(first) + self.dim
        for k, shape in enumerate(operand_shapes):
            if (
                len(shape) != len(first)
                or shape[dim] != self.sizes[k]
                or any(a != b for d, (a, b) in enumerate(zip(shape, first)) if d != dim)
            ):
                raise ValueError(
                    f"a concatenation along dim {self.dim} of sizes {self.sizes} given parts "
                    f"of shapes {[tuple(s) for s in operand_shapes]}"
                )
        first[dim] = sum(self.sizes)
        return torch.Size(first)

    def is_narrow(self, narrow: Callable[[Operand], bool]) -> bool:
        return False  # the partition refuses concatenations into rows of width 1

    def describe(self, name: Callable[[Operand], str]) -> str:
        parts = ", ".join(name(op) for op in self.operands)
        return f"concat([{parts}], dim={self.dim}, sizes={self.sizes})"


@dataclasses.dataclass(frozen=True)
class RowProgram:
    """Everything the generator needs; input tensors arrive in ``input_dtypes`` order.

    ``narrow_inputs``: slots whose last dim is 1 (a table of width 1, an operand of shape
    ``[..., 1]`` or 0-d). They are read once per row, not broadcast along the row, so a
    reduction over them reduces one element, as eager does.

    ``scalar_inputs``: slots that are Python numbers at run time, not tensors (a norm's
    ``eps`` that Dynamo passes into the graph as an input under dynamic shapes). The kernel
    takes each as a scalar argument (fp32; fp64 in fp64 programs), read at every call, so
    the program holds no value of it. Their ``input_dtypes`` entry is that type.

    ``placed_outputs``: (output, slot) pairs: that output's rows are stored at the row
    numbers the integer tensor in ``slot`` gives (one per row, like a lookup's indices),
    into the 2-d tensor given to write it into (a copy in another row order folded into
    the group: passes/gathered_rows.py).
    """

    input_dtypes: tuple[torch.dtype, ...]
    lookups: tuple[Lookup, ...]
    instrs: tuple[Instr | Reduce | Scan | Rotate | Concat, ...]
    outputs: tuple[int, ...]  # value indices written out, in the order returned
    narrow_inputs: frozenset[int] = frozenset()
    scalar_inputs: frozenset[int] = frozenset()
    placed_outputs: tuple[tuple[int, int], ...] = ()

    def __hash__(self) -> int:
        # Computed once: a program keys the compiled-kernel cache at every new launch plan,
        # and hashing its nested tuples took ~70 hash calls (a third of a plan from a
        # recipe, launch._ShapeRecipe). Equal programs still hash alike (same fields).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        # str hashes differ between processes: a pickled program must not carry its hash
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def value_dtype(self, index: int) -> torch.dtype:
        if index < len(self.lookups):
            return self.input_dtypes[self.lookups[index].table_slot]
        return self.instrs[index - len(self.lookups)].dtype

    # Cached: the launcher asks for every input on every call. (cached_property writes the
    # instance __dict__ directly, so it works on a frozen dataclass; eq and hash use fields.)
    @functools.cached_property
    def index_slots(self) -> frozenset[int]:
        """Integer tensors read once per row: lookups' indices and placed outputs' rows."""
        placing = (slot for _, slot in self.placed_outputs)
        return frozenset((*(lookup.index_slot for lookup in self.lookups), *placing))

    @functools.cached_property
    def table_slots(self) -> frozenset[int]:
        return frozenset(lookup.table_slot for lookup in self.lookups)

    @functools.cached_property
    def concat_parts(self) -> dict[int, tuple[int, int]]:
        """Slots read as parts of a concatenation -> (its instruction's index among
        ``instrs``, its dim from the end). A slot is a part of one concatenation only (the
        lowering gives each part its own slot)."""
        return {op.slot: (i, instr.dim) for i, instr in enumerate(self.instrs)
                if isinstance(instr, Concat) for op in instr.operands}  # fmt: skip

    @functools.cached_property
    def row_concats(self) -> tuple[int, ...]:
        """Indices among ``instrs`` of the concatenations along a row dim (the kernel takes
        each one's rows per index of that dim and its size)."""
        return tuple(i for i, instr in enumerate(self.instrs)
                     if isinstance(instr, Concat) and instr.dim != -1)  # fmt: skip

    @functools.cached_property
    def has_reduction(self) -> bool:
        """Does a value depend on whole rows (a reduction or a scan)? The kernel then walks
        whole rows (the persistent or chunked layout)."""
        return any(isinstance(i, Reduce | Scan) for i in self.instrs)

    @functools.cached_property
    def narrow_values(self) -> frozenset[int]:
        """Values of width 1: reductions and values computed from narrow operands only."""
        narrow: set[int] = set()
        for j, lookup in enumerate(self.lookups):
            if lookup.table_slot in self.narrow_inputs:
                narrow.add(j)
        base = len(self.lookups)

        def is_narrow(op: Operand) -> bool:
            if isinstance(op, InputRef):
                return op.slot in self.narrow_inputs or op.slot in self.scalar_inputs
            return not isinstance(op, ValueRef) or op.index in narrow

        for i, instr in enumerate(self.instrs):
            if instr.is_narrow(is_narrow):
                narrow.add(base + i)
        return frozenset(narrow)

    def operand_is_narrow(self, operand: Operand) -> bool:
        if isinstance(operand, InputRef):
            return operand.slot in self.narrow_inputs or operand.slot in self.scalar_inputs
        if isinstance(operand, ValueRef):
            return operand.index in self.narrow_values
        return True  # constants and left-out operands have no width

    @functools.cached_property
    def compute_dtype(self) -> torch.dtype:
        dtypes = set(self.input_dtypes) | {i.dtype for i in self.instrs}
        return torch.float64 if torch.float64 in dtypes else torch.float32


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype eager accumulates a reduction of ``dtype`` in (fp64 for fp64, else fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How a group's kernel is built (part of the compiled-kernel cache key).

    Attributes:
        index_checks: build in Triton's debug mode so ``tl.device_assert`` checks every
            index on the device (eager CUDA embedding does the same).
        round_intermediates: round every intermediate value to the dtype eager gives it
            (bit-for-bit eager's rounding for one-op chains); False rounds only the outputs,
            as Inductor does, which is closer to exact and saves two conversions per op.
    """

    index_checks: bool = True
    round_intermediates: bool = True


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


# ---- Matmul groups (kernels/matmul.py runs them; passes/matmul_groups.py finds them)

# "rms": transformers' RMSNorm (Llama), w * (x.float() * rstd).to(dtype); "layer":
# F.layer_norm; "rms_offset": Gemma's, (x.float() * rstd * (1 + w.float())).to(dtype)
NORMS = ("", "rms", "layer", "rms_offset")
GATES = ("", "silu", "gelu", "gelu_tanh")
# A single linear's activation: a gate's, relu, or NewGELU written out op by op (rounded to
# the dtype after each of its 8 ops, as eager rounds them: passes/activations.py); a depthwise
# convolution's (kernels/depthwise_conv.py) also relu6, hardswish, hardsigmoid
ACTIVATIONS = (*GATES, "relu", "gelu_new", "relu6", "hardswish", "hardsigmoid")
MAX_SIBLINGS = 3
MAX_ROWS = 16  # rows up to which a matmul is grouped (decode and small-batch steps)


@dataclasses.dataclass(frozen=True)
class MatmulGroup:
    """What one launch computes; hashable (the kernel's constants come from it)."""

    siblings: int = 1  # weights multiplied by the same rows (q, k, v: 3; gate and up: 2)
    norm: str = ""  # the prologue: one of NORMS
    eps: float = 0.0  # the norm's epsilon
    norm_bias: bool = False  # "layer": the norm has a bias
    gate: str = ""  # one of GATES: the output is act(y_0) * y_1 (two siblings)
    bias: bool = False  # every weight has a bias
    residual: bool = False  # the output gets a residual added (one output)
    weight_layout: str = "nk"  # "nk": weights [N, K] (nn.Linear); "kn": [K, N] (GPT-2's Conv1D)
    # a gated pair given as one weight (and bias) whose two halves are gate and up
    # (Phi-3's gate_up_proj); gate_half: which half is the gate
    chunked: bool = False
    gate_half: int = 0
    # q, k, v (three siblings) whose q and k get transformers' rotary embedding over heads of
    # this width (``x * cos + rotate_half(x) * sin``; 0: none), and whose k and v are written
    # into two KV caches at an index (StaticCache's ``index_copy_``) instead of being returned;
    # ``index_checks``: the kernel is built with its device-side assert on that index
    rotary: int = 0
    cache_write: bool = False
    index_checks: bool = False
    # q's and k's heads RMS-normalised before the rotation, each with its own [D] weight and
    # epsilon ``head_eps``: "rms" (transformers' RMSNorm, Qwen3's q_norm and k_norm) or
    # "rms_offset" (Gemma3's, 1 + weight, rounded once)
    head_norm: str = ""
    head_eps: float = 0.0
    activation: str = ""  # one of ACTIVATIONS, applied to a single linear's output
    # or any elementwise ops of that output alone, as a program of one input and one output
    # of the output's dtype (passes/activations.elementwise_tail; kernels/epilogue.py)
    epilogue: RowProgram | None = None
    # elementwise ops of the residual sum alone (LeViT's head: ``(head(x) + dist(x)) / 2``),
    # a program of one input and one output of the output's dtype, applied after the add
    residual_tail: RowProgram | None = None

    def __post_init__(self) -> None:
        if self.norm not in NORMS or self.gate not in GATES:
            raise ValueError(f"MatmulGroup: unknown norm {self.norm!r} or gate {self.gate!r}")
        if not 1 <= self.siblings <= MAX_SIBLINGS:
            raise ValueError(f"MatmulGroup: 1 to {MAX_SIBLINGS} siblings, not {self.siblings}")
        if self.gate and self.siblings != 2:
            raise ValueError("MatmulGroup: a gate takes exactly two siblings (gate, up)")
        if self.weight_layout not in ("nk", "kn"):
            raise ValueError(f"MatmulGroup: weight_layout 'nk' or 'kn', not {self.weight_layout!r}")
        if self.residual and self.outputs != 1:
            raise ValueError("MatmulGroup: a residual needs a group of one output")
        if self.chunked and not self.gate or self.gate_half not in (0, 1):
            raise ValueError("MatmulGroup: a chunked weight is a gated pair (gate_half 0 or 1)")
        if self.rotary and (self.siblings != 3 or self.gate or self.residual or self.rotary % 2
                            or self.weight_layout != "nk"):  # fmt: skip
            raise ValueError("MatmulGroup: a rotary embedding takes q, k, v as three [N, K] "
                             "weights, no gate or residual, and an even head width")  # fmt: skip
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MatmulGroup: unknown activation {self.activation!r}")
        if self.epilogue is not None and (self.activation or len(self.epilogue.outputs) != 1
                                          or len(self.epilogue.input_dtypes) != 1):  # fmt: skip
            raise ValueError("MatmulGroup: an epilogue program (one input, one output) "
                             "replaces a named activation")  # fmt: skip
        if (self.activation or self.epilogue) and (self.siblings != 1 or self.gate
                                                   or self.residual):  # fmt: skip
            raise ValueError("MatmulGroup: an activation follows one linear, without a gate "
                             "or residual")  # fmt: skip
        tail = self.residual_tail
        if tail is not None and (not self.residual or len(tail.outputs) != 1
                                 or len(tail.input_dtypes) != 1):  # fmt: skip
            raise ValueError("MatmulGroup: a residual tail (one input, one output) follows "
                             "a residual")  # fmt: skip
        if self.head_norm not in ("", "rms", "rms_offset"):
            raise ValueError(f"MatmulGroup: unknown head norm {self.head_norm!r}")
        if self.head_norm and (not self.rotary or (self.rotary // 2) & (self.rotary // 2 - 1)):
            raise ValueError("MatmulGroup: head norms go with a rotary embedding over heads "
                             "whose half width is a power of two")  # fmt: skip
        if self.index_checks and not self.cache_write:
            raise ValueError("MatmulGroup: index checks are the cache write's")
        if self.cache_write and not self.rotary:
            raise ValueError("MatmulGroup: a KV-cache write follows the rotary embedding")

    @property
    def weight_params(self) -> int:
        """Weights the launch is given (a chunked pair: one, split in two halves)."""
        return 1 if self.chunked else self.siblings

    @property
    def outputs(self) -> int:
        return 1 if self.gate or self.cache_write else self.siblings

    def describe(self) -> str:
        """A short name for explain: ``rms + 3 linears``, ``linear + residual``, ..."""
        parts = [self.norm + "_norm"] if self.norm else []
        if self.chunked:
            parts.append("linear in halves")
        else:
            parts.append(f"{self.siblings} linears" if self.siblings > 1 else "linear")
        parts += ["bias"] if self.bias else []
        parts += [f"{self.gate}(gate) * up"] if self.gate else []
        parts += [self.activation] if self.activation else []
        if self.epilogue is not None:
            parts.append("(" + ", ".join(i.name for i in self.epilogue.instrs) + ")")
        parts += ["residual"] if self.residual else []
        if self.residual_tail is not None:
            parts.append("(" + ", ".join(i.name for i in self.residual_tail.instrs) + ")")
        parts += [f"{self.head_norm}_norm(q, k heads)"] if self.head_norm else []
        parts += ["rotary(q, k)"] if self.rotary else []
        parts += ["cache write(k, v)"] if self.cache_write else []
        return " + ".join(parts)
