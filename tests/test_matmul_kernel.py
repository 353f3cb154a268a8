"""``kernels.matmul.matmul_group`` against eager PyTorch modules: the norm prologue
(transformers' ``LlamaRMSNorm``, ``nn.LayerNorm`` with and without bias), 1-3 sibling
``nn.Linear`` of different widths (q/k/v), biases, the gated pair (transformers' ``ACT2FN``
silu / gelu / gelu_pytorch_tanh: ``act(gate(a)) * up(a)``) and the residual add, in fp32,
fp16 and bf16, for 1-17 rows; on the CPU through Triton's interpreter, on a GPU on the
device (``DEVICE``). An autouse fixture makes ``matmul.reference`` (the torch fallback)
raise, so every comparison is the Triton kernel's (the empty input alone is the fallback's).

Which combinations run (the interpreter runs every program of the grid one after another, so
cost is programs x K-steps: a 2048 -> 5632 gated pair with the default tiles is ~350
programs x 8 steps, ~25 s on one core; the whole file must stay under ~60 s on 2 cores):

* ``test_prologue_epilogue_matrix``: every prologue (4) x every epilogue (15) x every dtype
  (3), at small widths (K 64 or 127, N 17-127: a partial last tile and a K not a multiple of
  the tile are both in), the rows cycling over 1, 2, 5, 16, 17 so that for each (prologue,
  dtype) and each (epilogue, dtype) every row count appears (the index sum mod 5 is a Latin
  square over the 15 epilogues and 3 dtypes). Every feature's code path is a constexpr, so
  this is every kernel variant against every dtype's roundings.
* ``test_model_shapes``: the big widths (896, 2048, 4097, 5632) and the model shapes (Qwen2-
  0.5B qkv with bias, GPT-2's c_attn / c_fc / c_proj + residual, TinyLlama's shapes), each
  once, with the default launch config where the grid is small enough for the interpreter
  (one big dimension at a time: a wide K over few output tiles, or many output tiles over a
  short K) and with a wide-tile config (``WIDE``: same code, other constexprs) for the
  larger model projections.
* ``test_launch_configs``: one shape under several configs a sweep may pick (tile edges
  larger than K or N, one or several pipeline stages), as the benchmark's ``--sweep`` swaps
  ``_launch_config``.
* default configs: ``launch_config``'s picks from the split-K sweep (8 K slices for a long K
  over few columns, 2 warps for o projections of 16 rows), and the full Qwen2-0.5B down
  projection (K 4864 -> 896, ~7 s here) through the real launch in 8 slices.
* layouts: x as a transposed view (column stride != 1) and as a column slice (row stride
  != K), 3-D ``[B, T, K]`` rows with a 3-D residual, weights as slices of one fused
  parameter and as a transposed view; validation of ``MatmulGroup``; zero rows.
* one row as GEMV (``LaunchConfig.gemv``): ``launch_config``'s rule (one row, weights along
  K, 512 columns or more, ``ONE_ROW_GEMV``), every prologue and epilogue under three GEMV
  configs (split-K among them, its counters back to zero), 2-column tiles, and a GEMV config
  refused for more rows. The rotary q/k/v launch as GEMV: tests/test_rotary_epilogue.py.

Tolerances, per dtype (``TOL``): fp32 atol = rtol = 1e-4: eager (MKL / cuBLAS) and the
kernel sum the K products in different orders; measured max error 6e-6 at K = 5632 for O(1)
outputs (weights scaled by 1/sqrt(K)), so 1e-4 leaves a margin and still catches any wrong
term (one product of 0.05 x 0.05/sqrt(K) is > 3e-5 at K <= 5632, and a wrong norm, bias,
activation or residual is off by far more). fp16 / bf16: ``helpers.tol`` (1e-2 / 2e-2): the
summation order moves the fp32 accumulator by ~1e-6, which can flip the one rounding to half
after the bias by one ulp; the norm, activation, product and residual round as eager does, an
ulp apart at most each. bf16 on the interpreter: atol = rtol = 4e-2, as Triton 3.6's
interpreter converts fp32 -> bf16 by truncation (helpers' docstring), so every rounding the
kernel makes is biased toward zero by up to one ulp (2^-7 = 0.78%) where eager rounds to
nearest, and the errors of a chain add up instead of cancelling: RMSNorm's two roundings (the
normalised row, its product with the weight), the linear's output, the activation and the
product are five, up to 3.9%. Measured: 0.3125 at -11.75 (2.7%) for rms + silu gate, 16 x 64,
where the kernel's output equals, bit for bit, a torch emulation of the same math that
truncates at each of those roundings (so the gap is the interpreter's, not the kernel's). On a
GPU (round to nearest even) bf16 keeps ``helpers.tol``'s 2e-2.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, tol
from torch import nn

import fusebackend.kernels.matmul as matmul
from fusebackend.kernels.epilogue import activation_program
from fusebackend.kernels.ir import GATES, NORMS
from fusebackend.kernels.matmul import LaunchConfig, MatmulGroup, matmul_group

transformers = pytest.importorskip("transformers")
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"  # Triton's interpreter: bf16 conversions truncate
BF16_TOL = {"atol": 4e-2, "rtol": 4e-2} if INTERPRETED else tol(torch.bfloat16)
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: tol(torch.float16),
       torch.bfloat16: BF16_TOL}  # fmt: skip
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROWS = (1, 2, 5, 16, 17)
# kernel name -> ACT2FN's (gelu_new: NewGELUActivation, its formula written out in 8 ops)
ACTS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu",
        "gelu_new": "gelu_new"}  # fmt: skip


@pytest.fixture(autouse=True)
def _kernel_only(monkeypatch):
    """The torch fallback must not answer for the kernel: a test that reaches it fails."""

    def refuse(*args, **kwargs):
        raise AssertionError("matmul_group ran its torch reference, not the Triton kernel")

    monkeypatch.setattr(matmul, "reference", refuse)


def rand(*shape, dtype=torch.float32, scale=1.0, g=None):
    """Random values never zero: |x| in [0.05, 2.05) x scale, random sign."""
    mag = torch.rand(*shape, generator=g) * 2.0 + 0.05
    sign = torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign * scale).to(dtype).to(DEVICE)


@dataclasses.dataclass(frozen=True)
class Case:
    """One eager block: ``prologue`` ("", "rms", "layer", "layer_nobias"), linears of
    ``widths``, ``bias``, ``gate`` (a kernel gate name), ``activation`` (one linear's) or
    ``residual`` and an activation of the sum (``residual_tail``); the fused launch is
    given the weights stored [N, K] (``layout`` "nk", as ``nn.Linear`` holds them) or
    [K, N] ("kn", as GPT-2's Conv1D)."""

    widths: tuple[int, ...]
    prologue: str = ""
    bias: bool = False
    gate: str = ""
    residual: bool = False
    activation: str = ""
    layout: str = "nk"
    residual_tail: str = ""

    def group(self, eps: float) -> MatmulGroup:
        norm = "layer" if self.prologue.startswith("layer") else self.prologue
        return MatmulGroup(siblings=len(self.widths), norm=norm, eps=eps if norm else 0.0,
                           norm_bias=self.prologue == "layer", gate=self.gate, bias=self.bias,
                           residual=self.residual, activation=self.activation,
                           weight_layout=self.layout, residual_tail=self._tail())  # fmt: skip

    def _tail(self):
        if not self.residual_tail:
            return None
        # one op in fp32, rounded once to the output's dtype by the kernel, as eager's op
        return activation_program(self.residual_tail, torch.float32)


class Eager(nn.Module):
    """The eager module sequence the group replaces, with random (non-zero) parameters."""

    def __init__(self, case: Case, k: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.case = case
        if case.prologue == "rms":
            self.norm = LlamaRMSNorm(k, eps=1e-6)
        elif case.prologue.startswith("layer"):
            self.norm = nn.LayerNorm(k, eps=1e-5, bias=case.prologue == "layer")
        else:
            self.norm = nn.Identity()
        self.linears = nn.ModuleList(nn.Linear(k, n, bias=case.bias) for n in case.widths)
        self.act = ACT2FN[ACTS[case.gate]] if case.gate else None
        self.single = ACT2FN[ACTS[case.activation]] if case.activation else None
        self.tail = ACT2FN[ACTS[case.residual_tail]] if case.residual_tail else None
        for lin in self.linears:  # weights ~ 1/sqrt(K): outputs of order 1
            lin.weight.data = rand(*lin.weight.shape, scale=k**-0.5, g=g).cpu()
            if lin.bias is not None:
                lin.bias.data = rand(*lin.bias.shape, scale=0.5, g=g).cpu()
        for name, p in self.norm.named_parameters():  # norm weight around 1, bias small
            p.data = (rand(*p.shape, g=g, scale=0.5) + (1.0 if name == "weight" else 0.0)).cpu()
        self.to(device=DEVICE, dtype=dtype)

    def forward(self, x, residual=None):
        a = self.norm(x)
        ys = [lin(a) for lin in self.linears]
        if self.act is not None:
            ys = [self.act(ys[0]) * ys[1]]
        if self.single is not None:
            ys = [self.single(ys[0])]
        if residual is not None:
            ys = [ys[0] + residual]
        if self.tail is not None:
            ys = [self.tail(ys[0])]
        return tuple(ys)

    def fused(self, x, residual=None):
        norm = self.norm if isinstance(self.norm, nn.Module) else None
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0))
        norm_weight = getattr(norm, "weight", None)
        norm_bias = getattr(norm, "bias", None)
        weights = [lin.weight for lin in self.linears]
        if self.case.layout == "kn":  # the same values stored [K, N], N contiguous
            weights = [w.t().contiguous() for w in weights]
        biases = [lin.bias for lin in self.linears] if self.case.bias else []
        with torch.no_grad():
            return matmul_group(self.case.group(eps), x, norm_weight, norm_bias, residual,
                                *weights, *biases)  # fmt: skip


def run_case(case: Case, rows: int | tuple[int, ...], k: int, dtype: torch.dtype, seed: int = 0,
             x: torch.Tensor | None = None):  # fmt: skip
    """(fused outputs, eager outputs) of ``case`` on random rows ``[*rows, K]``."""
    lead = (rows,) if isinstance(rows, int) else rows
    module = Eager(case, k, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    if x is None:
        x = rand(*lead, k, dtype=dtype, g=g)
    residual = rand(*x.shape[:-1], case.widths[0], dtype=dtype, g=g) if case.residual else None
    with torch.no_grad():
        expected = module(x, residual)
    return module.fused(x, residual), expected


def check_case(case, rows, k, dtype, seed=0, x=None):
    actual, expected = run_case(case, rows, k, dtype, seed, x)
    assert_close(actual, expected, **TOL[dtype])
    return actual


PROLOGUES = ("", "rms", "layer", "layer_nobias")
EPILOGUES = {
    "linear": Case((127,)),
    "linear_bias": Case((64,), bias=True),
    "pair": Case((127, 64)),
    "qkv": Case((64, 17, 17)),  # q, k, v: three widths, three tile counts
    "qkv_bias": Case((127, 64, 33), bias=True),  # Qwen2's attention has biases
    "silu_gate": Case((127, 127), gate="silu"),
    "gelu_gate": Case((64, 64), gate="gelu"),
    "gelu_tanh_gate": Case((127, 127), gate="gelu_tanh"),
    "silu_gate_bias": Case((33, 33), gate="silu", bias=True),
    "residual": Case((127,), residual=True),
    "residual_bias": Case((64,), bias=True, residual=True),
    "gelu_new": Case((127,), activation="gelu_new"),  # GPT-2's c_fc + NewGELU
    "gelu_new_bias": Case((64,), bias=True, activation="gelu_new"),
    "relu_bias": Case((127,), bias=True, activation="relu"),  # OPT's fc1
    "gelu": Case((33,), bias=True, activation="gelu"),  # GPT-NeoX's dense_h_to_4h
    "residual_relu": Case((127,), residual=True, residual_tail="relu"),
    "residual_bias_gelu": Case((64,), bias=True, residual=True, residual_tail="gelu"),
}


def _matrix():
    for (i, prologue), (j, epilogue), (d, dtype) in itertools.product(
        enumerate(PROLOGUES), enumerate(EPILOGUES), enumerate(DTYPES)
    ):
        rows = ROWS[(i + j + d) % len(ROWS)]
        k = (64, 127)[(i + j) % 2]
        name = f"{prologue or 'none'}-{epilogue}-{str(dtype)[6:]}-{rows}x{k}"
        yield pytest.param(prologue, epilogue, dtype, rows, k, id=name)


@pytest.mark.parametrize("prologue,epilogue,dtype,rows,k", list(_matrix()))
def test_prologue_epilogue_matrix(prologue, epilogue, dtype, rows, k):
    case = dataclasses.replace(EPILOGUES[epilogue], prologue=prologue)
    check_case(case, rows, k, dtype, seed=rows * 1000 + k)


# Tiles wide enough for the interpreter to run the full-size projections in seconds.
WIDE = LaunchConfig(block_n=128, block_k=512, warps=4, stages=2)

MODEL_SHAPES = [
    # (id, case, rows, K, dtype, config: None = the default launch_config). The interpreter's
    # cost grows with the weight's elements and the programs: the default config (16-wide
    # tiles) only where one dimension is big; the full 2048 x 5632 gate/up and 5632 x 2048
    # down projections (~10 s each here) are left to the benchmark, which checks each shape
    # against the reference on the GPU.
    ("wide_k_4097_rms", Case((64,), "rms"), 1, 4097, torch.float32, None),
    ("wide_n_4097_bias", Case((4097,), bias=True), 17, 64, torch.float16, None),
    ("wide_n_5632_silu_gate", Case((5632, 5632), "rms", gate="silu"), 5, 127, torch.bfloat16,
     WIDE),
    ("down_5632_residual", Case((127,), residual=True), 2, 5632, torch.bfloat16, None),
    ("k_2048_layer_pair", Case((896, 127), "layer"), 16, 2048, torch.float16, WIDE),
    ("qwen2_qkv", Case((896, 128, 128), "rms", bias=True), 1, 896, torch.float16, None),
    ("qwen2_qkv_bf16", Case((896, 128, 128), "rms", bias=True), 5, 896, torch.bfloat16, WIDE),
    ("gpt2_c_attn", Case((2304,), "layer", bias=True), 1, 768, torch.float16, WIDE),
    ("gpt2_c_fc", Case((3072,), "layer", bias=True), 2, 768, torch.float32, WIDE),
    ("gpt2_c_proj_residual", Case((768,), bias=True, residual=True), 1, 3072, torch.float16,
     WIDE),
    ("tinyllama_qkv", Case((2048, 256, 256), "rms"), 1, 2048, torch.float16, WIDE),
    ("tinyllama_o_residual", Case((2048,), residual=True), 1, 2048, torch.bfloat16, WIDE),
]  # fmt: skip


@pytest.fixture
def launch_config(monkeypatch):
    """``use(config)``: every launch of the test uses ``config`` (None: the default)."""

    def use(config):
        if config is not None:
            monkeypatch.setattr(matmul, "_launch_config", lambda *a: config)

    return use


@pytest.mark.parametrize("case,rows,k,dtype,config",
                         [pytest.param(*s[1:], id=s[0]) for s in MODEL_SHAPES])  # fmt: skip
def test_model_shapes(case, rows, k, dtype, config, launch_config):
    launch_config(config)
    check_case(case, rows, k, dtype, seed=k)


SWEEP_CONFIGS = [
    LaunchConfig(16, 64, 2, 1),
    LaunchConfig(32, 128, 4, 3),
    LaunchConfig(64, 512, 8, 4),  # block_k past K (127): one masked step
    LaunchConfig(256, 256, 4, 2),  # block_n past every output (64, 33): one masked tile
]


@pytest.mark.parametrize("config", SWEEP_CONFIGS, ids=str)
def test_launch_configs(config, launch_config):
    launch_config(config)
    check_case(Case((64, 33, 33), "layer", bias=True), 5, 127, torch.float16, seed=3)
    check_case(Case((64, 64), "rms", gate="gelu_tanh"), 2, 127, torch.float32, seed=4)


# split-K of K = 127 in whole K steps: 2 slices of one 64-wide step; 3 of three 16-wide
# steps (48, 48, 31); 7 asked of four 32-wide steps: 4 slices (none left empty)
SPLIT_CONFIGS = [LaunchConfig(16, 64, 4, 2, split_k=2), LaunchConfig(32, 16, 2, 1, split_k=3),
                 LaunchConfig(16, 32, 4, 3, split_k=7)]  # fmt: skip


@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_sums_every_slice_once_for_every_epilogue(config, dtype, launch_config):
    # Each kind of tile (plain siblings, a gated pair, a residual, an activation) sums its
    # K slices in the program that arrives last; twice, as the second launch must find the
    # counters zeroed by the first. A rotary q/k/v group: tests/test_rotary_epilogue.py.
    from fusebackend.kernels import arrivals

    launch_config(config)
    x = rand(5, 127, dtype=dtype)
    weights = (rand(64, 127, dtype=dtype),)
    _, grid, meta, _ = matmul._launch(MatmulGroup(), x, None, None, None, weights, ())
    assert grid[1] == meta["SPLIT_K"] == {2: 2, 3: 3, 7: 4}[config.split_k], (grid, meta)
    cases = [Case((64, 33, 17), "rms", bias=True), Case((64, 64), "layer", gate="silu"),
             Case((64,), bias=True, residual=True), Case((33,), activation="gelu_new")]  # fmt: skip
    for seed, case in enumerate(cases):
        first = check_case(case, 5, 127, dtype, seed=seed)
        again = check_case(case, 5, 127, dtype, seed=seed)
        assert all(torch.equal(a, b) for a, b in zip(first, again))  # slices in a fixed order
    assert arrivals._counters[DEVICE].abs().amax() == 0


# Default configs the H100 sweep with split-K picked (benchmarks/results/
# matmul_sweep_h100_splitk.json; launch_config's docstring has the timings)
DOWN_SPLIT = LaunchConfig(16, 128, warps=2, stages=4, split_k=8)


# One row asks launch_config with gemv=False where GEMV is not allowed (a head norm): these
# picks still apply there, and to 2-16 rows.
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_default_config_splits_k_of_narrow_down_projections_only(rows):
    # Qwen2-0.5B's down projection (K 4864 -> 896, residual): 8 slices (7.6 / 7.9 us
    # against 8.9 / 9.2 us in one); TinyLlama's (5632 -> 2048) keeps one slice, its best
    assert matmul.launch_config(rows, 4864, 896, False) == DOWN_SPLIT
    assert matmul.launch_config(rows, 5632, 2048, False) == LaunchConfig(16, 512, 2, 4)
    assert matmul.launch_config(rows, 4096, 1024, False).split_k == 8  # the rule's edges
    assert matmul.launch_config(rows, 4096, 1040, False).split_k == 1
    assert matmul.launch_config(rows, 3072, 768, False).split_k == 1  # GPT-2's c_proj
    # a gated pair or an LM head of a long K never splits
    assert matmul.launch_config(rows, 4864, 896, True).split_k == 1
    assert matmul.launch_config(rows, 4096, 32000, False).split_k == 1


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_default_config_splits_k_of_narrow_rotary_groups_of_few_rows(rows):
    # q/k/v + rotary at 1 row (rotary_splitk_h100.json): TinyLlama (2048 -> 1024 + 128 + 256
    # columns per launch), Qwen2 (896 -> 448 + 64 + 128) and Llama-3-8B at TP=2 (4096 -> 1024
    # + 256 + 512) in 4 slices; Llama-3-8B (3584 columns) and 16 rows (not swept) in one
    split = LaunchConfig(32, 128, warps=2, stages=3, split_k=4)
    for width, outputs in ((2048, 1408), (896, 640), (4096, 1792)):
        expected = split if rows <= 4 else LaunchConfig(16, 256, 4, 3)
        assert matmul.launch_config(rows, width, outputs, True, rotary=True) == expected
    assert matmul.launch_config(rows, 4096, 3584, True, rotary=True).split_k == 1
    assert matmul.launch_config(rows, 896, 640, True).split_k == 1  # a narrow gate/up pair


def test_default_config_runs_o_projections_of_16_rows_on_2_warps():
    # Qwen2's o projection (896 -> 896) 3.4 against 3.8 us with 16 rows; TinyLlama's
    # (2048 -> 2048) 6.5 against 7.5 us; one row keeps 4 warps (TinyLlama: 6.6 against 7.3)
    assert matmul.launch_config(16, 896, 896, False) == LaunchConfig(16, 256, 2, 4)
    assert matmul.launch_config(16, 2048, 2048, False) == LaunchConfig(16, 512, 2, 4)
    assert matmul.launch_config(1, 896, 896, False) == LaunchConfig(16, 256, 4, 4)
    assert matmul.launch_config(1, 2048, 2048, False) == LaunchConfig(16, 256, 4, 4)
    # q/k/v widen their input (not swept at 2 warps): 4 warps at any rows
    assert matmul.launch_config(16, 896, 896 + 2 * 128, False) == LaunchConfig(16, 256, 4, 4)
    assert matmul.launch_config(16, 2048, 2048 + 2 * 256, False) == LaunchConfig(32, 512, 4, 3)


def test_qwen2_down_projection_splits_k_in_the_real_launch():
    """The full Qwen2-0.5B down projection (K 4864 -> 896, residual, fp16, two decode rows:
    one row is a GEMV launch) under the default launch_config: 56 tiles x 8 slices of 640
    (the last 384), summed by the last to arrive, against eager (~7 s on the
    interpreter)."""
    from fusebackend.kernels import arrivals

    case = Case((896,), residual=True)
    x = rand(2, 4864, dtype=torch.float16)
    weights = (rand(896, 4864, dtype=torch.float16),)
    _, grid, meta, _ = matmul._launch(case.group(0.0), x, None, None, x[:, :896], weights, ())
    assert grid == (56, 8) and meta["SPLIT_K"] == 8 and meta["K_SPAN"] == 640, (grid, meta)
    assert (meta["BLOCK_K"], meta["num_warps"], meta["num_stages"]) == (128, 2, 4), meta
    check_case(case, 2, 4864, torch.float16, seed=4864)
    assert arrivals._counters[DEVICE].abs().amax() == 0


# ---- one row: GEMV launches (LaunchConfig.gemv, matmul_triton._row_products)

GEMV = LaunchConfig(2, 1024, warps=4, stages=1, gemv=True)


def test_default_config_of_one_row_is_a_gemv_where_measured():
    # diag_matmul_gemv.py (matmul_gemv_h100.json): 2-column tiles of 1024-wide K steps
    # for one row of the decode projections (896 to 7168 output columns)
    for width, outputs, gated in ((5632, 2048, False), (2048, 5632, True), (4864, 896, False),
                                  (2048, 1408, True), (2048, 32000, False)):  # fmt: skip
        assert matmul.launch_config(1, width, outputs, gated, gemv=True) == GEMV
    # LM heads over a short K: 16-column tiles (GPT-2's and Qwen2's, matmul_kernels.py
    # --sweep-gemv on an H200; TinyLlama's K of 2048 keeps 2 columns, above)
    for width, outputs in ((768, 50257), (896, 151936)):
        lm_head = matmul.launch_config(1, width, outputs, False, gemv=True)
        assert lm_head == dataclasses.replace(GEMV, block_n=16), lm_head
    assert matmul.launch_config(1, 896, 896, False, gemv=True).block_k == 1024
    assert matmul.launch_config(1, 384, 1152, False, gemv=True).block_k == 512  # K's power
    # not: more rows, a launch that cannot take it, under 512 columns (not measured)
    assert not matmul.launch_config(2, 5632, 2048, False, gemv=True).gemv
    assert not matmul.launch_config(1, 5632, 2048, False, gemv=False).gemv
    assert not matmul.launch_config(1, 2048, 511, False, gemv=True).gemv


def test_one_row_launches_as_gemv_along_the_weights_storage():
    x = rand(1, 127, dtype=torch.float16)
    weight = rand(600, 127, dtype=torch.float16)
    group = MatmulGroup()
    _, grid, meta, _ = matmul._launch(group, x, None, None, None, (weight,), ())
    assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["W_KN"], grid) == (1, 2, False, (300, 1))
    # GPT-2's Conv1D weight [K, N] seen as [N, K]: tiles along N, 16 columns wide (600 is a
    # narrow output)
    stored_kn = rand(127, 600, dtype=torch.float16).t()
    _, grid, meta, _ = matmul._launch(group, x, None, None, None, (stored_kn,), ())
    assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["W_KN"], grid) == (1, 16, True, (38, 1))
    # contiguous along neither (every other column of a [K, 2N] weight): tensor cores
    strided = rand(127, 1200, dtype=torch.float16)[:, ::2].t()
    _, _, meta, _ = matmul._launch(group, x, None, None, None, (strided,), ())
    assert (meta["BLOCK_M"], meta["W_KN"]) == (16, False), meta
    for w in (weight, stored_kn):  # more rows: tensor cores, whatever the layout
        _, _, meta, _ = matmul._launch(group, rand(2, 127, dtype=torch.float16), None, None,
                                       None, (w,), ())  # fmt: skip
        assert (meta["BLOCK_M"], meta["W_KN"]) == (16, False), meta


