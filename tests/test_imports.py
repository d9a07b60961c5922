"""The package's import graph: no circles, a light contract, and an export that never loads the runtime."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specdeploy"


def _loaded_after(statement: str, prefix: str = "specdeploy") -> list[str]:
    """The modules (those whose name starts with ``prefix``) a fresh interpreter holds after ``statement``."""
    code = f"{statement}; import sys; print(' '.join(sorted(m for m in sys.modules if m.startswith({prefix!r}))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split()


def _imports(path: Path, module: str) -> set[str]:
    """The specdeploy modules ``path`` imports when it runs (anywhere in it, functions included; not the imports that
    only type checkers read)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rsplit(".", 1)[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            names = [f"{target}.{alias.name}" for alias in node.names]
            found |= {name for name in names if _exists(name)} or {target}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("specdeploy") and _exists(name)}


def _exists(name: str) -> bool:
    relative = Path(*name.split(".")[1:]) if "." in name else Path()
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[module] = _imports(path, module) - {module}
    return graph


def test_no_module_of_the_package_imports_itself_back():
    graph, cycles = _graph(), []

    def visit(module, trail):
        for imported in sorted(graph.get(module, ())):
            if imported in trail:
                cycles.append(trail[trail.index(imported):] + [imported])
            elif imported not in done:
                visit(imported, trail + [imported])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, cycles[:5]
    assert len(graph) > 40  # the walk saw the package


def test_the_contract_loads_alone_and_an_export_never_loads_the_runtime():
    # the contract's leaves only, named: the package root, file reading and values in messages (no runtime, no engine)
    assert set(_loaded_after("import specdeploy.contract")) <= {"specdeploy", "specdeploy.contract", "specdeploy.files",
                                                                  "specdeploy.values"}
    exporter = _loaded_after("import specdeploy.exporter, specdeploy.cli.export")
    assert not [m for m in exporter if m.startswith("specdeploy.runtime")], exporter


def test_an_import_loads_neither_torch_nor_the_exporter_nor_the_runtime():
    """``specdeploy import`` builds nothing: it runs where only the core is installed (no torch, no transformers)."""
    loaded = _loaded_after("import specdeploy.importer, specdeploy.cli.imports", prefix="")
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "transformers")
             or m.startswith(("specdeploy.exporter", "specdeploy.runtime"))]
    assert not heavy, heavy
    assert "specdeploy.importer.artifact" in loaded and "onnx" not in loaded  # onnx only once an import runs
