"""docs/design.md's import layers hold: a module never imports from a higher layer, and the callbacks
import nothing of lit_parl's data path."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# the layers of docs/design.md, "The package tree": a package's modules may import from its own layer and below
LAYERS = {
    "lit_parl.errors": 1,
    "lit_parl.settings": 1,
    "lit_parl.extras": 1,
    "lit_parl.kernels": 1,
    "lit_parl.callbacks": 1,
    "lit_parl.models": 1,
    "lit_parl.prompts": 1,
    "lit_parl.rewards": 1,
    "lit_parl.tasks": 1,
    "lit_parl.episodes.environment": 1,  # what a task's environment implements: no engine, no data path
    "lit_parl.rollout": 2,
    "lit_parl.episodes": 3,
    "lit_parl.data": 3,
    "lit_parl.trainer": 4,
    "lit_parl.planner": 5,  # reads a finished run's files; nothing imports it
    "lit_parl.cli": 5,
    "lit_parl.override_checks": 5,
    "lit_parl.run_checks": 5,
    "lit_parl.__main__": 5,
}


def _layer(module: str) -> int | None:
    matches = [name for name in LAYERS if module == name or module.startswith(name + ".")]
    return LAYERS[max(matches, key=len)] if matches else None


def _sources() -> dict[str, Path]:
    found = {}
    for folder, package in (
        (ROOT / "lit_parl", "lit_parl"),
        (ROOT / "kernels", "lit_parl.kernels"),
        (ROOT / "callbacks", "lit_parl.callbacks"),
    ):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def _imports(path: Path, name: str) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                imported.add(".".join([*base, node.module] if node.module else base))
            else:
                imported.add(node.module)
    return {module for module in imported if module and module.startswith("lit_parl")}


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in _sources() if name != "lit_parl" and _layer(name) is None)
    assert not unplaced, f"modules in no layer of LAYERS (place their package): {unplaced}"


def test_no_module_imports_from_a_higher_layer():
    violations = []
    for name, path in _sources().items():
        own = _layer(name)
        if own is None or name == "lit_parl":
            continue
        for module in _imports(path, name):
            other = _layer(module)
            if other is not None and other > own:
                violations.append(f"{name} (layer {own}) imports {module} (layer {other})")
    assert not violations, "\n".join(violations)


def test_the_callbacks_import_nothing_of_lit_parl():
    for name, path in _sources().items():
        if name.startswith("lit_parl.callbacks"):
            outside = {m for m in _imports(path, name) if not m.startswith("lit_parl.callbacks")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_pyproject_lists_every_package():
    """setuptools installs only the listed packages: one left out is missing from a wheel, though an editable
    install (the tests') still finds it on disk. It takes every folder of a package as a package, a config group
    without Python files too, and warns at each install (about 40 lines) for each one the list leaves out."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = set()
    for package, folder in setuptools["package-dir"].items():
        on_disk.add(package)
        for path in (ROOT / folder).rglob("*"):
            if path.is_dir() and "__pycache__" not in path.parts:
                on_disk.add(".".join((package, *path.relative_to(ROOT / folder).parts)))
    assert on_disk <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(on_disk - listed)}"
