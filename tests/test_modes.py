"""torch.compile's modes (backend._apply_mode): accepted, and what they change."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import fusebackend.backend
from fusebackend.backend import infinifuse
from fusebackend.config import FusionConfig
from tests.helpers import assert_close, rand_ids, rand_table


def _step(ids, table):
    return torch.nn.functional.embedding(ids, table) * 3.0 - 1.0


def _configs_seen(fn, *args, **compile_kwargs) -> list[FusionConfig]:
    """Compile and run ``fn``; return the config of every GraphCache the backend built."""
    seen = []
    real = fusebackend.backend.GraphCache

    def spy(**kwargs):
        seen.append(kwargs["config"])
        return real(**kwargs)

    with mock.patch.object(fusebackend.backend, "GraphCache", spy), torch.no_grad():
        out = torch.compile(fn, backend="infinifuse", **compile_kwargs)(*args)
    assert_close(out, fn(*args))
    return seen


@pytest.mark.parametrize(
    "mode, cudagraphs",
    [
        (None, None),
        ("default", None),
        ("reduce-overhead", None),
        ("max-autotune", None),
        ("max-autotune-no-cudagraphs", False),
    ],
)
def test_torch_compile_modes_are_accepted(mode, cudagraphs):
    g = torch.Generator().manual_seed(1)
    args = (rand_ids(13, (2, 5), g=g), rand_table(13, 7, g=g))
    (config,) = _configs_seen(_step, *args, mode=mode)
    assert config.cudagraphs is cudagraphs


def test_unknown_mode_names_the_valid_ones():
    compiled = torch.compile(lambda x: x * 2, backend="infinifuse", mode="fastest")
    with pytest.raises(Exception, match="unknown torch.compile mode 'fastest'.*'max-autotune'"):
        compiled(torch.randn(3))


def _graph(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(fn, backend=capture)(*args)
    return graphs[0]


def test_cudagraphs_set_in_options_wins_over_the_mode():
    # torch.compile refuses mode and options together; a direct call can pass both.
    g = torch.Generator().manual_seed(2)
    gm, example_inputs = _graph(_step, rand_ids(13, (3,), g=g), rand_table(13, 4, g=g))
    seen = []
    real = fusebackend.backend.GraphCache

    def spy(**kwargs):
        seen.append(kwargs["config"].cudagraphs)
        return real(**kwargs)

    with mock.patch.object(fusebackend.backend, "GraphCache", spy):
        mode = "max-autotune-no-cudagraphs"
        infinifuse(gm, example_inputs, options={"cudagraphs": True}, mode=mode)
        infinifuse(gm, example_inputs, options=FusionConfig(cudagraphs=True), mode=mode)
        infinifuse(gm, example_inputs, options={"max_graphs": 3}, mode=mode)
    assert seen == [True, True, False]
