"""Fused groups under Dynamo's dynamic shapes (``dynamic=True``): norms whose ``eps`` arrives
as a graph input still fuse (the kernel reads it as a scalar argument at each call), and a new
sequence length costs no new Triton compile beyond the launch configs the rows ask for, and
no full planning of the launch."""

from __future__ import annotations

import helpers
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import TritonCompiles, assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import fusebackend
import fusebackend.kernels.launch as launch

transformers = pytest.importorskip("transformers")


def _bert(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=80, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BertModel(config).eval().to(dtype)


def _batch(length: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 101, (3, length), generator=g)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, length // 2 :] = 0  # right padding
    mask[2, -1:] = 0
    return ids, mask


def _compiled_groups(model: nn.Module, dynamic: bool, lengths, g) -> list:
    compiled = torch.compile(model, backend="infinifuse", dynamic=dynamic,
                             options={"validate": False})  # fmt: skip
    for length in lengths:
        ids, mask = _batch(length, g)
        with torch.no_grad():
            actual = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert_close(actual, expected)  # the dtype's tolerance (helpers.TOLERANCES)
    report = fusebackend.last_report()
    helpers.assert_fused(report)
    # row groups: static shapes also run the pooler's dense + tanh as a matmul group
    return helpers.row_groups(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_bert_under_dynamic_true_fuses_its_norms_as_the_static_graph_does(dtype):
    # Dynamo passes nn.LayerNorm.eps (and dropout's p) into a dynamic graph as inputs; the
    # norms used to be rejected ("eps is not a Python number"): 1 group instead of 5.
    g = torch.Generator().manual_seed(1)
    model = _bert(dtype)
    static = _compiled_groups(model, False, [7], g)
    # (static shapes only: the token types gathered from a buffer by the position ids, and
    # their lookup, are work on buffers alone, folded out of the embeddings' group)
    folded = fusebackend.last_report().graphs[-1].rewrites.get("parameter_work", [])
    assert folded == ["token_type_embeddings"], folded
    torch._dynamo.reset()
    dynamic = _compiled_groups(model, True, [7, 13, 33], g)
    norms = [grp for grp in dynamic if grp.reductions]  # every norm runs in a kernel
    static_norms = [grp for grp in static if grp.reductions]
    assert len(norms) == len(static_norms) == 5, [grp.nodes for grp in dynamic]
    # the padding mask: at static shapes its cast, & and additive conversion (shared by the
    # layers' attention calls) are one group; under dynamic shapes its comparison (a
    # constant of each static signature), cast and & are
    (static_mask,) = [grp for grp in static if not grp.reductions]
    assert any("where" in n for n in static_mask.nodes), static_mask.nodes
    (mask,) = [grp for grp in dynamic if not grp.reductions]
    assert "ge" in mask.nodes and "and_" in mask.source.replace("logical_and", "and_"), mask.source
    assert [len(grp.nodes) for grp in norms] == [len(static_norms[0].nodes) + 1] + [
        len(grp.nodes) for grp in static_norms[1:]
    ]
    assert not any("eps" in r.reason for r in fusebackend.last_report().rejections)
    assert "a number read at each call" in norms[0].source  # eps: a kernel argument


def test_a_graph_input_eps_is_read_at_each_call():
    # The eps of a dynamic graph is an input, not a constant of the kernel: a module whose
    # eps changes after the compile gets the new one (Dynamo does not recompile for it).
    g = torch.Generator().manual_seed(2)
    norm = nn.LayerNorm(37).eval()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(37, generator=g))
        norm.bias.copy_(torch.randn(37, generator=g))

    def fn(x, y):
        return norm(x * 2 + y) * 3

    compiled = torch.compile(fn, backend="infinifuse", dynamic=True,
                             options={"validate": False, "cudagraphs": False})  # fmt: skip
    for length, eps in ((7, 1e-5), (13, 0.25), (13, 4.0)):
        norm.eps = eps
        x = torch.randn(2, length, 37, generator=g) * 0.1  # small rows: eps matters
        y = torch.randn(2, length, 37, generator=g) * 0.1
        with torch.no_grad():
            assert_close(compiled(x, y), fn(x, y))
    group = helpers.single_group(fusebackend.last_report())
    assert group.reductions and "a number read at each call" in group.source


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_rms_norm_with_a_graph_input_eps_in_other_dtypes(dtype):
    g = torch.Generator().manual_seed(3)
    norm = nn.RMSNorm(24, eps=1e-3).to(dtype)

    def fn(x, y):
        return norm(x + y) * 2

    compiled = torch.compile(fn, backend="infinifuse", dynamic=True,
                             options={"validate": False, "cudagraphs": False})  # fmt: skip
    for length in (5, 11):
        x = torch.randn(3, length, 24, generator=g).to(dtype) * 0.05
        y = torch.randn(3, length, 24, generator=g).to(dtype) * 0.05
        with torch.no_grad():
            assert_close(compiled(x, y), fn(x, y))
    group = helpers.single_group(fusebackend.last_report())
    assert group.reductions
    if dtype == torch.float64:  # an fp64 program takes its eps in fp64
        assert "tl.float64,  # a number read at each call" in group.source


class _Embeddings(nn.Module):
    """BERT's embeddings spelled out: three lookups (position and token-type ids from
    buffers, sliced to the length), a sum, a LayerNorm, a residual add and a second norm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.word = nn.Embedding(101, width)
        self.position = nn.Embedding(64, width)
        self.token_type = nn.Embedding(2, width)
        self.register_buffer("position_ids", torch.arange(64)[None])
        self.register_buffer("token_type_ids", torch.zeros(1, 64, dtype=torch.long))
        self.norm = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        types = self.token_type_ids[:, :length].expand(batch, length)
        h = self.word(ids) + self.token_type(types) + self.position(self.position_ids[:, :length])
        return self.norm2(self.norm(h) + x) * 2


LENGTHS = [7, 13, 33, 2, 3, 5, 9, 16, 17, 31, 32, 48, 11, 19, 23, 29, 37, 41, 47, 63]


@pytest.mark.parametrize("width", [48, 37])
def test_new_lengths_compile_no_binary_beyond_the_launch_configs(width):
    # 20 lengths through one fused chain of a dynamic graph. Triton compiles a binary per
    # specialisation of the kernel's arguments: the row counts and sizes are not
    # specialised, nor the strides of the index tensors that scale with the length ([B, T]
    # ids against [1, T] positions: a stride of T, divisible by 16 or not), so only a new
    # launch config (configs.py: the rows per program follow the row count up to their cap)
    # compiles anew. Odd widths (37) keep the strides of row tensors specialised: T * 37 is
    # divisible by 16 for some lengths only, and those binaries count apart.
    g = torch.Generator().manual_seed(4)
    model = _Embeddings(width).eval()
    compiled = torch.compile(model, backend="infinifuse", dynamic=True,
                             options={"validate": False, "cudagraphs": False})  # fmt: skip
    with torch.no_grad(), TritonCompiles() as compiles:
        for length in LENGTHS:
            ids = torch.randint(0, 101, (2, length), generator=g)
            x = torch.randn(2, length, width, generator=g)
            assert_close(compiled(ids, x), model(ids, x))
    report = fusebackend.last_report()
    helpers.assert_fused(report)
    assert len(report.graphs) == 1  # one dynamic graph served every length
    group = helpers.single_group(report)
    assert len(group.lookups) == 3 and len(group.reductions) == 2, group.nodes
    assert len(compiles.keys) == len(LENGTHS)
    configs = {(key[0], key[1][-4:], key[2]) for key in compiles.distinct}  # constexprs, warps
    if width % 16 == 0:
        assert len(compiles.distinct) == len(configs), sorted(compiles.distinct)
    else:
        assert len(compiles.distinct) <= 2 * len(configs)
    # the configs are configs.py's, by rows: 2 x length rows, up to 32 rows of 64 columns
    aligned = width % 16 == 0  # rows of 37 start off the 16-element grid (configs.py)
    blocks = {
        launch.launch_config(2 * n, width, "persistent", True, aligned=aligned) for n in LENGTHS
    }
    assert len(configs) == len(blocks) <= 5


def test_the_kernel_of_a_dynamic_graph_is_the_one_triton_compiles_once_per_config():
    # The same check on the launcher alone, for a rank-2 kernel whose index stride is the
    # length: one binary for every length of one launch config.
    from fusebackend.kernels import Instr, Lookup, RowProgram, ValueRef

    program = RowProgram(
        input_dtypes=(torch.int64, torch.float32, torch.int64, torch.float32),
        lookups=(Lookup(0, 1), Lookup(2, 3)),
        instrs=(
            Instr("add", (ValueRef(0), ValueRef(1)), torch.float32),
            Instr("mul", (ValueRef(2), ValueRef(2)), torch.float32),
        ),  # fmt: skip
        outputs=(3,),
    )
    g = torch.Generator().manual_seed(5)
    word, pos = torch.randn(50, 64, generator=g), torch.randn(64, 64, generator=g)
    plans: dict = {}
    with TritonCompiles() as compiles:
        for length in (16, 17, 32, 33, 40):  # 8 x length rows: one config (16 rows of 64)
            ids = torch.randint(0, 50, (8, length), generator=g)
            positions = torch.arange(length)[None]
            (out,) = launch.row_kernel(program, [ids, word, positions, pos], plans=plans)
            expected = F.embedding(ids, word) + F.embedding(positions, pos)
            assert_close(out, expected * expected)
    assert len(compiles.keys) == 5 and len(compiles.distinct) == 1, compiles.distinct


def test_a_new_length_plans_its_launch_from_the_recipe_of_its_pattern(monkeypatch):
    # The broadcast of every value of the program (value_shapes) is derived once per input
    # pattern; each further length only reads its sizes and strides.
    derived = []
    real = launch.value_shapes
    monkeypatch.setattr(launch, "value_shapes", lambda *a: derived.append(1) or real(*a))
    g = torch.Generator().manual_seed(6)
    model = _Embeddings(48).eval()
    compiled = torch.compile(model, backend="infinifuse", dynamic=True,
                             options={"validate": False, "cudagraphs": False})  # fmt: skip
    with torch.no_grad():
        for i, length in enumerate(LENGTHS):
            ids = torch.randint(0, 101, (2, length), generator=g)
            x = torch.randn(2, length, 48, generator=g)
            assert_close(compiled(ids, x), model(ids, x))
            if i == 0:
                assert derived  # the first launch (and the compile's report) derive it
                derived.clear()
    helpers.assert_fused(fusebackend.last_report())
    assert not derived  # 19 new lengths, no derivation


def _broadcast_program():
    """v0 = table[ids]; v1 = v0 * a (a row operand, [T, D] against [B, T] rows);
    v2 = v1 + b ([B, 1, 1]: narrow); v3 = mean(v2); v4 = v2 - v3 -> outputs v4, v3."""
    from fusebackend.kernels import InputRef, Instr, Lookup, Reduce, RowProgram, ValueRef

    f32 = torch.float32
    return RowProgram(
        input_dtypes=(torch.int64, f32, f32, f32),
        lookups=(Lookup(0, 1),),
        instrs=(
            Instr("mul", (ValueRef(0), InputRef(2)), f32),
            Instr("add", (ValueRef(1), InputRef(3)), f32),
            Reduce("mean", ValueRef(2), f32),
            Instr("sub", (ValueRef(2), ValueRef(3)), f32),
        ),  # fmt: skip
        outputs=(4, 3),
        narrow_inputs=frozenset({3}),
    )


def _broadcast_inputs(length: int, g: torch.Generator, transposed: bool = False):
    ids = torch.randint(0, 30, (3, length), generator=g)
    if transposed:
        a = torch.randn(13, length, generator=g).t()
    else:
        a = torch.randn(length, 13, generator=g)
    return [ids, torch.randn(30, 13, generator=g), a, torch.randn(3, 1, 1, generator=g)]


@pytest.mark.parametrize("transposed", [False, True])
def test_a_recipe_gives_the_launch_that_the_full_derivation_gives(transposed):
    g = torch.Generator().manual_seed(7)
    program = _broadcast_program()
    recipes: dict = {}
    launch._prepare(program, _broadcast_inputs(5, g, transposed), recipes)
    assert len(recipes) == 1 and None not in recipes.values()
    for length in (2, 7, 16, 33):
        inputs = _broadcast_inputs(length, g, transposed)
        assert launch._prepare(program, inputs, recipes) == launch._prepare(program, inputs)
    ids, table, a, b = _broadcast_inputs(9, g, transposed)
    plans: dict = {}
    for _ in range(2):  # the launch planned, then the kept one
        out, mean = launch.row_kernel(program, [ids, table, a, b], plans=plans)
    v2 = F.embedding(ids, table) * a + b
    expected_mean = v2.mean(-1, keepdim=True)
    assert_close((out, mean), (v2 - expected_mean, expected_mean))


def test_a_size_that_does_not_broadcast_raises_as_eager_does_past_the_recipe():
    g = torch.Generator().manual_seed(8)
    program = _broadcast_program()
    plans: dict = {}
    launch.row_kernel(program, _broadcast_inputs(5, g), plans=plans)
    ids, table, a, b = _broadcast_inputs(6, g)
    with pytest.raises(RuntimeError, match="cannot be broadcast"):
        launch.row_kernel(program, [ids, table, a[:5], b], plans=plans)  # the same pattern


def test_past_the_cap_the_oldest_signature_goes_and_recent_ones_stay(monkeypatch):
    # Dynamic shapes bring a new signature per length; the kept launches were all dropped
    # at the cap, so every recent length planned again.
    made = []
    real = launch._make_plans
    monkeypatch.setattr(launch, "_make_plans", lambda *a: made.append(1) or real(*a))
    monkeypatch.setattr(launch, "run_on_device", lambda *a: None)  # planning only
    program, g = _broadcast_program(), torch.Generator().manual_seed(9)
    plans: dict = {}
    lengths = range(2, launch._MAX_PLANS + 12)
    for length in lengths:
        launch.row_kernel(program, _broadcast_inputs(length, g), plans=plans)
    assert len(made) == len(lengths) and len(plans) <= launch._MAX_PLANS
    for length in lengths[-20:]:  # recent lengths: kept
        launch.row_kernel(program, _broadcast_inputs(length, g), plans=plans)
    assert len(made) == len(lengths)
    launch.row_kernel(program, _broadcast_inputs(2, g), plans=plans)  # the oldest: gone
    assert len(made) == len(lengths) + 1


def test_a_dynamic_graph_precompiles_the_binary_its_first_call_launches(monkeypatch):
    # fusion.precompile skipped symbolic shapes: a dynamic graph compiled its kernels one
    # by one at their first launches. With its example values' hints (the traced call's
    # sizes) the warm-up compiles the binary that call launches, and a later length of the
    # same launch config launches it too. (CUDA tensors only: here the CPU's are let in.)
    import fusebackend.row_ops as row_ops

    asked = []

    def on_cpu(values):
        asked.append(launch.hinted_examples(values))  # not CUDA tensors: None
        return launch.hinted_examples(values, device_type="cpu")

    monkeypatch.setattr(row_ops, "hinted_examples", on_cpu)
    g = torch.Generator().manual_seed(10)
    model = _Embeddings(48).eval()
    compiled = torch.compile(model, backend="infinifuse", dynamic=True,
                             options={"validate": False, "cudagraphs": False})  # fmt: skip
    ids, x = torch.randint(0, 101, (2, 21), generator=g), torch.randn(2, 21, 48, generator=g)
    with torch.no_grad(), TritonCompiles() as compiles:
        compiled(ids, x)  # compiles the graph: its fused node's example values are symbolic
        compiled(ids[:, :19].clone(), x[:, :19].clone())  # another length, the same config
    assert asked == [None]  # one fused node, not of static shapes
    helpers.assert_fused(fusebackend.last_report())
    assert len(compiles.warmed) == 1 and len(compiles.keys) == 2
    assert set(compiles.keys) == set(compiles.warmed), (compiles.keys, compiles.warmed)


def _binaries() -> int:
    """Binaries Triton has compiled (or loaded) for the row kernels made so far (GPU)."""
    return sum(len(caches[0]) for kernel in launch._KERNELS.values()
               for caches in getattr(kernel, "device_caches", {}).values())  # fmt: skip


def _binaries_per_config(report, compiles) -> tuple[int, int]:
    """Check the binaries Triton would compile for a dynamic BERT's launches; return (launch
    configs of the norm groups, launch configs of the padding mask's group).

    Each norm group's kernel needs one binary per launch config (none per length). The
    mask's rows are the length wide: Triton specialises that width and the mask's strides on
    divisibility by 16, so its kernel needs at most two per launch config (two classes of
    lengths), never one per length."""
    # embeddings + norm and 4 residual + norm groups; the rest start from the padding mask
    norms = [grp for grp in report.groups if grp.reductions]
    assert len(norms) == 5 and all(grp.backend == "triton" for grp in report.groups)
    masks = [grp for grp in report.groups if not grp.reductions]
    assert masks and all(map(_reads_ints_or_bools, masks)), str(report)
    mask_kernels = {grp.kernel_name for grp in masks}

    def config(key: tuple) -> tuple:
        return key[0], key[1][-4:], key[2]

    strict = [key for key in compiles.keys if key[0] not in mask_kernels]
    configs = set(map(config, strict))
    assert strict and len(set(strict)) == len(configs)
    loose = [key for key in compiles.keys if key[0] in mask_kernels]
    mask_configs = set(map(config, loose))
    assert loose and len(set(loose)) <= 2 * len(mask_configs), sorted(set(loose))
    return len(configs), len(mask_configs)


def test_bert_under_dynamic_true_compiles_per_launch_config_not_per_length():
    # Triton's binaries, counted by its own specialisation rules while the interpreter runs
    # the kernels: lengths on both sides of multiples of 16.
    g = torch.Generator().manual_seed(11)
    compiled = torch.compile(_bert(torch.float16), backend="infinifuse", dynamic=True)
    with torch.no_grad(), TritonCompiles() as compiles:
        for length in (7, 13, 16, 33, 32):
            ids, mask = _batch(length, g)
            compiled(input_ids=ids, attention_mask=mask)
    _binaries_per_config(fusebackend.last_report(), compiles)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bert_under_dynamic_true_on_the_gpu_compiles_per_launch_config_not_per_length():
    # Triton's own kernel caches: over 12 lengths of a dynamic graph, each row kernel holds a
    # binary per launch config its launches used (the padding mask's kernel two at most:
    # ``_binaries_per_config``), none per length.
    g = torch.Generator().manual_seed(11)
    model = _bert(torch.float16).cuda()
    compiled = torch.compile(model, backend="infinifuse", dynamic=True)
    before = _binaries()
    lengths = [7, 13, 33, 9, 16, 17, 31, 32, 48, 11, 47, 63]
    with torch.no_grad(), TritonCompiles() as compiles:
        for length in lengths:
            ids, mask = (t.cuda() for t in _batch(length, g))
            actual = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
            expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
            assert_close(actual, expected, atol=2e-2, rtol=2e-2)  # fp16 through 2 layers
    norm_configs, mask_configs = _binaries_per_config(fusebackend.last_report(), compiles)
    assert _binaries() - before <= norm_configs + 2 * mask_configs


def _reads_ints_or_bools(group) -> bool:
    """Does the group's kernel read an integer or bool tensor as an operand (its docs)?"""
    return "operand (torch.int" in group.source or "operand (torch.bool" in group.source


def test_tiny_llama_under_dynamic_true_fuses_as_the_static_graph_does():
    # transformers' LlamaRMSNorm adds self.variance_epsilon, a graph input under dynamic
    # shapes, in an elementwise add: it split each norm into two groups ("operand item_2 is
    # a symbolic scalar"), 16 groups instead of 13.
    g = torch.Generator().manual_seed(12)
    torch.manual_seed(0)
    model = transformers.LlamaModel(helpers.tiny_llama_config()).eval()
    groups = {}
    for dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="infinifuse", dynamic=dynamic,
                                 options={"validate": False})  # fmt: skip
        for length in (7, 13):
            ids = torch.randint(0, 97, (2, length), generator=g)
            mask = torch.ones(2, length, dtype=torch.long)
            mask[1, :3] = 0  # left padding
            with torch.no_grad():
                actual = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
                expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
            assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        report = fusebackend.last_report()
        helpers.assert_fused(report)
        # copies run as row kernels need static layouts (passes/lone_copies.py): the static
        # graph's repeat_kv copies are groups of their own, the dynamic graph's stay ATen's
        alone = {n for g in report.graphs for n in g.rewrites.get("copies_as_row_kernels", [])}
        # The padding mask and the rotary positions start from integer and bool tensors. At
        # static shapes the positions are constants of each signature and the padding mask
        # (cast, &, additive conversion) one group; under dynamic shapes both are groups.
        from_ints = [grp.nodes for grp in report.groups if _reads_ints_or_bools(grp)]
        assert len(from_ints) == (2 if dynamic else 1), from_ints
        kept = [grp for grp in report.groups if not set(grp.nodes) <= alone]
        groups[dynamic] = [grp.nodes for grp in kept if not _reads_ints_or_bools(grp)]
        if not dynamic:  # the rotary tables of constant positions, derived once
            folded = {n for g in report.graphs for n in g.rewrites.get("parameter_work", [])}
    # the dynamic graph computes those tables in a group of its own each call
    tables = [n for n in groups[True] if set(n) & folded]
    assert len(tables) == 1, (folded, groups[True])
    rest = [len(n) for n in groups[True] if n not in tables]
    assert rest == [len(n) for n in groups[False]], groups
    assert not any("symbolic scalar" in r.reason for r in fusebackend.last_report().rejections)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 0.5
        self.shift = 3

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.scale + y) - self.shift


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_float_attributes_in_arithmetic_are_read_at_each_call(dtype):
    g = torch.Generator().manual_seed(13)
    module = _Scaled()
    compiled = torch.compile(module, backend="infinifuse", dynamic=True,
                             options={"validate": False, "cudagraphs": False})  # fmt: skip
    for length, scale in ((5, 0.5), (9, -1.75), (9, 1 / 3)):
        module.scale = scale
        x = torch.randn(2, length, 19, generator=g).to(dtype)
        y = torch.randn(2, length, 19, generator=g).to(dtype)
        with torch.no_grad():
            assert_close(compiled(x, y), module(x, y))
    group = helpers.single_group(fusebackend.last_report())
    assert len(group.nodes) == 4, group.nodes
    assert "a number read at each call" in group.source


