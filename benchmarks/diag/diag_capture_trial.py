"""Why does the large-output capture trial decide differently in the suite and in the chain
benchmark? (one GPU run)

On an H100 (2026-11-25) the same B=16, T=2048, D=2048 chain was left uncaptured by the trial
in benchmarks/embedding_chain.py (``replay + output copy 0.226 ms > direct 0.127 ms``) and
kept captured in benchmarks/run.py's chain-prefill row (0.252 ms per call against
Inductor's 0.133). This prints every timed call of each trial (host and device seconds per
kind, the primes) and the verdict, for: the suite's chain-prefill row run alone; the same
row after the suite's other backends (as the suite runs it); and the chain benchmark's
as-called measurement.

    python benchmarks/diag/diag_capture_trial.py [--out trials.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in each child process: wraps CaptureTrial.add and verdict to print what they see.
PATCH = r"""
import json, sys
from fusebackend.runtime import payoff

_add, _verdict = payoff.CaptureTrial.add, payoff.CaptureTrial.verdict

def add(self, replayed, host_s, device_s):
    print("TRIAL " + json.dumps({"replayed": replayed, "host_ms": host_s * 1e3,
          "device_ms": device_s * 1e3, "prime_ms": self.prime_for(replayed) * 1e3}), flush=True)
    return _add(self, replayed, host_s, device_s)

def verdict(self):
    result = _verdict(self)
    if result is not None:
        print("VERDICT " + json.dumps({"keep": result[0], "why": result[1]}), flush=True)
    return result

payoff.CaptureTrial.add, payoff.CaptureTrial.verdict = add, verdict
sys.argv = [sys.argv[1], *sys.argv[2:]]
import os, runpy
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(label: str, argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PATCH, *argv], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    lines = done.stdout.splitlines()
    calls = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("TRIAL ")]
    verdicts = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("VERDICT ")]
    interesting = [x for x in lines if "per call" in x or "as users call it" in x]
    print(f"== {label} (rc={done.returncode})")
    for call in calls:
        kind = "replay+copy" if call["replayed"] else "direct"
        print(f"  {kind:12s} host {call['host_ms']:.3f} ms  device {call['device_ms']:.3f} ms  "
              f"prime {call['prime_ms']:.3f} ms")  # fmt: skip
    for v in verdicts:
        print(f"  verdict: {v['why']}")
    for x in interesting[-8:]:
        print(f"  {x.strip()}")
    if done.returncode:
        print(done.stderr[-3000:])
    return {"label": label, "argv": argv, "rc": done.returncode, "calls": calls,
            "verdicts": verdicts, "lines": interesting}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write every trial's timings here (JSON)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        suite = ["benchmarks/run.py", "--out-dir", tmp, "--only", "chain-prefill"]
        results.append(run("suite chain-prefill, infinifuse alone",
                           [*suite, "--backends", "infinifuse"]))  # fmt: skip
        results.append(run("suite chain-prefill, every backend", suite))
        results.append(run("embedding_chain.py", ["benchmarks/embedding_chain.py",
                                                  "--out", f"{tmp}/chain.json"]))  # fmt: skip
    if args.out:
        import torch

        env = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
        Path(args.out).write_text(json.dumps({**env, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
