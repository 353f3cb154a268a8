"""Launch parameters of the generated row kernels: the code layout for a row width and the
(rows per program, columns per program, warps) of a launch, from recorded sweeps.

Each rule cites the measurement it comes from (``benchmarks/results/``); a benchmark sweep
replaces ``launch.launch_config`` (the name the launcher calls) to time other configs.
"""

from __future__ import annotations

from fusebackend.kernels.ir import RowProgram

__all__ = [
    "FILL_PROGRAMS",
    "MAX_GRID_Y",
    "ceil_div",
    "launch_config",
    "layout_for",
    "split_into_parts",
    "triton_next_power_of_2",
]

# Launch configs, from benchmarks/diag/diag_index_assert.py (fp16 chain, index checks on;
# device time in a CUDA graph). Programs cover ~1024 elements: at most 1024 columns of a
# row, several rows of a narrow table. On the H200 (results/launch_config_h200.json,
# 2026-11-22) 16x2048x2048 took 0.109 ms with 2 warps vs 0.141 ms for the earlier
# 4096-element tiles with 4 warps (0.117 ms with 4 warps); 16 x 512 x 768 0.0165 vs
# 0.019 ms. On the H100 (results/diag_index_assert_h100.json, 2026-11-25) the index assert
# cost 4-5% in programs of a whole 2048-wide row with 2 warps (0.124 vs 0.119 ms without it)
# and nothing in 1024-wide ones (0.1186-0.1190 vs 0.1197 ms). Small groups (decode steps)
# are latency-bound and gain from more threads per row: 1 x 1 x 2048 2.4 us with 4 warps vs
# 3.0 us with 2, 64 x 4 x 4096 (1M elements) 3.6 vs 3.9 us.
TILE_ELEMENTS = 1024
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis
SMALL_GROUP_ELEMENTS = 1 << 21  # up to here the latency-bound configs (launch_config)
# Row programs (a reduction along the row): whole rows in registers up to this width (the
# brief's floor: D = 8192, Llama-3-70B's hidden size); wider rows loop over chunks.
MAX_PERSISTENT_D = 8192
CHUNK_D = 4096
# Rows per persistent program: narrow rows share a program so each one holds ~2048 elements
# (Liger-Kernel's rms_norm runs one row per program; several short rows per program keep
# the grid small for D = 128-512 heads). The H100 sweep (row_kernels_sweep_h100.json) put
# this rule within 0.1 us of the best config at the decode shapes, 0.6 us off at 4096 x 2048.
PERSISTENT_ELEMENTS = 2048
# Rows whose starts Triton cannot prove 16-element aligned (a width like Swin's 49 or
# ViT's 197 in fp16) get one element per thread along the row: a 64-wide block then spans
# two warps and every reduction crosses them through shared memory. One warp per program,
# 512 elements: Swin-T's window softmax (75264 rows of 49 plus a [1, 3, 49, 49] bias, fp16,
# H200) took 15.4 us against 26.2 with the 8 warps x 32 rows of aligned rows (Inductor 16.4;
# diag_row_variants at 17263c0); 28368 rows of 197 13.6 us against 35.4 with 8 warps x 8
# rows. In that sweep (results: row_kernels_sweep_unaligned_h200_f351192.json) the rule was
# the best config or within 0.7 us of it at 9408 x 49, 75264 x 49 and 28368 x 197.
# Wider blocks (rows of 257-8192) keep the aligned rule: one warp a row would leave a
# few-row launch a few warps in all, and that was not measured.
UNALIGNED_ROW_ELEMENTS = 512
MAX_UNALIGNED_ONE_WARP_D = 256
# Tile groups of up to this many elements take one launch config per band of widths (at
# least MIN_SMALL_BLOCK_D, then powers of two), whatever their rows: a launch config is a
# Triton binary, compiled at its first launch. A padded attention mask's group is as wide
# as the sequence, and with rows and columns each picking their block, the single queries of
# a sentence-transformers benchmark (MiniLM-L6, 100 queries of 2-60 tokens, H200,
# 2026-11-29, e7d9a06) compiled a binary at most new lengths: the p90 of a query at a new
# length went from 9.5-14.8 ms to 140 ms. Such groups are latency-bound: idle lanes of a
# 1024-element program cost nothing measurable there.
QUANTIZED_TILE_ELEMENTS = 1 << 16
MIN_SMALL_BLOCK_D = 64


