"""Every test of a ``*_gpu.py`` file carries ``@pytest.mark.gpu`` (on itself or as the module's
``pytestmark``): an unmarked one skips on the CPU and is deselected by ``pytest -m gpu``, so it
runs nowhere (four tests of test_runtime_gpu.py did, until this check)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
GPU_FILES = sorted(TESTS.glob("*_gpu.py"))


def _marks(obj) -> list[str]:
    marks = getattr(obj, "pytestmark", [])
    return [m.name for m in (marks if isinstance(marks, list) else [marks])]


def _tests(module) -> list[tuple[str, object]]:
    """(name, function) of the module's tests, those of its Test* classes included."""
    found = []
    for name, obj in vars(module).items():
        if name.startswith("test_") and inspect.isfunction(obj):
            found.append((name, obj))
        elif name.startswith("Test") and inspect.isclass(obj):
            found += [(f"{name}.{n}", f) for n, f in vars(obj).items() if n.startswith("test_")]
    return found


def test_gpu_files_are_found():
    assert len(GPU_FILES) >= 6, GPU_FILES


@pytest.mark.parametrize("path", GPU_FILES, ids=lambda p: p.name)
def test_every_test_in_a_gpu_file_is_marked_gpu(path):
    module = importlib.import_module(path.stem)
    tests = _tests(module)
    assert tests, f"{path.name} has no tests"
    if "gpu" in _marks(module):
        return
    unmarked = [name for name, fn in tests if "gpu" not in _marks(fn)]
    assert not unmarked, f"{path.name}: tests without @pytest.mark.gpu: {unmarked}"
