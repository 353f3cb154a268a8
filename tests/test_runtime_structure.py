"""The runtime's structure (docs/ARCHITECTURE.md, "The runtime"), held by reading the sources
(issue 37, item 5: the runtime as one table):

- The modules of ``runtime/`` import each other without a cycle, imports under
  ``if TYPE_CHECKING:`` included (``tests/test_import_contract.py`` leaves those out).
- No module imports ``graph_cache`` for types only, and no other module of ``runtime/``
  imports it at all: the cache's parts and the modules that reach other caches (eviction,
  frames) see a cache through its public surface (``frames.Member``).
- No module but ``graph_cache.py`` reads a private attribute of a ``GraphCache``; no module
  of ``runtime/`` reads a private attribute of anything but ``self``, ``cls`` or a module.
- ``GraphCache`` is built by composition (no base classes, so no mixin with attribute
  stubs), and its parts hold no reference back to it: a dropped cache is freed at once.
"""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import torch

from fusebackend.config import FusionConfig
from fusebackend.runtime.graph_cache import GraphCache

PACKAGE = Path(__file__).resolve().parent.parent / "fusebackend"
RUNTIME = PACKAGE / "runtime"
GRAPH_CACHE = "fusebackend.runtime.graph_cache"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(source: str) -> list[tuple[str, bool]]:
    """(absolute module, under TYPE_CHECKING) for every import in ``source``; ``from
    fusebackend.runtime import frames`` counts as ``fusebackend.runtime.frames``."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, typing_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, typing_only))
            found.extend((f"{node.module}.{a.name}", typing_only) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(ast.parse(source), False)
    return found


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _runtime_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Runtime module -> the runtime modules it imports (TYPE_CHECKING ones too)."""
    return {
        module: {name for name, _ in _imports(source) if name in sources and name != module}
        for module, source in sources.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def _runtime_sources() -> dict[str, str]:
    return {_module(p): p.read_text() for p in sorted(RUNTIME.glob("*.py"))}


def _package_sources() -> dict[str, str]:
    return {_module(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_runtime_modules_import_each_other_without_a_cycle_type_checking_included():
    assert _cycle(_runtime_graph(_runtime_sources())) is None


def test_no_module_imports_the_graph_cache_for_types_only():
    typing_only = [
        module
        for module, source in _package_sources().items()
        if (GRAPH_CACHE, True) in _imports(source)
    ]
    assert typing_only == []


def test_no_other_runtime_module_imports_the_graph_cache():
    importers = [
        module
        for module, source in _runtime_sources().items()
        if module != GRAPH_CACHE and any(name == GRAPH_CACHE for name, _ in _imports(source))
    ]
    assert importers == []


def _graph_cache_private_names(source: str) -> set[str]:
    """The private attributes and methods of ``GraphCache`` (set on ``self`` or defined in
    its class body), read from its source."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GraphCache")
    names = {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    names |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reads(source: str, names: set[str] | None = None) -> list[str]:
    """``line: expression`` for each read of a private attribute (of ``names`` only, if
    given) of anything but ``self``, ``cls`` or an imported module."""
    tree = ast.parse(source)
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__"):
            continue
        if names is not None and attr not in names:
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if isinstance(root, ast.Name) and root.id in modules:
            continue  # a module's own private name (torch._C, capture._reap)
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_but_graph_cache_reads_a_private_attribute_of_a_cache():
    sources = _package_sources()
    names = _graph_cache_private_names(sources[GRAPH_CACHE])
    assert {"_call", "_lock", "_padding"} <= names  # the reader sees the class
    reads = {
        module: found
        for module, source in sources.items()
        if module != GRAPH_CACHE and (found := _private_reads(source, names))
    }
    assert reads == {}


def test_runtime_modules_read_no_private_attribute_of_another_object():
    reads = {
        module: found
        for module, source in _runtime_sources().items()
        if (found := _private_reads(source))
    }
    assert reads == {}


def test_graph_cache_is_composed_not_mixed_in():
    tree = ast.parse((RUNTIME / "graph_cache.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GraphCache")
    assert cls.bases == []
    assert GraphCache.__mro__ == (GraphCache, object)


def test_the_checks_catch_planted_violations():
    planted = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from fusebackend.runtime.graph_cache import GraphCache\n"
        "def f(cache):\n"
        "    return cache._table, self._x, other._lock\n"
    )
    assert (GRAPH_CACHE, True) in _imports(planted)
    assert _private_reads(planted, {"_table"}) == ["5: cache._table"]
    assert _private_reads(planted) == ["5: cache._table", "5: other._lock"]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    sources = {
        "fusebackend.runtime.x": "from fusebackend.runtime import y\n",
        "fusebackend.runtime.y": "if TYPE_CHECKING:\n    from fusebackend.runtime.x import X\n",
    }
    assert _cycle(_runtime_graph(sources)) is not None


def test_a_dropped_cache_is_freed_without_the_garbage_collector():
    """Its parts (table, logbook, recapture, padding, inspection) refer to no cache: a cycle
    would keep a dropped cache's captured graphs and buffers until the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        cache = GraphCache(
            unfused=lambda x: (x * 2,), fused=lambda x: (x * 2,), config=FusionConfig(),
            device=None, batch_size_input_indices=frozenset(),
        )  # fmt: skip
        for n in (3, 3, 4):
            cache(torch.randn(n))
        assert len(cache) == 2 and cache.describe()
        ref = weakref.ref(cache)
        del cache
        assert ref() is None
    finally:
        if enabled:
            gc.enable()
