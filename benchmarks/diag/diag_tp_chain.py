"""Why does a TP=2 decode step cost more than one GPU's? All-reduces in a dependent matmul chain.

Question: a Llama-3-8B decode step captured in one CUDA graph took 7.74 ms per rank at TP=2
against 6.81 ms on one GPU, although 65 NCCL all-reduces of a [1, 4096] fp16 row replayed back
to back took ~0.78 ms. Does an all-reduce inside a dependent chain (matmul -> all-reduce ->
matmul ...) cost far more than one back to back (NCCL's kernel waiting on the matmul, holding
SMs, or serialising with compute), and does torch's one-shot all-reduce over symmetric memory
(peer loads over NVLink, no multicast) cost less there?

    torchrun --nproc-per-node 2 benchmarks/diag/diag_tp_chain.py --out DIR/tp_chain.json
    NCCL_PROTO=LL torchrun --nproc-per-node 2 benchmarks/diag/diag_tp_chain.py \\
        --label proto-ll --out DIR/tp_chain_ll.json      # likewise NCCL_ALGO=Ring ...
    torchrun --nproc-per-node 2 benchmarks/diag/diag_tp_chain.py --smoke --out /tmp/x.json

For each shape (TinyLlama: hidden 2048, 22 layers; Llama-3-8B: hidden 4096, 32 layers) and
dtype (fp16, then bf16: torch's CUDA one-shot kernel, in the CUDASymmetricMemoryOps.cu read
for this script, dispatches bf16 and fp32 only, so the NCCL-against-one-shot comparison is
made in bf16, its matmuls costing as fp16's), on a [1, H]
activation, every variant is captured in one CUDA graph per rank and replayed (CUDA events,
warm-up, the median of --repeats rounds of --replays replays, ranks barriered between rounds
and between variants); figures are microseconds per replay, i.e. per decode-like step:

- a_c10d_b2b: 2L in-place ``dist.all_reduce`` of one row back to back, nothing between them
  (benchmarks/tensor_parallel.py's measurement of the communication share);
- a_nccl_b2b: 2L ``_c10d_functional.all_reduce`` + ``wait_tensor`` back to back, as DTensor
  emits them (each clones its input first);
- a_nccl_dep: the same, each all-reduce fed by the previous one through a scale kernel: a
  dependent chain with no matmul in it;
- b_compute: the matmuls alone, a TP=2 shard of each Llama layer in a dependent chain
  (qkv [H, (H + 2 kv) / 2], o [H / 2, H], gate_up [H, I], down [I / 2, H], SiLU * up, residual
  adds), no all-reduce;
- c_nccl_chain: b with an NCCL all-reduce after the o- and down-like matmuls (the real TP
  pattern, 2 per layer);
- floor_single_full: b at the unsharded shapes on rank 0 alone (the one-GPU floor);
- a_symm_b2b, d_symm_chain: a_nccl_b2b and c with the all-reduce replaced by
  ``torch.ops.symm_mem.one_shot_all_reduce`` (the row-parallel matmul writes straight into a
  ``symm_mem.empty`` buffer that was rendezvoused once); skipped, with the reason recorded,
  where the op is absent, multicast is not disabled, or it fails (fp16, see above).

NCCL knobs (NCCL_PROTO, NCCL_ALGO, ...) act at communicator set-up, so they need a process of
their own: rerun with the variable set and ``--label``; every NCCL_* / TORCH_NCCL_* /
TORCH_SYMM* / NVSHMEM_* / CUDA_DEVICE_MAX_CONNECTIONS value is recorded. Rank 0 writes the JSON
(device, torch, NCCL version, date, world size, each variant's median/min per rank) after every
variant, so a run killed by the hang watchdog (faulthandler, DIAG_HANG_S seconds per step,
default 90) still leaves what it measured.

``--smoke`` (CPU, gloo, 2 processes): no graphs, no timing; each variant's math runs once at a
tiny shape in fp32 and the all-reduce sums and the TP chain (against the unsharded chain) are
checked, the symmetric-memory rows emulated with gloo's all-reduce on a plain buffer; the exit
status is 1 where a check or a variant fails (tests/test_tp_chain_smoke.py).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

# NVLink multicast stays off on the machines this runs on: NCCL reads NCCL_NVLS_ENABLE at
# communicator set-up and torch's symmetric memory reads TORCH_SYMM_MEM_DISABLE_MULTICAST at
# rendezvous (without it, rendezvous creates a multicast object). Set here, before torch
# loads, only where unset; a value set otherwise turns the symmetric-memory variants off.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
for _name, _value in MULTICAST_OFF.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tensor_parallel import SHAPES  # noqa: E402  (benchmarks/tensor_parallel.py's shapes)

HANG_S = float(os.environ.get("DIAG_HANG_S", "90"))
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_SYMM", "NVSHMEM_", "CUDA_DEVICE_MAX_CONNECTIONS")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Scale of the row-parallel weights (o, down): a residual stream that grew by the full
# variance at each of 64 adds would overflow fp16 by the last layer.
ROW_GAIN = 0.2
Chain = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
RowMatmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        help="of benchmarks/tensor_parallel.py's SHAPES "
        "(default tinyllama,llama3-8b; with --smoke tiny)",
    )
    parser.add_argument("--dtypes", help="default fp16,bf16 (with --smoke fp32)")
    parser.add_argument("--replays", type=int, default=50, help="graph replays per round")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per variant")
    parser.add_argument("--warmup", type=int, default=10, help="replays before timing")
    parser.add_argument("--no-symm", action="store_true", help="skip the symmetric-memory rows")
    parser.add_argument("--label", default="", help="names this run (e.g. the NCCL env set)")
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo: math and sums only")
    parser.add_argument("--out", help="JSON path (rank 0 writes it)")
    args = parser.parse_args()
    args.shapes = (args.shapes or ("tiny" if args.smoke else "tinyllama,llama3-8b")).split(",")
    args.dtypes = (args.dtypes or ("fp32" if args.smoke else "fp16,bf16")).split(",")
    for name in args.shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}: one of {sorted(SHAPES)}")
    for name in args.dtypes:
        if name not in DTYPES:
            parser.error(f"unknown dtype {name!r}: one of {sorted(DTYPES)}")
    if "RANK" not in os.environ:
        parser.error("run it under torchrun (see the module docstring)")
    return args


def mark(text: str) -> None:
    print(f"[rank {os.environ.get('RANK')} {time.strftime('%H:%M:%S')}] {text}", flush=True)
    faulthandler.dump_traceback_later(HANG_S, exit=True)  # restarted by every step


class Run:
    """This process's device, rank, group and the report rank 0 writes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        timeout = datetime.timedelta(seconds=120)
        if args.smoke:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
        else:
            if not torch.cuda.is_available():
                raise SystemExit("no CUDA device: run with --smoke on a CPU")
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
            dist.init_process_group("nccl", device_id=self.device, timeout=timeout)
        self.group = dist.group.WORLD.group_name
        # Symmetric buffers stay alive to the end and are freed before the process group goes.
        self.keep: list[Any] = []
        self.failed_checks: list[str] = []
        self.report: dict[str, Any] = {
            "environment": environment(self),
            "label": args.label,
            "smoke": args.smoke,
            "settings": {k: getattr(args, k) for k in ("replays", "repeats", "warmup")},
            "blocks": {},
            "complete": False,
        }

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def write(self) -> None:
        if self.rank == 0 and self.args.out:
            with open(self.args.out, "w") as f:
                json.dump(self.report, f, indent=1)