def layout_for(program: RowProgram, width: int) -> str:
    """The code layout for rows of ``width`` (see kernels/codegen.py)."""
    if not program.has_reduction:
        return "tile"
    return "persistent" if width <= MAX_PERSISTENT_D else "chunked"


def launch_config(
    rows: int, width: int, layout: str = "tile", gathers: bool = False, aligned: bool = True
) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for a group of ``rows`` x ``width`` elements;
    ``gathers``: the program looks rows up in tables (embedding lookups); ``aligned``: every
    row of every operand starts at a multiple of 16 elements (see UNALIGNED_ROW_ELEMENTS)."""
    if layout == "persistent":
        block_d = triton_next_power_of_2(width)
        if not aligned and block_d <= MAX_UNALIGNED_ONE_WARP_D:
            block_r = min(triton_next_power_of_2(rows), max(1, UNALIGNED_ROW_ELEMENTS // block_d))
            return block_r, block_d, 1
        block_r = min(triton_next_power_of_2(rows), max(1, PERSISTENT_ELEMENTS // block_d))
        # Liger-Kernel's calculate_settings: warps from the row block (4 up to 2048
        # elements, 8 up to 8192, 16 above), so a thread holds <= 16-32 fp32 per value.
        elements = block_r * block_d
        num_warps = 4 if elements < 2048 else 8 if elements < 8192 else 16
        return block_r, block_d, num_warps
    if layout == "chunked":
        return 1, CHUNK_D, 8
    # Tile programs cover <= 1024 elements: at most 1024 columns, several rows of a narrow
    # table (TILE_ELEMENTS' comment).
    block_d = min(triton_next_power_of_2(width), TILE_ELEMENTS)
    if rows * width <= QUANTIZED_TILE_ELEMENTS:
        block_d = max(block_d, MIN_SMALL_BLOCK_D)
        return TILE_ELEMENTS // block_d, block_d, 8
    block_r = min(triton_next_power_of_2(rows), max(1, TILE_ELEMENTS // block_d))
    if rows * width <= SMALL_GROUP_ELEMENTS:
        # Latency-bound: ~4 elements per thread (8 warps). Swept on an H100
        # (benchmarks/results/row_kernels_sweep_h100.json, 2026-11-23): GPT-2's tanh GELU on
        # 1 x 3072 took 1.63 us against 2.03 us with the earlier 2048-wide, 4-warp
        # programs; SwiGLU on 1 x 5632 1.53 against 1.70 us.
        return block_r, block_d, max(1, min(8, block_r * block_d // 128))
    # Bandwidth-bound: 2 warps with lookups (the chain's regime), 4 without. Swept on an
    # H100 at prefill sizes (benchmarks/results/row_kernels_sweep_prefill_h100.json,
    # 2026-11-25): RoPE on 4096 x 32 heads x 128 took 25.1 us against 27.6 us with 2 warps,
    # on 16 heads 9.6 against 10.0 us; tanh GELU on 4096 x 4096 25.1 against 26.1 us with
    # 2048-wide, 2-warp programs; SwiGLU on 4096 x 8192 69.6 against 69.4 us (the best
    # config swept took 68.6 us).
    return block_r, block_d, 2 if gathers else 4


def triton_next_power_of_2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


# Programs a launch that splits its work aims for: two per SM of an H100/H200 (132 SMs)
FILL_PROGRAMS = 264


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def split_into_parts(
    units: int,
    programs: int,
    step: int,
    least: int,
    most: int | None = None,
    parts: int | None = None,
) -> tuple[int, int]:
    """``(parts, units a part)``: each of ``programs`` programs' ``units`` split so that the
    grid holds about ``FILL_PROGRAMS`` programs, a part ``least`` units at least and whole
    ``step``s, ``most`` parts at most (``parts``: that many asked for instead); where rounding
    a part up to whole steps leaves the last parts empty, fewer parts."""
    if parts is None:
        wanted = ceil_div(FILL_PROGRAMS, programs)
        parts = max(1, min(wanted if most is None else min(most, wanted), units // least))
    chunk = ceil_div(ceil_div(units, parts), step) * step
    return ceil_div(units, chunk), chunk
