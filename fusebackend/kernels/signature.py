"""A row kernel's signature: its parameters in launch order, with their documentation,
and which of them Triton must not specialise (``kernels/launch.py`` passes the arguments in
this order; ``kernels/codegen.py`` writes the body that reads them).
"""

from __future__ import annotations

import torch

from fusebackend.kernels.ir import RowProgram

__all__ = ["TL_DTYPES", "parameters", "unspecialized"]

TL_DTYPES = {
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.bool: "tl.int1",
    torch.uint8: "tl.uint8",
    torch.int8: "tl.int8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
}


def parameters(p: RowProgram, rank: int, layout: str) -> tuple[list[str], list[str]]:
    """The kernel's parameters, in launch order, and a line of documentation for each."""
    params: list[str] = []
    docs: list[str] = []
    leads = [f"s{d}" for d in range(rank)]
    for slot, dtype in enumerate(p.input_dtypes):
        if slot in p.index_slots:
            params += [f"in{slot}_ptr"] + [f"in{slot}_{s}" for s in leads]
            docs += [f"indices ({dtype}), broadcast to the row shape"]
            docs += [f"  stride of row dim {d}" for d in range(rank)]
        elif slot in p.scalar_inputs:
            # Typed, so that Triton takes it as this float type whatever the number
            params += [f"in{slot}: {TL_DTYPES[dtype]}"]
            docs += [f"a number read at each call ({dtype}; a norm's eps given as a graph "
                     "input)"]  # fmt: skip
        elif slot in p.table_slots:
            params += [f"in{slot}_ptr", f"in{slot}_rows", f"in{slot}_s0", f"in{slot}_s1"]
            docs += [
                f"table ({dtype})",
                "  number of table rows (valid indices: 0..rows-1)",
                "  row stride",
                "  column stride (0 when a 1-wide table broadcasts)",
            ]
        else:
            width = "narrow: one value per row" if slot in p.narrow_inputs else "row"
            params += [f"in{slot}_ptr"] + [f"in{slot}_{s}" for s in leads] + [f"in{slot}_sc"]
            docs += [f"operand ({dtype}, {width}), broadcast to the group's shape"]
            docs += [f"  stride of row dim {d}" for d in range(rank)] + ["  column stride"]
            if slot in p.concat_parts:
                params += [f"in{slot}_cs"]
                docs += ["  stride along its concatenation's dim (a part: strides over "
                         "its own range of that dim)"]  # fmt: skip
    placed = dict(p.placed_outputs)
    for k, value in enumerate(p.outputs):
        width = "narrow" if value in p.narrow_values else "row"
        docs += [f"output {k}: value v{value} ({p.value_dtype(value)}, {width})"]
        if k in placed:
            params += [f"out{k}_ptr", f"out{k}_s0", f"out{k}_sc"]
            docs += [f"  row stride (rows placed by in{placed[k]})", "  column stride"]
            continue
        params += [f"out{k}_ptr"] + [f"out{k}_{s}" for s in leads] + [f"out{k}_sc"]
        docs += [f"  stride of row dim {d}" for d in range(rank)] + ["  column stride"]
    params += [f"size{d}" for d in range(rank)] + ["R", "D"]
    docs += [f"row dim {d} of the group's shape" for d in range(rank)]
    docs += ["number of rows (product of the row dims)", "row width (last dim)"]
    for i in p.row_concats:
        params += [f"cat{i}_inner", f"cat{i}_n"]
        docs += [f"rows per index of concatenation {i}'s dim", "  that dim's size"]
    params += ["BLOCK_R: tl.constexpr", "BLOCK_D: tl.constexpr", "CHUNKS: tl.constexpr",
               "ROWS_AXIS: tl.constexpr"]  # fmt: skip
    block_d = {"tile": "columns per program", "persistent": "next_power_of_2(D): whole rows",
               "chunked": "columns per chunk of the row loop"}[layout]  # fmt: skip
    docs += [
        "rows per program",
        block_d,
        "chunks per row (chunked layout), else 1",
        "grid axis of the row blocks (0 or 1; column blocks on the other)",
    ]
    return params, docs


def unspecialized(p: RowProgram, rank: int) -> list[str]:
    """Arguments Triton must not specialise (on == 1 or divisibility by 16): each would
    compile a binary per class of lengths for no gain. The row sizes and count; and the
    strides of an index tensor's outer row dims, which scale with the inner sizes (BERT's
    [B, T] ids against [1, T] positions do not collapse: the ids' stride is T). An index
    is loaded once per row, so knowing its alignment vectorises nothing; the innermost
    stride stays specialised (1 for contiguous ids: consecutive rows' indices load as
    one vector in a rank-1 kernel). Strides of row tensors stay specialised: their
    divisibility by 16 is what lets a row's columns load as vectors, and for widths
    divisible by 16 every multiple of the width is too."""
    index_strides = [f"in{slot}_s{d}" for slot in sorted(p.index_slots)
                     for d in range(rank - 1)]  # fmt: skip
    return [f"size{d}" for d in range(rank)] + ["R", *index_strides]
