"""FusionConfig: defaults, validation of every option, unknown options, immutability."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusebackend import FusionConfig
from fusebackend.config import valid_option_names

ALL_OPTIONS = [
    "fusion",
    "cudagraphs",
    "warmup_iterations",
    "max_graphs",
    "graph_memory",
    "capture_on_call",
    "batch_buckets",
    "length_buckets",
    "static_outputs",
    "validate",
    "index_checks",
    "round_intermediates",
    "rewrites",
    "matmul_groups",
    "channels_last",
]


def test_defaults():
    cfg = FusionConfig()
    assert cfg.fusion is True
    assert cfg.cudagraphs is None
    assert cfg.warmup_iterations == 1
    assert cfg.max_graphs is None  # no count cap: graph_memory bounds the captured entries
    assert cfg.graph_memory == 2 << 30
    assert cfg.capture_on_call is None  # decided per signature (runtime/recurrence.py)
    assert cfg.batch_buckets is None
    assert cfg.length_buckets is None
    assert cfg.static_outputs is False
    assert cfg.validate is True
    assert cfg.index_checks is True
    assert cfg.round_intermediates is True
    assert cfg.rewrites is True


def test_valid_option_names_are_the_fields():
    assert valid_option_names() == ALL_OPTIONS


@pytest.mark.parametrize("options", [None, {}])
def test_from_options_empty_gives_defaults(options):
    assert FusionConfig.from_options(options) == FusionConfig()


def test_from_options_passes_a_config_through():
    cfg = FusionConfig(max_graphs=3)
    assert FusionConfig.from_options(cfg) is cfg


def test_from_options_sets_every_option():
    options = {
        "fusion": False,
        "cudagraphs": True,
        "warmup_iterations": 3,
        "max_graphs": 2,
        "graph_memory": 1 << 20,
        "capture_on_call": 3,
        "batch_buckets": [1, 4, 16],
        "length_buckets": [16, 32],
        "static_outputs": True,
        "validate": False,
        "index_checks": False,
        "round_intermediates": False,
        "rewrites": False,
    }
    cfg = FusionConfig.from_options(options)
    for name, value in options.items():
        expected = tuple(value) if name.endswith("_buckets") else value
        assert getattr(cfg, name) == expected, name
    assert isinstance(cfg.batch_buckets, tuple)  # lists are frozen into tuples
    assert isinstance(cfg.length_buckets, tuple)


@pytest.mark.parametrize(
    "name",
    [
        "fusion",
        "static_outputs",
        "validate",
        "index_checks",
        "round_intermediates",
        "rewrites",
        "matmul_groups",
    ],  # fmt: skip
)
@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0])
def test_bool_options_reject_non_bools(name, bad):
    with pytest.raises(ValueError, match=rf"'{name}' must be a bool") as info:
        FusionConfig.from_options({name: bad})
    assert repr(bad) in str(info.value)  # names what was given
    assert "valid options" in str(info.value)


@pytest.mark.parametrize("value", [None, True, False])
def test_cudagraphs_accepts_bool_or_none(value):
    assert FusionConfig(cudagraphs=value).cudagraphs is value


@pytest.mark.parametrize("bad", [1, "auto", 0.0])
def test_cudagraphs_rejects_other_values(bad):
    with pytest.raises(ValueError, match="'cudagraphs' must be a bool or None"):
        FusionConfig.from_options({"cudagraphs": bad})


@pytest.mark.parametrize("name", ["warmup_iterations", "max_graphs", "capture_on_call"])
@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "2", None])
def test_positive_int_options_reject_bad_values(name, bad):
    if name in ("max_graphs", "capture_on_call") and bad is None:
        # max_graphs: no count cap; capture_on_call: decided per signature
        assert getattr(FusionConfig.from_options({name: bad}), name) is None
        return
    with pytest.raises(ValueError, match=rf"'{name}' must be an int >= 1") as info:
        FusionConfig.from_options({name: bad})
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1GB"])
def test_graph_memory_rejects_what_is_not_a_byte_count(bad):
    with pytest.raises(ValueError, match=r"'graph_memory' must be a number of bytes") as info:
        FusionConfig.from_options({"graph_memory": bad})
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("good", [0, 1 << 30, None])
def test_graph_memory_accepts_bytes_or_none(good):
    assert FusionConfig(graph_memory=good).graph_memory == good


@pytest.mark.parametrize("name", ["warmup_iterations", "max_graphs", "capture_on_call"])
def test_positive_int_options_accept_ints(name):
    assert getattr(FusionConfig.from_options({name: 1}), name) == 1
    assert getattr(FusionConfig.from_options({name: 100}), name) == 100


@pytest.mark.parametrize("good", [[1], (1, 2, 4), [8, 16, 32, 64]])
def test_batch_buckets_accepts_increasing_ints(good):
    assert FusionConfig(batch_buckets=good).batch_buckets == tuple(good)


@pytest.mark.parametrize(
    "bad", [[], [0], [-1, 2], [2, 1], [1, 1], [1, 2.0], [1, True], 4, "1,2", [None]]
)
@pytest.mark.parametrize("name", ["batch_buckets", "length_buckets"])
def test_buckets_reject_bad_values(bad, name):
    with pytest.raises(ValueError, match=f"'{name}' must be a strictly increasing list"):
        FusionConfig.from_options({name: bad})


@pytest.mark.parametrize("good", [[16], (16, 32, 64, 128, 256, 512)])
def test_length_buckets_accepts_increasing_ints(good):
    assert FusionConfig(length_buckets=good).length_buckets == tuple(good)


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError) as info:
        FusionConfig.from_options({"fuse": True, "max_graph": 2})
    message = str(info.value)
    assert "'fuse'" in message and "'max_graph'" in message
    for name in ALL_OPTIONS:
        assert name in message


def test_unknown_option_with_a_non_string_key_is_a_value_error():
    # A user passing {1: ...} next to a misspelt name must still get the ValueError that
    # names the unknown options, not a TypeError from sorting mixed key types.
    with pytest.raises(ValueError, match="unknown infinifuse option"):
        FusionConfig.from_options({1: True, "bogus": 2})


def test_options_must_be_a_mapping():
    with pytest.raises(TypeError, match="must be a dict, got list") as info:
        FusionConfig.from_options([("fusion", False)])
    assert "valid options" in str(info.value)


def test_config_is_frozen_and_hashable():
    cfg = FusionConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.fusion = False  # type: ignore[misc]
    assert hash(cfg) == hash(FusionConfig())
    assert hash(FusionConfig(batch_buckets=[1, 2])) == hash(FusionConfig(batch_buckets=(1, 2)))


def test_replace_validates_and_keeps_the_original():
    cfg = FusionConfig()
    changed = cfg.replace(max_graphs=4)
    assert changed.max_graphs == 4 and cfg.max_graphs is None
    with pytest.raises(ValueError, match="max_graphs"):
        cfg.replace(max_graphs=0)


def test_torch_compile_reports_the_bad_option_by_name():
    # The backend validates on the first call; Dynamo wraps the ValueError but keeps its text.
    compiled = torch.compile(lambda x: x * 2, backend="infinifuse", options={"max_graphs": 0})
    with pytest.raises(Exception, match="'max_graphs' must be an int >= 1"):
        compiled(torch.randn(3))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2, backend="infinifuse", options={"warmup": 1})
    with pytest.raises(Exception, match=r"unknown infinifuse option\(s\) \['warmup'\]"):
        compiled(torch.randn(3))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"length_buckets": [32, 16]}, "'length_buckets' must be a strictly increasing list"),
        ({"capture_on_call": 0}, "'capture_on_call' must be an int >= 1"),
        ({"graph_memory": "2GB"}, "'graph_memory' must be a number of bytes"),
    ],
)
def test_torch_compile_reports_the_new_options_by_name(options, message):
    compiled = torch.compile(lambda x: x * 2, backend="infinifuse", options=options)
    with pytest.raises(Exception, match=message):
        compiled(torch.randn(3))
