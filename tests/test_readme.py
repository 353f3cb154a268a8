"""The README's first snippet, run as a newcomer copies it (it once printed no fusion)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _first_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "no python block in README.md"
    return blocks[0]


def _run_snippet() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_first_snippet(), str(README), "exec"), {"__name__": "__readme__"})
    return out.getvalue()


def test_the_first_snippet_defines_what_it_uses_and_prints_a_fused_report():
    # conftest sets TRITON_INTERPRET=1 without a GPU: the kernel runs (on a GPU, natively).
    printed = _run_snippet()
    header = printed.splitlines()[0]
    assert header.startswith("== graph") and ": fused, 1 group(s)" in header, printed
    assert "group0" in printed and "| triton " in printed, printed
    assert "mode fusion" in printed, printed


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU without Triton's interpreter")
def test_the_first_snippet_on_a_plain_cpu_lists_the_group_it_would_fuse(monkeypatch):
    # As the README says: the group is found and listed, not rewritten, and the report
    # says why in words that are true where Triton is installed.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    printed = _run_snippet()
    assert "1 group(s) found" in printed and "group0" in printed, printed
    assert "not rewritten: Triton cannot run on cpu (the CPU needs TRITON_INTERPRET=1)" in printed
