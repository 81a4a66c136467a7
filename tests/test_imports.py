"""The package's import graph, read from the source (imports inside functions included): no
chain of imports comes back to where it began (imports for annotations only included), no
module imports another module's private names, no area imports one above it (ARCHITECTURE.md's
arrows), and the package's top level stays a facade."""

from __future__ import annotations

import ast
from pathlib import Path

import glassformer

ROOT = Path(glassformer.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = ("glassformer", *path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(imported module, imported name) for every `from glassformer... import name` in the file,
    `if TYPE_CHECKING:` blocks included: a cycle through annotations is a cycle all the same."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.append((submodule, "") if submodule in modules else (source, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return [(module, imported) for module, imported in found if module in modules]


def test_no_private_names_cross_modules():
    modules = _modules()
    crossing = [f"{name} imports {imported} from {module}"
                for name, path in modules.items()
                for module, imported in _imports(name, path, modules)
                if imported.startswith("_") and not imported.startswith("__") and module != name]
    assert crossing == []


def _first_cycle(modules: dict[str, Path]) -> list[str] | None:
    edges = {name: {m for m, _ in _imports(name, path, modules) if m != name}
             for name, path in modules.items()}
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        state[name] = "open"
        for target in sorted(edges[name]):
            if state.get(target) == "open":
                return [*path, name, target]
            if target not in state and (found := cycle_from(target, [*path, name])):
                return found
        state[name] = "done"
        return None

    return next((found for name in sorted(modules) if name not in state
                 and (found := cycle_from(name, []))), None)


def test_the_import_graph_has_no_cycle():
    first = _first_cycle(_modules())
    assert first is None, " -> ".join(first)


# The areas from the top down (ARCHITECTURE.md, "The arrows"): each imports only those below
# it; errors, home and data are everyone's.
LAYERS = ("cli", "experiments", "language_model", "serving", "training", "interpret", "formats",
          "generation", "accel", "model")
SHARED = ("errors", "home", "data")


def _area(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "glassformer"


def test_no_area_imports_one_above_it():
    modules = _modules()
    upward = sorted(f"{name} imports {module}" for name, path in modules.items()
                    for module, _ in _imports(name, path, modules)
                    if _area(name) in LAYERS and _area(module) not in SHARED
                    and LAYERS.index(_area(module)) < LAYERS.index(_area(name)))
    assert upward == []


def test_every_area_has_its_layer():
    areas = {_area(name) for name in _modules()} - {"glassformer", "__main__"}
    assert areas == set(LAYERS) | set(SHARED)


def test_the_top_level_is_a_facade():
    """Every concept lives in its area's folder; the top level holds at most six modules."""
    assert len(list(ROOT.glob("*.py"))) <= 6


def test_a_cycle_through_annotations_only_is_found(tmp_path):
    """The checker itself: two modules that import each other for annotations only."""
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from .b import B\n")
    (tmp_path / "b.py").write_text("from .a import A\n")
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    assert _first_cycle(modules) == ["pkg.a", "pkg.b", "pkg.a"]
