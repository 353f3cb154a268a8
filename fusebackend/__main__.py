"""Command line: ``python -m fusebackend doctor``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusebackend")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "doctor",
        help="check what this machine can do: the backend on the CPU everywhere; with CUDA, "
        "Triton kernels, CUDA-graph capture, replay and sync-freedom",
    )
    args = parser.parse_args(argv)
    if args.command == "doctor":
        import torch

        from fusebackend.doctor import run_doctor

        failures = run_doctor()
        if failures:
            print(f"\n{failures} check(s) failed")
        elif torch.cuda.is_available():
            print("\nall checks passed")
        else:
            print(
                "\nall checks passed (CPU only: infinifuse works here, without CUDA graphs; "
                "the GPU checks need a CUDA device)"
            )
        return 1 if failures else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