def test_a_comparison_with_a_graph_number_stays_unfused():
    # eager rounds a number to the tensor's dtype before comparing; a value known at run
    # time only cannot be rounded in the program
    module = _Scaled()

    def fn(x):
        return torch.where(x > module.scale, x * 2, x + 1)

    compiled = torch.compile(fn, backend="infinifuse", dynamic=True,
                             options={"validate": False, "cudagraphs": False})  # fmt: skip
    x = torch.randn(3, 7, 5)
    with torch.no_grad():
        assert_close(compiled(x), fn(x))
    group = helpers.single_group(fusebackend.last_report())
    assert group.nodes == ("mul", "add", "where"), group.nodes  # the comparison stays out


def test_the_torch_reference_of_a_group_takes_its_graph_numbers(monkeypatch):
    # Where Triton cannot run, a fused group runs its torch ops (reference_graph): with the
    # eps and the dropout p of a dynamic graph as inputs it must give eager's result.
    import fusebackend.backend as backend

    ran = []

    def by_reference(self, *inputs):
        ran.append(self.program.scalar_inputs)
        return tuple(self.reference(*inputs))

    monkeypatch.setattr(backend.FusedGroupOp, "__call__", by_reference)
    g = torch.Generator().manual_seed(14)
    _compiled_groups(_bert(), True, [7, 13], g)
    # every norm's group read a graph number (its eps); the padding mask's group has none
    assert sum(1 for scalars in ran if scalars) >= 5 and len(ran) - sum(map(bool, ran)) <= 2