def environment(run: Run) -> dict[str, Any]:
    cuda = run.device.type == "cuda"
    nccl = None
    if cuda:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    ops = {}
    for name in ("one_shot_all_reduce", "one_shot_all_reduce_out", "two_shot_all_reduce_"):
        try:
            ops[name] = str(getattr(torch.ops.symm_mem, name).default._schema)
        except (AttributeError, RuntimeError) as error:
            ops[name] = f"absent: {type(error).__name__}"
    return {
        "device": torch.cuda.get_device_name(run.device) if cuda else f"cpu ({platform.machine()})",
        "world_size": run.world,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "symm_mem_ops": ops,
    }


# ---------------------------------------------------------------------------------------------
# The chain: weights in nn.Linear's [out, in] layout, sharded as transformers' tp_plan does
# (qkv and gate_up by output rows, o and down by input columns).


def widths(shape: dict[str, Any]) -> tuple[int, int, int, int]:
    hidden = shape["hidden_size"]
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    return hidden, shape["intermediate_size"], kv, shape["num_hidden_layers"]


def make_weights(run: Run, shape: dict[str, Any], dtype: torch.dtype, keep_full: bool):
    """Every rank draws the same unsharded weights (one seed) and keeps its shard; rank 0
    also keeps the unsharded ones (the one-GPU floor and the reference of the checks)."""
    hidden, inter, kv, layers = widths(shape)
    world, r = run.world, run.rank
    q, k, i = hidden // world, kv // world, inter // world
    gen = torch.Generator(device=run.device).manual_seed(0)

    def draw(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=gen, device=run.device, dtype=torch.float32)
        return (w * (gain / cols**0.5)).to(dtype)

    shards: Chain = []
    full: Chain = []
    for _ in range(layers):
        wq, wk, wv = draw(hidden, hidden), draw(kv, hidden), draw(kv, hidden)
        wo = draw(hidden, hidden, ROW_GAIN)
        wg, wu = draw(inter, hidden), draw(inter, hidden)
        wd = draw(hidden, inter, ROW_GAIN)
        shards.append(
            (
                torch.cat(
                    [wq[r * q : (r + 1) * q], wk[r * k : (r + 1) * k], wv[r * k : (r + 1) * k]]
                ),
                wo[:, r * q : (r + 1) * q].contiguous(),
                torch.cat([wg[r * i : (r + 1) * i], wu[r * i : (r + 1) * i]]),
                wd[:, r * i : (r + 1) * i].contiguous(),
            )
        )
        if keep_full:
            full.append((torch.cat([wq, wk, wv]), wo, torch.cat([wg, wu]), wd))
        del wq, wk, wv, wo, wg, wu, wd
    return shards, full