def test_default_gemv_config_of_weights_stored_kn():
    # the H200 sweeps' rule (_gemv_along_n): a K slice of up to 1024 in one step, 32-column
    # tiles but 16 for narrow outputs in one slice; longer slices in 32 x 256 or 16 x 128
    # tiles; K sliced only from 2048 on, up to 256 programs
    for width, outputs, want in ((768, 2304, (32, 1024, 1)), (768, 3072, (32, 1024, 1)),
                                 (3072, 768, (32, 512, 8)), (768, 768, (16, 1024, 1)),
                                 (768, 50257, (32, 1024, 1)), (64, 600, (16, 64, 1)),
                                 (4096, 4096, (32, 256, 2)), (1600, 4800, (32, 256, 1)),
                                 (16384, 768, (16, 128, 8))):  # fmt: skip
        got = matmul.launch_config(1, width, outputs, False, gemv=True, along_n=True)
        block_n, block_k, splits = want
        assert got == LaunchConfig(block_n, block_k, 4, 1, split_k=splits, gemv=True), got
    assert not matmul.launch_config(2, 768, 2304, False, gemv=True, along_n=True).gemv


def test_a_gemv_config_for_more_rows_is_refused(launch_config):
    launch_config(dataclasses.replace(GEMV, block_k=64))
    with pytest.raises(ValueError, match="GEMV launch config is for one row, not 3"):
        check_case(Case((64,)), 3, 64, torch.float32)


