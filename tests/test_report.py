"""What ``explain``, ``reports`` and the report's text show a user (the front door):
explain traces on its own, under no_grad, whatever was compiled before; every graph of a
compilation can be listed; tables wrap instead of cutting; constants are counted, not named."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusebackend
from fusebackend.report import FusionReport, GraphReport, RejectionReport


class _Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.pos = nn.Embedding(12, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.norm(self.tok(ids) + self.pos(positions))


def _model_and_ids() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Embedder().eval(), torch.randint(0, 50, (2, 7))


def _assert_groups_found(report: FusionReport) -> None:
    assert report.graphs and report.groups, str(report)
    assert not any(g.path.startswith("unfused (gradients") for g in report.graphs), str(report)
    assert "no graph was compiled" not in str(report), str(report)


def test_explain_outside_no_grad_reports_the_inference_graph():
    # Parameters require grad; outside no_grad the graph used to go to aot_autograd unfused.
    model, ids = _model_and_ids()
    report = fusebackend.explain(model, ids)
    _assert_groups_found(report)
    assert report.graphs[0].path == "fused", str(report)  # conftest: Triton's interpreter


def test_explain_after_the_user_compiled_the_model_traces_again():
    # The README's snippet: torch.compile, a call under no_grad, then explain (inside and
    # outside no_grad). Dynamo's cache used to serve explain the user's entry: no graph.
    model, ids = _model_and_ids()
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        compiled(ids)
    _assert_groups_found(fusebackend.explain(model, ids))
    with torch.no_grad():
        _assert_groups_found(fusebackend.explain(model, ids))
    # The compiled object itself may be passed too.
    _assert_groups_found(fusebackend.explain(compiled, ids))


def test_explain_many_times_stays_under_dynamos_recompile_limit():
    model, ids = _model_and_ids()
    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 2):
        report = fusebackend.explain(model, ids)
        assert len(report.graphs) == 1, str(report)


def _with_graph_break(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = F.layer_norm(F.gelu(x) * 2.0, (x.shape[-1],), w)
    torch._dynamo.graph_break()
    return F.silu(y) * w + 1.0


def test_reports_lists_every_graph_of_a_compilation_with_a_graph_break():
    x, w = torch.randn(3, 24), torch.randn(24)
    earlier = {graph.name for graph in fusebackend.reports().graphs}  # other tests' graphs
    compiled = torch.compile(_with_graph_break, backend="infinifuse")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w), _with_graph_break(x, w))
    everything = fusebackend.reports()
    graphs = [graph for graph in everything.graphs if graph.name not in earlier]
    assert len(graphs) == 2, str(everything)
    assert graphs == everything.graphs[-2:]  # oldest first
    assert all(graph.groups for graph in graphs), str(everything)
    # last_report() shows only the most recent of them.
    assert fusebackend.last_report().graphs == graphs[-1:]
    text = str(everything)
    assert all(f"== {graph.name} on cpu" in text for graph in graphs), text
    # explain of the same function returns both graphs of its own call.
    assert len(fusebackend.explain(_with_graph_break, x, w).graphs) == 2


def _graph(rejections=(), constants=()) -> GraphReport:
    return GraphReport("graph0", "cpu", "fused", [], list(rejections), [], [], 0.0,
                       rewrites={"constants": list(constants)})  # fmt: skip


def test_a_long_rejection_reason_wraps_whole_at_word_boundaries():
    reason = (
        "consumer cos_3 is a view (unsqueeze) of a value computed in the group: the kernel "
        "writes its outputs contiguous and does not address its own values by new strides"
    )
    report = FusionReport([_graph(rejections=[RejectionReport("cos_3", reason)])])
    lines = str(report).splitlines()
    start = next(k for k, line in enumerate(lines) if line.strip().startswith("cos_3"))
    cells = [lines[start].split("|", 1)[1].strip()]
    for line in lines[start + 1 :]:
        head, _, rest = line.partition("|")
        if head.strip():
            break
        cells.append(rest.strip())
    assert len(cells) >= 2, lines  # wrapped, not on one line
    assert " ".join(cells) == reason, lines  # every word, none cut
    assert "..." not in str(report)


def test_constants_are_counted_with_a_pointer_not_listed_by_dynamos_names():
    names = ["arange", "getitem", "float_1", "tensor_3"]
    report = FusionReport([_graph(), _graph(constants=names)])
    text = str(report)
    line = next(ln for ln in text.splitlines() if ln.startswith("constants built once"))
    assert "4 tensor(s)" in line, text
    assert "report.graphs[1].constants" in text, text
    assert "tensor_3" not in text and "getitem" not in text, text


def test_explain_leaves_the_users_compiled_entry_in_place():
    # explain() compiles the same frame again in its own recompile slot; keyed by frame
    # alone, its graph superseded the user's and the user's next call of that shape missed.
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16))
    ids = torch.randint(0, 50, (2, 7))
    compiled = torch.compile(model, backend="infinifuse")
    with torch.no_grad():
        compiled(ids)
        fusebackend.explain(compiled, ids)
        fusebackend.reset_stats()
        compiled(ids)
    stats = fusebackend.stats()
    assert (stats["cache_hits"], stats["cache_misses"]) == (1, 0), stats


def test_every_pass_is_timed_and_the_fused_graphs_launches_are_named():
    model, ids = _model_and_ids()
    graph = fusebackend.explain(model, ids).graphs[0]
    assert graph.path == "fused", str(graph)
    ran = {"unwrap_dtensors", "fold_constants", "find_groups", "rewrite_groups", "precompile"}
    assert ran <= set(graph.pass_seconds), graph.pass_seconds
    assert all(seconds >= 0 for seconds in graph.pass_seconds.values())
    # Each kernel family's describe(): the row group's generated kernel, launched once.
    assert graph.launches == {graph.groups[0].kernel_name: 1}, graph.launches
    assert graph.constants == graph.rewrites["constants"]


def test_a_pass_is_one_entry_in_the_list_and_explain_lists_what_it_reports():
    from fusebackend import prepare
    from fusebackend.pipeline import Pass

    def layer_norms(compilation):
        nodes = compilation.gm.graph.nodes
        return [n.name for n in nodes if n.target is F.layer_norm]

    added = Pass("find_layer_norms", layer_norms, "layer norms seen", needs_rewrites=True)
    model, ids = _model_and_ids()
    prepare.PREPARE.append(added)
    try:
        with_it = fusebackend.explain(model, ids).graphs[0]
        without = fusebackend.explain(model, ids, options={"rewrites": False}).graphs[0]
    finally:
        prepare.PREPARE.remove(added)
    assert with_it.rewrites["find_layer_norms"] == ["layer_norm"], with_it.rewrites
    assert "layer norms seen: layer_norm" in str(FusionReport([with_it]))
    assert "find_layer_norms" in with_it.pass_seconds
    assert "find_layer_norms" not in without.rewrites  # needs_rewrites: not run
    assert "find_layer_norms" not in without.pass_seconds