def chain(x: torch.Tensor, layers: Chain, rowmm: RowMatmul) -> torch.Tensor:
    """A decode step's matmuls, each fed by the one before: attention is left out (the q
    columns stand in for its output), RMSNorm too; ``rowmm`` is the row-parallel matmul
    (o, down) with or without its all-reduce."""
    for wqkv, wo, wgu, wd in layers:
        q = wo.shape[1]
        i = wd.shape[1]
        attn = F.linear(x, wqkv)[:, :q]
        h = x + rowmm(attn, wo)
        gu = F.linear(h, wgu)
        x = h + rowmm(F.silu(gu[:, :i]) * gu[:, i:], wd)
    return x


def local_rowmm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(a, w)


def nccl_reduce(run: Run) -> Callable[[torch.Tensor], torch.Tensor]:
    functional = torch.ops._c10d_functional
    return lambda y: functional.wait_tensor(functional.all_reduce(y, "sum", run.group))


class SymmReduce:
    """The row-parallel matmul writes into one rendezvoused symmetric buffer; torch's one-shot
    kernel reads every rank's copy of it over NVLink (peer loads, no multicast) and writes the
    sum to a fresh tensor. Reusing the buffer is safe: the kernel ends with a barrier across
    ranks, so no rank overwrites it before the others have read it.

    ``emulate`` (the smoke run: no CUDA) keeps the same calls over a plain buffer with the
    functional all-reduce in the one-shot op's place, so that the d rows' plumbing (the matmul
    into the buffer, the reduction of the buffer) is checked on a CPU too."""

    def __init__(self, run: Run, hidden: int, dtype: torch.dtype, emulate: bool = False) -> None:
        self.group = run.group
        self.backend: str | None = None
        if emulate:
            self.buffer = torch.empty(1, hidden, dtype=dtype, device=run.device)
            reduce = nccl_reduce(run)
            self.op = lambda y, op, group: reduce(y)
            self.backend = "emulated: functional all_reduce on a plain buffer (smoke)"
            return
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # older torch needs it; newer calls it deprecated and harmless
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group)
        self.buffer = symm_mem.empty(1, hidden, dtype=dtype, device=run.device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group)
        self.op = torch.ops.symm_mem.one_shot_all_reduce
        if hasattr(symm_mem, "get_backend"):
            self.backend = symm_mem.get_backend(run.device)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Sum of a row already in the buffer (the back-to-back variant)."""
        return self.op(y, "sum", self.group)

    def rowmm(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        torch.mm(a, w.t(), out=self.buffer)
        return self.op(self.buffer, "sum", self.group)


def symm_setup(run: Run, hidden: int, dtype: torch.dtype) -> tuple[SymmReduce | None, str]:
    """A rendezvoused buffer and one eager one-shot all-reduce checked against the sum, or the
    reason there is none. Every rank takes the same branch (a rank that went on alone would
    wait forever in the next collective)."""
    reason = ""
    symm = None
    if run.args.no_symm:
        reason = "--no-symm"
    elif run.device.type != "cuda" and not run.args.smoke:
        reason = "no CUDA: symmetric memory needs CUDA"
    elif any(os.environ.get(k) != v for k, v in MULTICAST_OFF.items()):
        reason = f"multicast not disabled ({ {k: os.environ.get(k) for k in MULTICAST_OFF} })"
    elif not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        reason = "torch.ops.symm_mem.one_shot_all_reduce absent in this torch"
    else:
        try:
            symm = SymmReduce(run, hidden, dtype, emulate=run.device.type != "cuda")
            run.keep.append(symm)
            symm.buffer.fill_(run.rank + 1)
            got = symm.reduce(symm.buffer)
            run.sync()
            want = run.world * (run.world + 1) / 2
            if not torch.all(got == want).item():
                reason = f"one-shot sum wrong: {got.float().max().item()} != {want}"
        except Exception as error:  # recorded; the NCCL variants still ran
            reason = f"{type(error).__name__}: {error}"[:500]
    reasons = run.gather(reason)
    if any(reasons):
        return None, "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons) if why)
    return symm, ""


# ---------------------------------------------------------------------------------------------
# Measuring


def time_replays(run: Run, graph: torch.cuda.CUDAGraph, barriers: bool) -> dict[str, Any]:
    args = run.args
    for _ in range(args.warmup):
        graph.replay()
    run.sync()
    rounds = []
    for _ in range(args.repeats):
        # Ranks start each round together: a rank that starts late stretches the other's
        # first all-reduce (it waits for its peer), which the round would count.
        if barriers:
            run.barrier()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / args.replays)
    return {"median_us": statistics.median(rounds), "min_us": min(rounds), "rounds_us": rounds}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def measure_local(run: Run, fn: Callable[[], torch.Tensor], barriers: bool):
    """Eager calls (lazy set-up of NCCL, cuBLAS; the eager output for the checks), then one
    capture, replays timed; the graph is freed before returning: NCCL's teardown hung on 2
    H100s while graphs holding its collectives were alive (benchmarks/tensor_parallel.py)."""
    eager = fn()
    fn()
    run.sync()
    if run.args.smoke:
        return {}, eager
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static = fn()
        timing = time_replays(run, graph, barriers)
        graph.replay()
        run.sync()
        timing["replay_vs_eager_max_abs"] = max_diff(static, eager)
        del static
    finally:
        try:
            graph.reset()  # its private pool and, for NCCL, its captured collectives
        except RuntimeError:  # a capture that failed part-way: the first error is the one kept
            pass
        del graph
        run.sync()
    return timing, eager


class Block:
    """One shape and dtype: its variants' rows in the report, its eager outputs."""

    def __init__(self, run: Run, name: str, layers: int) -> None:
        self.run = run
        self.name = name
        self.reduces = 2 * layers
        self.rows: dict[str, Any] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.checks: dict[str, Any] = {}
        run.report["blocks"][name] = {"rows": self.rows, "checks": self.checks}

    def variant(self, name, fn, what, *, reduces=0, rank0_only=False) -> None:
        run = self.run
        mark(f"{self.name} {name}")
        mine: dict[str, Any] | None = None
        if not rank0_only or run.rank == 0:
            try:
                mine, self.outputs[name] = measure_local(run, fn, barriers=not rank0_only)
            except Exception as error:  # recorded, and the other variants still run
                mine = {"error": f"{type(error).__name__}: {error}"[:1000]}
        run.barrier()
        ranks = run.gather(mine)
        row: dict[str, Any] = {"what": what, **(ranks[0] or {})}
        row["per_rank_median_us"] = [r.get("median_us") if r else None for r in ranks]
        if reduces and "median_us" in row:
            row["per_all_reduce_us"] = row["median_us"] / reduces
        errors = {r: x["error"] for r, x in enumerate(ranks) if x and "error" in x}
        if errors:
            row["error"] = errors
            run.failed_checks.append(f"{self.name} {name}: {errors}"[:500])
        self.rows[name] = row
        run.write()

    def skip(self, name: str, what: str, reason: str) -> None:
        self.rows[name] = {"what": what, "skipped": reason}
        self.run.write()

    def check(self, name: str, got: str, want: str, tolerance: float) -> None:
        """Relative max difference of two eager outputs on rank 0; the smoke run fails on it."""
        run = self.run
        if run.rank != 0 or got not in self.outputs or want not in self.outputs:
            return
        a, b = self.outputs[got], self.outputs[want]
        rel = max_diff(a, b) / max(b.float().abs().max().item(), 1e-30)
        ok = bool(torch.isfinite(a.float()).all().item()) and rel <= tolerance
        self.checks[name] = {"rel_max_diff": rel, "tolerance": tolerance, "ok": ok}
        if not ok:
            run.failed_checks.append(f"{self.name} {name}: {rel:.3g} > {tolerance}")
        run.write()

    def summarise(self, floor: str, compute: str) -> None:
        """The per-all-reduce costs the question is about."""
        rows = self.rows
        summary: dict[str, Any] = {}

        def med(name: str) -> float | None:
            return rows.get(name, {}).get("median_us")

        for name in ("a_c10d_b2b", "a_nccl_b2b", "a_nccl_dep", "a_symm_b2b"):
            if med(name) is not None:
                summary[f"{name}_us_each"] = med(name) / self.reduces
        for name in ("c_nccl_chain", "d_symm_chain"):
            if med(name) is not None and med(compute) is not None:
                summary[f"{name}_us_each_over_compute"] = (med(name) - med(compute)) / self.reduces
            if med(name) is not None and med(floor) is not None:
                summary[f"{name}_over_single_gpu"] = med(name) / med(floor)
        self.run.report["blocks"][self.name]["summary"] = summary
        self.run.write()