def test_the_report_names_the_kernels_a_dynamic_graph_launches(monkeypatch):
    # The launcher collapses contiguous lead dims ([B, T, D] rows run the rank-1 kernel);
    # explain named the traced rank's kernel where sizes were symbolic or a group read a
    # graph number, so a profile showed a kernel explain did not list.
    launched = set()
    real = launch.run_on_device

    def spy(kernel, *args):
        launched.add(getattr(kernel, "__name__", None) or kernel.fn.__name__)
        return real(kernel, *args)

    monkeypatch.setattr(launch, "run_on_device", spy)
    groups = _compiled_groups(_bert(), True, [7, 13], torch.Generator().manual_seed(16))
    named = {grp.kernel_name for grp in groups}
    assert launched == named, (launched, named)
    for grp in groups:
        assert f"def {grp.kernel_name}(" in grp.source


_sizes = st.lists(st.sampled_from([0, 1, 2, 3, 5]), max_size=4)


@settings(max_examples=200, deadline=None)
@given(size=_sizes, extra=_sizes, data=st.data())
def test_computed_strides_agree_with_torch(size, extra, data):
    # The launcher computes what it used to ask torch for (expand, a fresh tensor's strides)
    t = torch.empty(size)
    assert launch._contiguous_strides(size) == t.stride()
    if t.dim() > 1:
        t = t.transpose(0, -1)
    target = [data.draw(st.sampled_from([n, 4])) if n == 1 else n for n in t.shape]
    target = [*extra, *target]
    assert launch._expand_strides(t.shape, t.stride(), target) == t.expand(target).stride()
