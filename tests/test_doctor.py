"""``python -m fusebackend doctor``: what it says and its exit code, on a CPU-only machine and
(with CUDA availability mocked, or for real on a GPU) on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

import fusebackend.backend
from fusebackend import __main__ as cli
from fusebackend import doctor

GPU_CHECKS = (
    "CUDA visible",
    "Triton usable on the GPU",
    "fused embedding captured in a CUDA graph",
    "no host sync (sync debug mode 'error')",
    "replay equals eager",
    "CPU token ids moved inside forward still captured",
)


def _doctor(capsys) -> tuple[int, list[str]]:
    code = cli.main(["doctor"])
    return code, capsys.readouterr().out.splitlines()


def test_cpu_only_machine_says_what_works_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, lines = _doctor(capsys)
    text = "\n".join(lines)
    assert code == 0, text
    assert not [line for line in lines if line.startswith("[FAIL]")], text
    assert any(line.startswith("[ ok ] backend on the CPU") for line in lines), text
    assert "no CUDA graphs" in text and "[skip] GPU checks" in text, text
    assert not any(name in text for name in GPU_CHECKS), text
    assert lines[-1].startswith("all checks passed (CPU only"), text


def test_cpu_only_machine_reports_a_broken_backend_and_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def broken(self, *inputs):
        raise RuntimeError("fused group broken on purpose")

    # The fused graph raises on its first run: the runtime falls back (mode eager), which the
    # CPU check must call a failure, with the reason.
    monkeypatch.setattr(fusebackend.backend.FusedGroupOp, "__call__", broken)
    code, lines = _doctor(capsys)
    text = "\n".join(lines)
    assert code == 1, text
    (fail,) = [line for line in lines if line.startswith("[FAIL]")]
    assert fail.startswith("[FAIL] backend on the CPU") and "fused group broken" in fail, text
    assert lines[-1] == "1 check(s) failed", text


@pytest.mark.skipif(torch.cuda.is_available(), reason="mocks a CUDA machine on one without")
def test_cuda_machine_keeps_the_full_checklist(monkeypatch, capsys):
    # torch says CUDA is there but no device works: every GPU check runs and fails with its
    # reason (the ones that replay name the failed capture), and the exit code says so.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code, lines = _doctor(capsys)
    text = "\n".join(lines)
    assert code == 1, text
    assert "[skip]" not in text and "backend on the CPU" not in text, text
    for name in GPU_CHECKS:
        assert any(line.startswith(f"[FAIL] {name}") for line in lines), (name, text)
    assert "needs the capture above" in text, text
    assert lines[-1] == f"{len(GPU_CHECKS)} check(s) failed", text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_machine_passes_the_full_checklist(capsys):
    lines: list[str] = []
    failures = doctor.run_doctor(lines.append)
    text = "\n".join(lines)
    assert failures == 0, text
    for name in GPU_CHECKS:
        assert any(line.startswith(f"[ ok ] {name}") for line in lines), (name, text)


def test_doctor_prints_the_triton_version_and_whether_it_is_the_tested_one(monkeypatch, capsys):
    import triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, lines = _doctor(capsys)
    first = lines[0]
    assert f"triton {triton.__version__} (" in first, first
    tested = tuple(int(p) for p in triton.__version__.split(".")[:2]) in ((3, 6), (3, 7))
    assert ("(tested: the suite runs with 3.6.x or 3.7.x)" in first) == tested, first
    # A version outside the range is called untested (what `pip install -e .` gives on a CPU
    # machine: PyPI's newest Triton, 3.9.0 on 2026-11-26).
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    _, lines = _doctor(capsys)
    assert "triton 3.9.0 (UNTESTED: the suite runs with 3.6.x or 3.7.x" in lines[0], lines[0]
    assert doctor.triton_tested("3.7.1").startswith("tested")
    assert doctor.triton_tested("3.6.0").startswith("tested")
    assert doctor.triton_tested("3.8.0").startswith("UNTESTED")
