"""What does the device-side index assert cost, and where should it go? (one GPU run)

Compiles the chain of benchmarks/embedding_chain.py with infinifuse (index checks on),
then swaps the compiled kernel for variants of its generated source that differ only in
the index assert, and times each the same way as the benchmark (device time inside a CUDA
graph) under a few launch configs:

    assert_end      the assert after the stores (codegen's current choice)
    assert_gather   the assert right after the gather
    scalar_assert   one scalar assert per program: count of bad rows == 0
    branch_assert   the tensor assert inside ``if count of bad rows != 0`` (the assert and
                    the barrier Triton puts after it run only when an index is bad)
    no_assert       debug build without any assert (what the build mode alone costs)
    release         the index_checks=False kernel (no debug build)

    python benchmarks/diag/diag_index_assert.py --out /tmp/diag_index_assert.json

``--family hints`` times cache-eviction hints instead (same kernel, assert at the end):
stores ``evict_first`` (outputs are not read again here), the token-table gather
``evict_first`` (rows rarely repeat), the position-table gather ``evict_last`` (every batch
row reads the same rows).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from embedding_chain import Chain, device_ms  # noqa: E402
from row_kernels import versions  # noqa: E402

import fusebackend.kernels.launch as launch  # noqa: E402
from fusebackend.kernels.configs import triton_next_power_of_2  # noqa: E402

ASSERT = re.compile(r"^ *tl\.device_assert\((ok\d+) \| ~row_mask, (\"[^\"]*\")\)\n", re.M)


def variants(source: str) -> dict[str, str]:
    asserts = ASSERT.findall(source)
    assert asserts, "no index assert in the generated source"
    bare = ASSERT.sub("", source)
    after_gather = bare
    for ok, message in asserts:
        # right after the line that defines ok{j}
        line = re.search(rf"^( *){ok} = .*\n", after_gather, re.M)
        indent = line.group(1)
        insert = f"{indent}tl.device_assert({ok} | ~row_mask, {message})\n"
        after_gather = after_gather[: line.end()] + insert + after_gather[line.end() :]
    scalar = bare.rstrip("\n") + "\n"
    for ok, message in asserts:
        scalar += (
            f"    tl.device_assert(tl.sum((~{ok} & row_mask).to(tl.int32), axis=0) == 0, "
            f"{message})\n"
        )
    branch = bare.rstrip("\n") + "\n"
    for ok, message in asserts:
        bad = f"tl.sum((~{ok} & row_mask).to(tl.int32), axis=0)"
        branch += f"    if {bad} != 0:\n        tl.device_assert({ok} | ~row_mask, {message})\n"
    return {
        "assert_end": source,
        "branch_assert": branch,
        "assert_gather": after_gather,
        "scalar_assert": scalar,
        "no_assert": bare,
    }


def hint_variants(source: str) -> dict[str, str]:
    def stores_first(text: str) -> str:
        return re.sub(
            r"(tl\.store\(.*), mask=mask\)", r'\1, mask=mask, eviction_policy="evict_first")', text
        )

    def gather(text: str, table: str, policy: str) -> str:
        pattern = rf"(= tl\.load\({table}_ptr \+ idx\d+.*other=0\.0)\)"
        return re.sub(pattern, rf'\1, eviction_policy="{policy}")', text)

    both = gather(gather(source, "in1", "evict_first"), "in3", "evict_last")
    return {
        "base": source,
        "stores_first": stores_first(source),
        "gathers": both,
        "all_hints": stores_first(both),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--configs", default="4096x4,2048x4,8192x4,4096x8,8192x8",
                        help="launch configs to try, as TILExWARPS,...: programs of TILE elements, "
                        "rows up to min(TILE, 2048) wide")  # fmt: skip
    parser.add_argument("--family", choices=("assert", "hints"), default="assert")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    B, T, D = args.batch, args.seq, args.dim
    model = Chain(32000, T, D).cuda().half().eval()
    ids = torch.randint(0, 32000, (B, T), device="cuda")
    pos_ids = torch.arange(T, device="cuda")[None]
    moved = 3 * B * T * D * 2

    results = []
    with torch.no_grad():
        ref = model(ids, pos_ids)
        checked = torch.compile(model, backend="infinifuse", options={"cudagraphs": False})
        checked(ids, pos_ids)
        release = torch.compile(
            model, backend="infinifuse", options={"cudagraphs": False, "index_checks": False}
        )
        release(ids, pos_ids)
        keys = {key[2].index_checks: key for key in launch._KERNELS}
        key = keys[True]
        release_kernel = launch._KERNELS[keys[False]]
        name, source = launch.kernel_source(*key[:4])
        kernels = {
            label: getattr(launch._import_source(name, text), name)
            for label, text in (variants if args.family == "assert" else hint_variants)(
                source
            ).items()
        }
        kernels["release"] = release_kernel
        default_config = launch.launch_config
        configs = [tuple(map(int, c.split("x"))) for c in args.configs.split(",")]
        for tile, warps in configs:

            def config(rows, width, layout="tile", gathers=True, tile=tile, warps=warps):
                block_d = min(triton_next_power_of_2(width), 2048, tile)
                block_r = min(triton_next_power_of_2(rows), max(1, tile // block_d))
                return block_r, block_d, warps

            for label, kernel in kernels.items():
                launch._KERNELS[key] = kernel
                # a new launch_config object per variant: the backend keeps each group's
                # launch plan (kernel included) per signature and launch_config
                launch.launch_config = functools.partial(config)
                out = checked(ids, pos_ids)
                torch.cuda.synchronize()
                ok = torch.equal(out, ref) or bool((out - ref).abs().max() < 1e-2)
                ms = device_ms(lambda: checked(ids, pos_ids), reps=5)
                row = {
                    "shape": [B, T, D],
                    "tile": tile,
                    "warps": warps,
                    "variant": label,
                    "ms": ms,
                    "gb_per_s": moved / ms / 1e6,
                    "matches_eager": ok,
                }
                results.append(row)
                print(
                    f"{B}x{T}x{D} tile={tile:5d} warps={warps:2d} {label:14s} {ms:.4f} ms  ok={ok}"
                )
        launch.launch_config = default_config
    with open(args.out, "w") as handle:
        json.dump({**versions(), "configs": args.configs, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
