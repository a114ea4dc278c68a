"""Every module of the sharpi package imports on its own, and no sharpi module imports itself back.

Oracles: a fresh interpreter per module (an import that only works after some other module was
imported first fails there), and the import graph read from the source with `ast` (every import
statement in the file, at module level or inside a function: a lazy import that closes a loop is
still a loop in the design, docs/design.md §3's "data flows one way").
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import sharpi

PACKAGE_DIR = Path(sharpi.__file__).resolve().parent


def module_files(package_dir: Path = PACKAGE_DIR) -> dict:
    """{dotted module name: path} of every .py file under the package (packages by __init__.py)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, known: set) -> set:
    """The modules in `known` that the file at `path` (module `name`) imports anywhere in its body.
    `from X import y` counts as importing X.y when that is a module, else X."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    return {t for t in targets if t in known and t != name}


def extension_modules(package_dir: Path = PACKAGE_DIR) -> set:
    """Dotted names of the compiled modules in the package (sharpi._core and sharpi._internal, even
    before they are built): `from . import _core` imports that module, not the package."""
    names = {f"{package_dir.name}._core", f"{package_dir.name}._internal"}
    for path in package_dir.rglob("*"):
        if path.suffix in (".so", ".pyd"):
            parts = path.relative_to(package_dir.parent).parts
            names.add(".".join(parts[:-1] + (path.name.split(".")[0],)))
    return names


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict:
    """{module: the package's modules it imports}; compiled modules are leaves."""
    files = module_files(package_dir)
    known = set(files) | extension_modules(package_dir)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def find_cycle(graph: dict):
    """One import cycle as a list of module names [a, b, ..., a], or None when the graph is acyclic."""
    state: dict = {}  # absent: unvisited, 1: on the current path, 2: done
    path: list = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


MODULES = sorted(m for m in module_files() if not m.endswith("__main__"))


def test_the_module_list_covers_the_package():
    for name in ("sharpi", "sharpi.cli", "sharpi.cli_args", "sharpi.metrics", "sharpi.bench", "sharpi.predict.cli"):
        assert name in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_in_a_fresh_interpreter(module):
    proc = subprocess.run(
        [sys.executable, "-c", f"import importlib; importlib.import_module({module!r})"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_no_import_cycle_among_sharpi_modules():
    graph = import_graph()
    assert graph["sharpi.cli"] >= {"sharpi.cli_args", "sharpi.bench", "sharpi.harvest", "sharpi.predict.cli"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The checker itself, on a package written here: a -> b (lazily) -> pkg.c -> a."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from .sub.c import g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import f\n\ndef g():\n    pass\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    (pkg / "sub" / "c.py").write_text("def g():\n    pass\n")
    assert find_cycle(import_graph(pkg)) is None