# 16- and 32-column tiles keep the interpreter's program count low (the GPU's 2-column tile
# runs the same code; test_gemv_of_two_column_tiles runs it here once per kind of tile). The
# split-K config's 32-column tiles halve its programs (each runs every K slice): the tile
# width is a constexpr of the same code, and 127, 33 and 17 columns still end in a partial
# tile, 64 in two full ones.
GEMV_CONFIGS = [
    LaunchConfig(16, 64, 4, 1, gemv=True),  # K 127: two steps, the last one masked
    LaunchConfig(32, 256, 2, 1, gemv=True),  # one step past K; N's last tile partial
    LaunchConfig(32, 32, 4, 1, split_k=3, gemv=True),  # 3 of four 32-wide steps: 64 + 63
]


@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_for_every_prologue_and_epilogue(config, dtype, launch_config):
    # every epilogue once and every prologue four times over the list, one row, K = 127
    from fusebackend.kernels import arrivals

    launch_config(config)
    x = rand(1, 127, dtype=dtype)
    _, grid, meta, _ = matmul._launch(MatmulGroup(), x, None, None, None,
                                      (rand(64, 127, dtype=dtype),), ())  # fmt: skip
    assert meta["BLOCK_M"] == 1 and grid[1] == meta["SPLIT_K"] == {1: 1, 3: 2}[config.split_k]
    for i, case in enumerate(EPILOGUES.values()):
        case = dataclasses.replace(case, prologue=PROLOGUES[i % len(PROLOGUES)])
        check_case(case, 1, 127, dtype, seed=i)
    assert arrivals._counters.get(DEVICE, torch.zeros(1)).abs().amax() == 0