def run_block(run: Run, shape_name: str, dtype_name: str) -> None:
    shape = SHAPES[shape_name]
    dtype = DTYPES[dtype_name]
    hidden, _, _, layers = widths(shape)
    block = Block(run, f"{shape_name}/{dtype_name}", layers)
    reduces = block.reduces
    mark(f"{block.name}: weights")
    shards, full = make_weights(run, shape, dtype, keep_full=run.rank == 0)
    gen = torch.Generator(device=run.device).manual_seed(1)
    x0 = torch.randn(1, hidden, generator=gen, device=run.device, dtype=torch.float32).to(dtype)
    # A rank-dependent row: its all-reduce sum is known.
    row = (x0 * (run.rank + 1)).contiguous()
    row_sum = x0 * (run.world * (run.world + 1) / 2)
    block.outputs["row_sum"] = row_sum
    block.outputs["row_mean"] = row_sum / run.world
    reduce = nccl_reduce(run)

    # In place on a zero row, as benchmarks/tensor_parallel.py measured it: zeros stay zeros
    # through the sums of sums (any other row overflows fp16 within 20 calls), and NCCL's
    # time does not depend on the values. No copy in between, unlike the functional form.
    zeros = torch.zeros_like(row)

    def c10d_b2b() -> torch.Tensor:
        for _ in range(reduces):
            dist.all_reduce(zeros)
        return zeros

    def nccl_b2b() -> torch.Tensor:
        return [reduce(row) for _ in range(reduces)][-1]

    def nccl_dep() -> torch.Tensor:
        y = row
        for _ in range(reduces):
            y = reduce(y) * (1.0 / run.world)  # the mean: the same row after the first
        return y

    block.variant("a_c10d_b2b", c10d_b2b, "dist.all_reduce in place, back to back", reduces=reduces)
    block.variant(
        "a_nccl_b2b", nccl_b2b, "functional all_reduce + wait_tensor, back to back", reduces=reduces
    )
    block.variant(
        "a_nccl_dep", nccl_dep, "functional all_reduce, each fed by the previous", reduces=reduces
    )
    block.variant(
        "b_compute", lambda: chain(x0, shards, local_rowmm), "TP shard matmul chain, no all-reduce"
    )
    block.variant(
        "c_nccl_chain",
        lambda: chain(x0, shards, lambda a, w: reduce(F.linear(a, w))),
        "TP shard chain + NCCL all-reduce after o and down",
        reduces=reduces,
    )
    block.variant(
        "floor_single_full",
        lambda: chain(x0, full, local_rowmm),
        "unsharded chain on rank 0 alone",
        rank0_only=True,
    )
    full.clear()  # rank 0's unsharded weights: 14 GiB at 8B's shape
    symm, reason = symm_setup(run, hidden, dtype)
    names = {
        "a_symm_b2b": "symm_mem one-shot all-reduce, back to back",
        "d_symm_chain": "TP shard chain + symm_mem one-shot all-reduce",
    }
    if symm is None:
        for name, what in names.items():
            block.skip(name, what, reason)
    else:
        run.report["blocks"][block.name]["symm_backend"] = symm.backend
        symm.buffer.copy_(row)
        block.variant(
            "a_symm_b2b",
            lambda: [symm.reduce(symm.buffer) for _ in range(reduces)][-1],
            names["a_symm_b2b"],
            reduces=reduces,
        )
        block.variant(
            "d_symm_chain",
            lambda: chain(x0, shards, symm.rowmm),
            names["d_symm_chain"],
            reduces=reduces,
        )
    # Tolerances: fp32 sums are exact to rounding; a 16-bit chain of 2L adds drifts by a few
    # units of its last place per layer.
    chain_tol = 1e-4 if dtype == torch.float32 else 5e-2
    sum_tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name in ("a_nccl_b2b", "a_symm_b2b"):
        block.check(f"{name}_equals_sum", name, "row_sum", sum_tol)
    block.check("a_nccl_dep_equals_mean", "a_nccl_dep", "row_mean", sum_tol)
    block.check("c_nccl_chain_equals_unsharded", "c_nccl_chain", "floor_single_full", chain_tol)
    block.check("d_symm_chain_equals_c", "d_symm_chain", "c_nccl_chain", chain_tol)
    block.summarise("floor_single_full", "b_compute")
    shards.clear()
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()


