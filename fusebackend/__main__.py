"""Command line: ``python -m fusebackend doctor``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusebackend")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="check CUDA, Triton, capture and replay on this machine")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from fusebackend.doctor import run_doctor

        failures = run_doctor()
        print(f"\n{'all checks passed' if not failures else f'{failures} check(s) failed'}")
        return 1 if failures else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