def test_one_row_gemv_off_keeps_tensor_cores(monkeypatch):
    monkeypatch.setattr(matmul, "ONE_ROW_GEMV", False)
    assert not matmul.launch_config(1, 5632, 2048, False, gemv=True).gemv
    _, _, meta, _ = matmul._launch(MatmulGroup(), rand(1, 127), None, None, None,
                                   (rand(600, 127),), ())  # fmt: skip
    assert meta["BLOCK_M"] == 16, meta


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_of_two_column_tiles(dtype, launch_config):
    # launch_config's GEMV tile width: a plain tile, a gated pair, three siblings
    launch_config(LaunchConfig(2, 64, 4, 1, gemv=True))
    check_case(Case((33,), "rms", residual=True), 1, 127, dtype, seed=1)
    check_case(Case((17, 17), "layer", gate="silu"), 1, 127, dtype, seed=2)
    check_case(Case((17, 9, 9), "layer_nobias", bias=True), 1, 127, dtype, seed=3)


# ---- weights stored [K, N] (GPT-2's Conv1D, ``x @ W``: MatmulGroup.weight_layout "kn")

KN_GEMV = LaunchConfig(32, 64, 4, 1, gemv=True)  # K 127: two steps, the last masked


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_along_n_for_every_prologue_and_epilogue(dtype, launch_config):
    # the GEMV's [K step, columns] tiles (W_KN): every epilogue once, every prologue four
    # times over the list, one row, K = 127, outputs of 17-127 columns (partial last tiles)
    launch_config(KN_GEMV)
    x = rand(1, 127, dtype=dtype)
    stored_kn = rand(127, 64, dtype=dtype).t()
    _, _, meta, _ = matmul._launch(MatmulGroup(weight_layout="kn"), x, None, None, None,
                                   (stored_kn,), ())  # fmt: skip
    assert meta["BLOCK_M"] == 1 and meta["W_KN"], meta
    for i, case in enumerate(EPILOGUES.values()):
        case = dataclasses.replace(case, prologue=PROLOGUES[i % len(PROLOGUES)], layout="kn")
        check_case(case, 1, 127, dtype, seed=i)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_along_n_in_k_slices(dtype, launch_config):
    # slices of K along N (a long K's default): 3 of four 32-wide steps, 64 + 63, the last
    # program to arrive adding them; its counters left at zero. 67 columns: 5 tiles of 16,
    # the last partial (the config is forced here, so the default rule's 512 columns are not
    # needed: 530 columns ran 34 tiles of the same code, ~7x the interpreter's programs)
    from fusebackend.kernels import arrivals

    launch_config(LaunchConfig(16, 32, 4, 1, split_k=3, gemv=True))
    for seed, case in enumerate([Case((67,), "layer", bias=True, activation="gelu_new"),
                                 Case((67, 67), "rms", gate="silu"),
                                 Case((67,), bias=True, residual=True)]):  # fmt: skip
        check_case(dataclasses.replace(case, layout="kn"), 1, 127, dtype, seed=seed)
    assert arrivals._counters[DEVICE].abs().amax() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_stored_kn_under_the_default_config(dtype):
    # K 600 and N 530, multiples of no tile: one row is the GEMV along N in 34 tiles of 16
    # columns and one 1024-wide K step, in one slice (K is sliced from 2048 on:
    # test_default_gemv_config_of_weights_stored_kn; slices along N are run by
    # test_gemv_along_n_for_every_prologue_and_epilogue)
    # (a gate and a residual after an RMSNorm make 6 roundings, which bf16 on the interpreter
    # truncates: 3 of 530 values beyond BF16_TOL, for [N, K] weights as for [K, N])
    config = matmul.launch_config(1, 600, 530, False, gemv=True, along_n=True)
    assert (config.block_n, config.split_k) == (16, 1), config
    for seed, case in enumerate([Case((530,), "layer", bias=True, activation="gelu_new"),
                                 Case((530, 530), "rms", gate="silu"),
                                 Case((530,), bias=True, residual=True)]):  # fmt: skip
        check_case(dataclasses.replace(case, layout="kn"), 1, 600, dtype, seed=seed)


