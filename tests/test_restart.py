"""A restarted process traces its dynamic graph first (fusebackend/restart.py).

The model's compiled frame is a closure, as transformers' decorated ``forward`` is: torch's own
profile (``TORCH_COMPILE_JOB_ID``) keys such a frame by a per-process hash and never finds it
again in a restart; fusebackend's profile keys sizes by Dynamo's source names. Shapes come as
sentence-transformers sends a sorted corpus: the longest batch, a shorter one, a smaller last
batch, so Dynamo compiles 3 graphs cold (static, dynamic length, dynamic batch).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import graphs_since

import fusebackend
from fusebackend import restart

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4, 9), (4, 6), (3, 5)]  # (batch, length), longest first, a smaller last batch

CHILD = """
import functools, json, sys
import torch
import fusebackend  # FUSEBACKEND_DYNAMIC_SHAPES is read here

def decorated(fn):  # a closure frame, as transformers' forward is
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper

class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm = torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16)

    @decorated
    def forward(self, input_ids, attention_mask):
        hidden = self.norm(self.embed(input_ids)) * attention_mask[..., None]
        return hidden.sum(1) / attention_mask.sum(1, keepdim=True)

torch.manual_seed(0)
model = Encoder().eval()
model.forward = torch.compile(model.forward, backend="infinifuse")
outputs = []
with torch.no_grad():
    for batch, length in json.loads(sys.argv[1]):
        ids = torch.arange(batch * length).reshape(batch, length) % 50
        outputs.append(model(ids, torch.ones(batch, length)).tolist())
print("RESULT", json.dumps({"graphs": len(fusebackend.reports().graphs), "outputs": outputs}))
"""


def _child(tmp_path: Path, profile: Path | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop(restart.ENV, None)
    if profile is not None:
        env[restart.ENV] = str(profile)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SHAPES)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_a_restart_with_the_profile_compiles_one_graph_with_equal_outputs(tmp_path):
    profile = tmp_path / "profile.json"
    cold = _child(tmp_path, profile)
    assert cold["graphs"] == 3  # static, dynamic length, dynamic batch
    data = json.loads(profile.read_text())
    assert data["sources"] == {"L['args'][1]": "all", "L['args'][2]": "all"}, data  # [0]: self
    again = _child(tmp_path, profile)
    assert again["graphs"] == 1  # dynamic in both from the first call
    # Both processes ran the later shapes through one dynamic graph: equal to the bit. The
    # cold one ran the first through its static graph, whose pooling sum reduces in its
    # group (passes/axis_reductions.py, static shapes only) in another order than aten's.
    assert again["outputs"][1:] == cold["outputs"][1:]
    torch.testing.assert_close(torch.tensor(again["outputs"][0]),
                               torch.tensor(cold["outputs"][0]), rtol=1e-6, atol=1e-6)  # fmt: skip
    # No profile: a restart pays the three compiles again (torch's own profile needs a job id,
    # and would not match this closure frame).
    assert _child(tmp_path, None)["graphs"] == 3


# ---- in one process: what a profile file holds, and files that must not be used


@pytest.fixture
def dynamic_sources():
    """torch.compiler.config.dynamic_sources as the test found it, put back after it; Dynamo
    reset first (no automatic-dynamic state of an earlier test's Sequential: a reset also drops
    remember_dynamic_shapes' recorder, so it comes before the test's call)."""
    before = torch.compiler.config.dynamic_sources
    torch._dynamo.reset()
    yield
    torch.compiler.config.dynamic_sources = before


def _run_shapes() -> int:
    """The model of CHILD (no closure needed here), compiled, over SHAPES: graphs compiled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16)).eval()
    compiled = torch.compile(model, backend="infinifuse")
    before = fusebackend.reports()
    with torch.no_grad():
        for batch, length in SHAPES:
            compiled(torch.arange(batch * length).reshape(batch, length) % 50)
    return len(graphs_since(before))  # (by identity: only the last 256 reports are kept)


@pytest.mark.parametrize(
    "content, reason",
    [
        ("\x00not json{", "unreadable"),
        (json.dumps({"format": 1, "torch": "1.0", "sources": {"L['x']": "all"}}), "torch '1.0'"),
        (json.dumps({"format": 9, "torch": restart._TORCH, "sources": {}}), "format"),
        (json.dumps({"format": 1, "torch": restart._TORCH, "sources": {"L['a'],.*": "all"}}),
         "malformed"),
        (json.dumps({"format": 1, "torch": restart._TORCH, "sources": {"L['x']": [True]}}),
         "malformed"),
    ],
)  # fmt: skip
def test_a_corrupted_or_mismatched_profile_is_ignored_and_rewritten(
    tmp_path, dynamic_sources, content, reason
):
    path = tmp_path / "profile.json"
    path.write_text(content)
    remembered = fusebackend.remember_dynamic_shapes(path)
    assert reason in remembered.ignored and remembered.entries == ()
    assert torch.compiler.config.dynamic_sources == ""  # nothing of the file applied
    assert _run_shapes() == 3
    data = json.loads(path.read_text())  # rewritten from what this process found
    assert data["format"] == 1 and data["sources"] == {"L['args'][0]": "all"}, data


def test_a_profile_makes_the_first_graph_dynamic_in_process(tmp_path, dynamic_sources):
    path = tmp_path / "profile.json"
    data = {"format": 1, "torch": restart._TORCH, "sources": {"L['args'][0]": "all"}}
    path.write_text(json.dumps(data))
    remembered = fusebackend.remember_dynamic_shapes(path)
    assert remembered.ignored is None and remembered.entries == (r"L\['args'\]\[0\]$",)
    assert fusebackend.remember_dynamic_shapes(path) is remembered  # once per path
    assert _run_shapes() == 1


def test_an_entry_matches_its_source_alone_and_never_raises():
    """Entries are anchored, escaped regexes (torch matches them with re.match): a name that is
    no valid regex (a bad character range) must not raise inside Dynamo, nor match longer
    names. Dims given alone become per-dim entries (``:N``)."""
    with pytest.raises(re.error):  # y-n: a bad character range
        re.compile("L['kwargs']['key-name']")
    (whole,) = restart._entries("L['kwargs']['key-name']", "all")
    assert re.match(whole, "L['kwargs']['key-name']")
    assert not re.match(whole, "L['kwargs']['key-name']['x']")
    assert restart._entries("L['x']", [0, 2]) == [r"L\['x'\]$:0", r"L\['x'\]$:2"]


@pytest.mark.skipif(
    not hasattr(torch._dynamo.variables.builder, "_parse_source_entry"),
    reason="this torch has no per-dim dynamic_sources entries (:N, torch 2.13)",
)
def test_a_profile_of_some_dims_makes_only_those_dynamic(tmp_path, dynamic_sources):
    path = tmp_path / "profile.json"
    data = {"format": 1, "torch": restart._TORCH, "sources": {"L['args'][0]": [1]}}
    path.write_text(json.dumps(data))
    assert fusebackend.remember_dynamic_shapes(path).entries == (r"L\['args'\]\[0\]$:1",)
    assert _run_shapes() == 2  # the length dynamic from the start; the batch after its change
