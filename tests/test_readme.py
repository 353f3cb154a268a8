"""The README: its first snippet, run as a newcomer copies it (it once printed no fusion), and
its Layout section, which lists every module of the package."""

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


def _layout_modules() -> dict[str, set[str]]:
    """The README's Layout section: folder (`fusebackend/`, `fusebackend/passes/`, ...) -> the
    module names listed under it: each `- `name.py`: ...` line, and a related module after a
    semicolon in it (`...; `other.py`: ...`)."""
    text = README.read_text()
    section = text[text.index("\n## Layout\n") :]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    listed: dict[str, set[str]] = {}
    folder = None
    for line in section.splitlines():
        if head := re.match(r"`(fusebackend/(?:\w+/)?)`", line):
            folder = head.group(1)
            listed.setdefault(folder, set())
        elif line.startswith("- `") and folder:
            listed[folder].update(re.findall(r"(?:^- |; )`(\w+\.py)`", line))
    return listed


def test_the_layout_section_lists_every_module_of_the_package():
    package = README.parent / "fusebackend"
    on_disk: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        folder = "fusebackend/" + "".join(f"{p}/" for p in path.parent.relative_to(package).parts)
        on_disk.setdefault(folder, set()).add(path.name)
    listed = _layout_modules()
    missing = {f: sorted(n - listed.get(f, set())) for f, n in on_disk.items()}
    extra = {f: sorted(n - on_disk.get(f, set())) for f, n in listed.items()}
    assert not any(missing.values()), f"modules missing from README's Layout: {missing}"
    assert not any(extra.values()), f"README's Layout lists modules that do not exist: {extra}"


def test_the_readme_stays_a_front_door_under_400_lines():
    # The long performance record lives in docs/PERFORMANCE.md (issue 37, item 6): the README
    # keeps what it is, set-up, the first example, options and a short table.
    lines = README.read_text().splitlines()
    assert len(lines) < 400, f"README.md has {len(lines)} lines; move detail to docs/"
