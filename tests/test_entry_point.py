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
