"""The ``infinifuse`` name reaches Dynamo through the package's entry point, so
``torch.compile(m, backend="infinifuse")`` works without importing fusebackend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import metadata

import torch

import fusebackend.backend


def test_backend_is_listed():
    assert "infinifuse" in torch._dynamo.list_backends()


def test_entry_point_names_the_backend_function():
    points = metadata.entry_points(group="torch_dynamo_backends")
    (point,) = [p for p in points if p.name == "infinifuse"]
    assert point.value == "fusebackend.backend:infinifuse"
    assert point.load() is fusebackend.backend.infinifuse


def test_lookup_backend_resolves_to_infinifuse():
    assert torch._dynamo.lookup_backend("infinifuse") is fusebackend.backend.infinifuse


def test_compile_by_name_in_a_fresh_process_without_importing_fusebackend():
    script = textwrap.dedent(
        """
        import sys
        import torch
        import torch.nn.functional as F

        assert "fusebackend" not in sys.modules
        torch.manual_seed(0)
        table = torch.randn(11, 5)
        ids = torch.randint(0, 11, (2, 3))

        def fn(ids, table):
            return F.gelu(F.embedding(ids, table)) * 2.0

        with torch.no_grad():
            out = torch.compile(fn, backend="infinifuse")(ids, table)
        torch.testing.assert_close(out, fn(ids, table))
        # Dynamo loaded the package through the entry point; the graph was fused.
        import fusebackend

        report = fusebackend.last_report()
        assert report.graphs[0].path == "fused", str(report)
        assert report.groups[0].backend == "triton", str(report)
        print("OK", len(report.groups))
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK 1"), result.stdout


def test_option_errors_surface_at_the_first_call_as_dynamos_backend_compiler_failed():
    # torch.compile offers a custom backend no hook that sees options before the first call
    # (_TorchCompileWrapper only looks the backend up), so the README documents this.
    import pytest
    from torch._dynamo.exc import BackendCompilerFailed

    from fusebackend import FusionConfig

    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="infinifuse", options={"max_graph": 4})  # no error
    with pytest.raises(BackendCompilerFailed) as caught, torch.no_grad():
        compiled(torch.randn(2, 4))
    inner = caught.value.inner_exception
    assert isinstance(inner, ValueError) and not isinstance(caught.value, ValueError)
    assert "'max_graph'" in str(inner) and "valid options:" in str(inner), inner
    # The documented early check: the same ValueError at once, before any compile.
    with pytest.raises(ValueError, match="unknown infinifuse option.*'max_graph'"):
        FusionConfig.from_options({"max_graph": 4})
    with pytest.raises(ValueError, match="max_graphs"):
        FusionConfig.from_options({"max_graphs": 0})
    # A mode infinifuse does not know: the same, at the first call.
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="infinifuse", mode="fastest")
    with pytest.raises(BackendCompilerFailed) as caught, torch.no_grad():
        compiled(torch.randn(2, 4))
    assert isinstance(caught.value.inner_exception, ValueError)
    assert "unknown torch.compile mode 'fastest'" in str(caught.value.inner_exception)
