"""The package's layout: no import cycle, a light ``import pydflash``, entry points that resolve.

The import graph is read from the sources (every ``import`` statement, those inside functions
included, ``if TYPE_CHECKING:`` blocks excluded), so a cycle hidden behind a lazy import fails too.
A package's own ``__init__`` is not counted as a dependency of its submodules (Python runs it
first anyway).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

PACKAGE = Path(__file__).resolve().parent.parent / "pydflash"
NOT_SOURCE = {"pydflash._native"}  # built, not in the source tree


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def _imports(name: str, path: Path, is_package: bool, modules: dict, missing: list | None = None) -> set[str]:
    """The pydflash modules ``name`` imports; imports of pydflash modules that do not exist go to ``missing``."""
    package = name if is_package else name.rsplit(".", 1)[0]
    out: set[str] = set()
    wanted: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
                wanted.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1] + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                wanted.add(base)
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    out.add(full if full in modules else base)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    if missing is not None:
        missing += [f"{name} imports {m}" for m in sorted(wanted)
                    if m.split(".")[0] == "pydflash" and m not in modules and m not in NOT_SOURCE]
    return {m for m in out if m in modules and m != name and not name.startswith(m + ".")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle():
    modules = _modules()
    missing: list[str] = []
    graph = {name: _imports(name, path, is_package, modules, missing) for name, (path, is_package) in modules.items()}
    assert "pydflash.runtime.engine" in graph["pydflash.cli"]  # the graph sees lazy imports
    assert _cycles(graph) == []
    assert missing == []  # a module moved or removed with an import of it left behind


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_few_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


def test_import_pydflash_loads_nothing_native():
    code = "import sys, pydflash; print(' '.join(sorted(m for m in sys.modules if m.startswith('pydflash'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["pydflash", "pydflash.errors"]


@pytest.mark.skipif(tomllib is None, reason="tomllib is Python 3.11+")
def test_console_scripts_resolve():
    scripts = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert "pydflash" in scripts and "pydflash-server" in scripts
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


def test_version_and_typed_marker(capsys):
    from importlib import metadata

    from pydflash import __version__
    from pydflash.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"pydflash {__version__}\n"
    assert metadata.version("pydflash") == __version__  # the metadata pyproject writes, and the package's
    assert (PACKAGE / "py.typed").is_file()  # PEP 561: type checkers read the package's annotations
