"""The pair kernel: one launch that runs a row program over two sets of tensors.

The programs of the grid below ``GRID_A`` handle the first set, the rest the second: two
groups of one kernel (the rotary embeddings of q and k) in one launch. The body is the
single kernel's (``codegen.Writer``), written twice with each set's parameter names.
"""

from __future__ import annotations

import re

from fusebackend.kernels.codegen import Writer, check_layout, kernel_name
from fusebackend.kernels.ir import KernelOptions, RowProgram
from fusebackend.kernels.signature import parameters, unspecialized

__all__ = ["generate_pair_source"]


def generate_pair_source(
    program: RowProgram, rank: int, options: KernelOptions, layout: str = "tile"
) -> tuple[str, str]:
    """Like ``codegen.generate_source``, for the kernel that runs ``program`` over two sets
    of tensors in one launch: (kernel name, Python source)."""
    check_layout(program, layout)
    return _write_pair(Writer(program, rank, options, layout))


def _write_pair(writer: Writer) -> tuple[str, str]:
    """The pair kernel of ``writer``'s program (the module docstring)."""
    name = kernel_name(writer.p, writer.rank, writer.options, writer.layout) + "_pair"
    params, _ = parameters(writer.p, writer.rank, writer.layout)
    body = writer.body()
    per_set = [q for q in params if not q.endswith("tl.constexpr")]
    constexprs = [q for q in params if q.endswith("tl.constexpr")]
    unspecialized_pair = [
        f"{prefix}{q}" for prefix in ("a_", "b_") for q in unspecialized(writer.p, writer.rank)
    ]
    params_text = [f"{prefix}{q}," for prefix in ("a_", "b_") for q in per_set]
    params_text += ["GRID_A,  # programs of the first set", *(f"{q}," for q in constexprs)]
    names = [q.split(":")[0] for q in per_set]  # a scalar's annotation is no part of it
    doc, *statements = body  # the docstring stays first, once
    lines = [*writer.header(name, [*unspecialized_pair, "GRID_A"], params_text), doc]
    lines += [
        "    if tl.program_id(ROWS_AXIS) < GRID_A:",
        "        pid_r = tl.program_id(ROWS_AXIS)",
    ]
    lines += ["    " + _prefixed(line, "a_", names) for line in statements]
    lines += ["    else:", "        pid_r = tl.program_id(ROWS_AXIS) - GRID_A"]
    lines += ["    " + _prefixed(line, "b_", names) for line in statements]
    return name, "\n".join(lines) + "\n"


def _prefixed(line: str, prefix: str, params: list[str]) -> str:
    """``line`` with each per-set parameter name (``in0_ptr``, ``size1``, ``R``...) given
    ``prefix``. Parameters are whole identifiers; locals such as ``ro_in0`` or ``BLOCK_R``
    contain them only after another identifier character, which the match excludes."""
    names = "|".join(sorted(params, key=len, reverse=True))
    return re.sub(rf"(?<![A-Za-z0-9_.])({names})(?![A-Za-z0-9_])", rf"{prefix}\1", line)
