"""The package's layer boundaries (docs/ARCHITECTURE.md, "Boundaries"), held by reading every
module's imports from its source (no module is imported here).

Every ``import`` and ``from ... import`` counts: at module level and inside functions (a
lazy import still joins the layers at run time), but not under ``if TYPE_CHECKING:`` (never
run). ``from fusebackend.kernels import launch`` imports the module ``kernels.launch``;
``from fusebackend.kernels.ir import RowProgram`` imports ``kernels.ir``. The import of a
module's parent packages (``fusebackend/__init__.py`` before every module) is not counted:
it is Python's, not the module's, and would join every module to the package root.

The rules:
- ``passes/*`` import no Triton, nothing of ``runtime/`` or ``backend.py``, and of
  ``kernels/`` only ``kernels.ir`` (the program they hand over); the report dataclasses
  (``RejectionReport``) come from ``report.py``. The kernels a pass puts into the graph
  are handed to it by the backend (``use_vocab_parallel_lookup(graph, vocab_parallel_lookup,
  ...)``; the fused-op classes given to ``rewrite`` and ``pair_twin_groups``).
- ``kernels/*`` import neither ``torch.fx`` nor ``passes/``.
- ``runtime/*`` import neither ``passes/`` nor ``kernels/``.
- No import cycle among the package's modules.
- No module of the package is over ``MAX_MODULE_LINES`` lines.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = "fusebackend"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

PASSES_MAY_IMPORT = {f"{PACKAGE}.kernels.ir", f"{PACKAGE}.report"}
MAX_MODULE_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, name: str, level: int, is_package: bool) -> str:
    """The absolute module a ``from`` import names (relative imports resolved)."""
    if level == 0:
        return name
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``source`` (the module ``module``)."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node.module or "", node.level, is_package)
            found.append((target, node.lineno))
            for alias in node.names:  # ``from package import submodule``
                submodule = f"{target}.{alias.name}"
                if submodule in _modules():
                    found.append((submodule, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


@functools.cache
def _imports() -> dict[str, list[tuple[str, int]]]:
    return {
        name: imports_of(path.read_text(), name, path.name == "__init__.py")
        for name, path in _modules().items()
    }


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(layer: str, allowed) -> list[str]:
    bad = []
    for module, imported in _imports().items():
        if not _within(module, f"{PACKAGE}.{layer}"):
            continue
        for name, line in imported:
            if not allowed(name):
                bad.append(f"{_modules()[module].relative_to(ROOT.parent)}:{line} imports {name}")
    return bad


def _passes_may_import(name: str) -> bool:
    if _within(name, "triton"):
        return False
    if not _within(name, PACKAGE):
        return True
    return _within(name, f"{PACKAGE}.passes") or name in PASSES_MAY_IMPORT


def _kernels_may_import(name: str) -> bool:
    return not (_within(name, "torch.fx") or _within(name, f"{PACKAGE}.passes"))


def _runtime_may_import(name: str) -> bool:
    return not (_within(name, f"{PACKAGE}.passes") or _within(name, f"{PACKAGE}.kernels"))


def test_the_contract_sees_every_layer():
    names = set(_modules())
    for layer in ("passes", "kernels", "runtime"):
        assert len([n for n in names if _within(n, f"{PACKAGE}.{layer}")]) > 3, layer
    # function-level imports are read too (the launcher imports Triton lazily)
    triton_api = _imports()[f"{PACKAGE}.kernels.triton_api"]
    assert any(_within(name, "triton") for name, _ in triton_api)


def test_passes_import_no_triton_runtime_or_kernels_but_the_ir():
    assert _violations("passes", _passes_may_import) == []


def test_kernels_import_no_fx_and_no_passes():
    assert _violations("kernels", _kernels_may_import) == []


def test_runtime_imports_no_passes_and_no_kernels():
    assert _violations("runtime", _runtime_may_import) == []


def _cycles(ignore: tuple[str, str] | None = None) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan), without the
    import ``ignore`` (importer, imported)."""
    graph = {
        module: sorted(
            {n for n, _ in imported if n in _modules() and n != module and (module, n) != ignore}
        )
        for module, imported in _imports().items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in graph:
        if node not in index:
            connect(node)
    return found


def test_no_import_cycle():
    # explain lives in explaining.py (it imports backend.py and report.py; report.py imports
    # neither back): report.py -> backend.py -> report.py was the last cycle.
    assert _cycles() == []


def test_a_planted_import_is_caught():
    # The checks read sources: a passes module that imported Triton (in a function) or a
    # kernels module that imported passes would be listed.
    planted = "import torch\n\ndef f():\n    import triton.language as tl\n"
    names = [n for n, _ in imports_of(planted, f"{PACKAGE}.passes.example")]
    assert not all(_passes_may_import(n) for n in names)
    planted = "from fusebackend.passes import ops\nfrom torch.fx import Node\n"
    names = [n for n, _ in imports_of(planted, f"{PACKAGE}.kernels.example")]
    assert [n for n in names if not _kernels_may_import(n)] == [
        f"{PACKAGE}.passes",
        f"{PACKAGE}.passes.ops",
        "torch.fx",
    ]
    relative = "from ..kernels import launch\nfrom . import ops\n"
    names = [n for n, _ in imports_of(relative, f"{PACKAGE}.passes.example")]
    assert f"{PACKAGE}.kernels.launch" in names and f"{PACKAGE}.passes.ops" in names


def _over(limit: int) -> list[str]:
    """``path: lines`` for every module of the package longer than ``limit`` lines."""
    over = []
    for path in _modules().values():
        lines = len(path.read_text().splitlines())
        if lines > limit:
            over.append(f"{path.relative_to(ROOT.parent)}: {lines}")
    return over


def test_no_module_is_over_600_lines():
    over = _over(MAX_MODULE_LINES)
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them): {', '.join(over)}"