@pytest.mark.parametrize("rows,dtype", [(2, torch.float32), (3, torch.float16),
                                        (4, torch.bfloat16)], ids=str)  # fmt: skip
def test_weights_stored_kn_of_few_rows_on_tensor_cores(rows, dtype):
    # 2-4 rows read the same [K, N] tiles into tl.dot; K 127, N 67 and 33
    check_case(Case((67, 33, 33), "layer", bias=True, layout="kn"), rows, 127, dtype)
    check_case(Case((67,), "rms", residual=True, layout="kn"), rows, 127, dtype)


def test_default_config_is_read_at_each_call(monkeypatch):
    """The sweep swaps ``_launch_config``: the launch must read it at each call."""
    seen = []

    def spy(*args):
        seen.append(args)
        return LaunchConfig(32, 64, 4, 1)

    monkeypatch.setattr(matmul, "_launch_config", spy)
    check_case(Case((64, 64), gate="silu"), 3, 64, torch.float32)
    assert seen == [(3, 64, 64, True, False, False, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["transposed", "column_slice", "strided_columns"])
def test_non_contiguous_rows(layout, dtype):
    """x is a view the kernel reads through its strides (no .contiguous() anywhere)."""
    rows, k = 5, 127
    g = torch.Generator().manual_seed(7)
    if layout == "transposed":  # [K, M] storage read as [M, K]: column stride M
        x = rand(k, rows, dtype=dtype, g=g).t()
    elif layout == "column_slice":  # row stride 2K
        x = rand(rows, 2 * k, dtype=dtype, g=g)[:, 3 : 3 + k]
    else:  # every other column: column stride 2
        x = rand(rows, 2 * k, dtype=dtype, g=g)[:, ::2]
    assert not x.is_contiguous()
    for prologue in ("rms", "layer"):  # both read x twice: statistics, then the blocks
        check_case(Case((64, 17), prologue, bias=True), rows, k, dtype, x=x)
    check_case(Case((64,), residual=True), rows, k, dtype, x=x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_a_3d_input(dtype):
    """[B, T, K] rows: outputs [B, T, N], the residual [B, T, N]; also a 3-D view whose
    leading dims are not one stride apart (a reshape copies it)."""
    out = check_case(Case((64, 17, 17), "rms"), (2, 3), 127, dtype)
    assert [o.shape for o in out] == [(2, 3, 64), (2, 3, 17), (2, 3, 17)]
    out = check_case(Case((64,), "layer", bias=True, residual=True), (3, 2), 64, dtype)
    assert out[0].shape == (3, 2, 64)
    x = rand(3, 2, 127, dtype=dtype).transpose(0, 1)  # [2, 3, K], batch stride K
    out = check_case(Case((127, 127), "rms", gate="silu"), (2, 3), 127, dtype, x=x)
    assert out[0].shape == (2, 3, 127)


@pytest.mark.parametrize("rows", [5, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weights_read_in_place_as_views(dtype, rows, launch_config):
    """Weights as slices of one fused [q; k; v] parameter (row offsets into one storage) and
    as a transposed view (stride 1 along N): read where they are; one row as GEMV too."""
    if rows == 1:
        launch_config(LaunchConfig(2, 64, 4, 1, gemv=True))
    k = 127
    g = torch.Generator().manual_seed(11)
    fused = rand(64 + 17 + 17, k, dtype=dtype, scale=k**-0.5, g=g)
    q, kk, v = fused[:64], fused[64:81], fused[81:]
    transposed = rand(k, 33, dtype=dtype, scale=k**-0.5, g=g).t()  # [33, K], strides (1, 33)
    norm_w = rand(k, dtype=dtype, g=g)
    x = rand(rows, k, dtype=dtype, g=g)
    group = MatmulGroup(siblings=3, norm="rms", eps=1e-6)
    norm = LlamaRMSNorm(k, eps=1e-6).to(DEVICE, dtype)
    norm.weight.data = norm_w
    with torch.no_grad():
        a = norm(x)
        expected = (F.linear(a, q), F.linear(a, kk), F.linear(a, v))
        actual = matmul_group(group, x, norm_w, None, None, q, kk, v)
        assert_close(actual, expected, **TOL[dtype])
        expected = (F.linear(x, transposed),)
        actual = matmul_group(MatmulGroup(), x, None, None, None, transposed)
        assert_close(actual, expected, **TOL[dtype])


_REFERENCE = matmul.reference  # the torch math (the autouse fixture makes it raise)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_of_a_gemma_norm_and_a_chunked_gate_up_weight(dtype, launch_config):
    # Gemma's (1 + weight) RMSNorm before one [gate; up] parameter (Phi-3's gate_up_proj),
    # one row as GEMV, against the group's torch math
    launch_config(LaunchConfig(2, 64, 4, 1, gemv=True))
    g = torch.Generator().manual_seed(12)
    k, n = 127, 40
    x = rand(1, k, dtype=dtype, g=g)
    norm_w = rand(k, dtype=dtype, scale=0.5, g=g)
    gate_up = rand(2 * n, k, dtype=dtype, scale=k**-0.5, g=g)
    group = MatmulGroup(siblings=2, norm="rms_offset", eps=1e-6, gate="gelu_tanh", chunked=True)
    weights, biases, _ = matmul._split_params(group, (gate_up,))
    with torch.no_grad():
        expected = _REFERENCE(group, x, norm_w, None, None, weights, biases)
        actual = matmul_group(group, x, norm_w, None, None, gate_up)
    assert actual[0].shape == (1, n)
    assert_close(actual, expected, **TOL[dtype])


def test_non_contiguous_residual():
    rows, k, n = 5, 64, 64
    module = Eager(Case((n,), residual=True), k, torch.float32, seed=2)
    x = rand(rows, k)
    residual = rand(n, rows).t()  # [M, N] with strides (1, M)
    with torch.no_grad():
        expected = module(x, residual)
    assert_close(module.fused(x, residual), expected, **TOL[torch.float32])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"norm": "rmsnorm"},
        {"norm": "batch"},
        {"gate": "relu"},
        {"gate": "swiglu", "siblings": 2},
        {"siblings": 0},
        {"siblings": 4},
        {"gate": "silu", "siblings": 1},
        {"gate": "silu", "siblings": 3},
        {"residual": True, "siblings": 2},
        {"residual": True, "siblings": 3},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_group_validation(kwargs):
    with pytest.raises(ValueError, match="MatmulGroup"):
        MatmulGroup(**kwargs)


def test_group_validation_accepts_the_valid_ones():
    for norm, gate, siblings, residual in itertools.product(NORMS, GATES, (1, 2, 3), (False, True)):
        ok = (not gate or siblings == 2) and (not residual or siblings == 1 or gate)
        if ok:
            assert MatmulGroup(siblings=siblings, norm=norm, gate=gate, residual=residual)
        else:
            with pytest.raises(ValueError):
                MatmulGroup(siblings=siblings, norm=norm, gate=gate, residual=residual)


@pytest.mark.parametrize("gate", ["silu", "gelu_tanh"])
def test_gate_with_residual(gate):
    """act(gate(a)) * up(a) + residual: the MLP's output and the residual stream in one."""
    check_case(Case((64, 64), "rms", gate=gate, residual=True), 2, 64, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_rows(dtype, monkeypatch):
    """No rows: empty outputs of the right shapes and dtype (the torch path answers)."""
    monkeypatch.undo()  # the torch reference is the answer here
    case = Case((64, 17, 17), "layer", bias=True)
    actual, expected = run_case(case, (0,), 64, dtype)
    assert [o.shape for o in actual] == [(0, 64), (0, 17), (0, 17)]
    assert_close(actual, expected, **TOL[dtype])
    actual, expected = run_case(Case((64,), residual=True), (2, 0), 64, dtype)
    assert actual[0].shape == (2, 0, 64)
    assert_close(actual, expected, **TOL[dtype])


def test_gelu_new_rounds_where_eager_rounds_op_by_op():
    # Through an identity weight the linear is exact, so the activation alone is compared:
    # NewGELU's 8 ops each round to fp16 in eager, and so does the kernel. Rounded once at
    # the end instead (the tanh GELU formula), 49% of these values come out 1 ulp apart.
    k = 64
    x = torch.linspace(-5, 5, 16 * k).reshape(16, k).to(torch.float16).to(DEVICE)
    weight = torch.eye(k, dtype=torch.float16, device=DEVICE)
    (got,) = matmul_group(MatmulGroup(activation="gelu_new"), x, None, None, None, weight)
    want = ACT2FN["gelu_new"](x)
    apart = (got != want).float().mean().item()
    assert apart < 0.05, apart  # tanh's last fp32 bit may differ between implementations
    assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_gpt2_projections_stored_kn(rows, dtype):
    # GPT-2's Conv1D blocks under the default configs, weights [K, N] as Conv1D stores them:
    # ln_1 + c_attn, ln_2 + c_fc + NewGELU, the MLP's and the attention's c_proj + residual
    blocks = [
        (Case((2304,), "layer", bias=True, layout="kn"), 768),
        (Case((3072,), "layer", bias=True, activation="gelu_new", layout="kn"), 768),
        (Case((768,), bias=True, residual=True, layout="kn"), 3072),
        (Case((768,), bias=True, residual=True, layout="kn"), 768),
    ]
    for case, k in blocks:
        x = rand(rows, k, dtype=dtype)
        weights = (rand(k, case.widths[0], dtype=dtype).t(),)
        _, _, meta, _ = matmul._launch(case.group(1e-5), x, None, None, None, weights, ())
        assert meta["W_KN"] == (rows == 1), meta  # one row: the GEMV along N
        check_case(case, rows, k, dtype, seed=k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 5])
def test_gpu_residual_tails(rows, dtype):
    """An activation of the residual sum in the launch, as GEMV (one row) and on tensor
    cores, under the default configs."""
    cases = [(Case((384,), bias=True, residual=True, residual_tail="gelu"), 384),
             (Case((1000,), "layer", residual=True, residual_tail="relu"), 768)]  # fmt: skip
    for case, k in cases:
        check_case(case, rows, k, dtype, seed=k)