def print_table(run: Run) -> None:
    env = run.report["environment"]
    print(
        f"\n{env['device']} x{env['world_size']}, torch {env['torch']}, NCCL {env['nccl']}"
        f"{', label ' + run.args.label if run.args.label else ''}"
    )
    for name, block in run.report["blocks"].items():
        print(f"\n{name}")
        for variant, row in block["rows"].items():
            if "median_us" in row:
                each = row.get("per_all_reduce_us")
                extra = f"  {each:7.2f} us/all-reduce" if each is not None else ""
                print(
                    f"  {variant:18s} {row['median_us']:9.1f} us/step (min "
                    f"{row['min_us']:9.1f}){extra}"
                )
            else:
                why = row.get("skipped") or row.get("error") or "ran (no timing)"
                print(f"  {variant:18s} {str(why)[:150]}")
        if block.get("symm_backend"):
            print(f"  symmetric-memory backend: {block['symm_backend']}")
        for key, value in block.get("summary", {}).items():
            print(f"  {key}: {value:.3f}")
        for key, value in block["checks"].items():
            print(
                f"  check {key}: {'ok' if value['ok'] else 'FAILED'} ({value['rel_max_diff']:.2e})"
            )


def shutdown(run: Run) -> None:
    """Graphs are already freed (measure_local); the symmetric buffers go next, every rank past
    its last kernel, then the process group. The hang watchdog stays on to the end."""
    mark("shutdown")
    run.barrier()
    run.keep.clear()
    gc.collect()
    run.barrier()
    if run.device.type == "cuda":
        dist.destroy_process_group()
    # Not on gloo: its teardown aborted a rank now and then on a loaded 2-core machine
    # (tests/test_tensor_parallel.py); the process exit frees it.
    faulthandler.cancel_dump_traceback_later()


def main() -> None:
    args = parse_args()
    mark("init")
    run = Run(args)
    for shape_name in args.shapes:
        for dtype_name in args.dtypes:
            run_block(run, shape_name, dtype_name)
    run.report["complete"] = True
    run.report["failed_checks"] = run.failed_checks
    run.write()
    if run.rank == 0:
        print_table(run)
    shutdown(run)
    if args.smoke and run.failed_checks:
        print("failed checks or variants: " + "; ".join(run.failed_checks), flush=True)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
