"""The import direction of docs/architecture.md, checked from source with ``ast`` (nothing is imported or run).

Packages sit in layers, lowest first; a module may import its own layer and the layers below it:

    ffi_kernels  <-  ls_jax.backend  <-  ls_jax (root), ls_jax.ops, ls_jax.optim  <-  ls_jax.layers
                 <-  ls_jax.models   <-  train.errors  <-  train.data, train.costs, train.records, train.reference
                 <-  train.harness   <-  train.wmt, train.imdb, train.gpt, train.tasks, train.compare, train.sweep
                 <-  train.bench     <-  train (root), tpu  <-  scripts

and only the bridges (ls_jax.backend, ls_jax.ops, ls_jax.optim) import ffi_kernels: a layer, a model or the
training harness never reaches a kernel except through an op or the optimizer. Every import counts: module
level, inside functions, under ``TYPE_CHECKING``, relative ones, and ``importlib.import_module`` / ``__import__``
of a constant name. ``from package import name`` counts as an import of ``package.name`` too, since name may be a
submodule. A module belongs to the layer of its longest listed prefix; modules outside every listed package
(the standard library, jax, flax, ...) are not checked.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Iterator, Sequence

LAYERS: tuple[tuple[str, ...], ...] = (
    ("ffi_kernels",),
    ("ls_jax.backend",),
    ("ls_jax", "ls_jax.ops", "ls_jax.optim"),
    ("ls_jax.layers",),
    ("ls_jax.models",),
    ("train.errors",),
    ("train.data", "train.costs", "train.records", "train.reference"),
    ("train.harness",),
    ("train.wmt", "train.imdb", "train.gpt", "train.tasks", "train.compare", "train.sweep"),
    ("train.bench",),
    ("train", "tpu"),
    ("scripts",),
)
KERNEL_PACKAGE = "ffi_kernels"
KERNEL_BRIDGES: tuple[str, ...] = ("ls_jax.backend", "ls_jax.ops", "ls_jax.optim")
DYNAMIC_IMPORTS = {"import_module", "__import__"}


@dataclasses.dataclass(frozen=True)
class Violation:
    """``importer`` (the module in ``path``) imports ``imported`` at ``line``, against ``rule``."""

    path: Path
    line: int
    importer: str
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}: {self.rule}"


def module_name(root: Path, path: Path) -> str:
    """The dotted name of the module in ``path`` under source root ``root`` (``a/b/__init__.py`` -> ``a.b``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute package of ``from [.]*X import ...`` in ``module``."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dynamic_name(node: ast.Call) -> str | None:
    """The constant module name of ``importlib.import_module("x")`` or ``__import__("x")``, else None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in DYNAMIC_IMPORTS or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imported_modules(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of every import anywhere in the source file ``path`` of ``module``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            package = _resolve(node, module, is_package)
            yield node.lineno, package
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{package}.{alias.name}"
        elif isinstance(node, ast.Call) and (name := _dynamic_name(node)) is not None:
            yield node.lineno, name


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str, layers: Sequence[Sequence[str]] = LAYERS) -> int | None:
    """The index in ``layers`` of the longest package prefix of ``module``, or None outside all of them."""
    matches = [
        (len(package), index) for index, group in enumerate(layers) for package in group if _within(module, package)
    ]
    return max(matches)[1] if matches else None


def check_import(
    importer: str,
    imported: str,
    layers: Sequence[Sequence[str]] = LAYERS,
    kernel_package: str = KERNEL_PACKAGE,
    bridges: Sequence[str] = KERNEL_BRIDGES,
) -> str | None:
    """The rule ``importer`` breaks by importing ``imported``, or None where the import is allowed."""
    source, target = layer_of(importer, layers), layer_of(imported, layers)
    if source is None or target is None:
        return None
    if target > source:
        return f"a lower layer imports a higher one ({' <- '.join('/'.join(group) for group in layers)})"
    if (
        _within(imported, kernel_package)
        and not _within(importer, kernel_package)
        and not any(_within(importer, bridge) for bridge in bridges)
    ):
        return f"only {', '.join(bridges)} import {kernel_package}"
    return None


def import_edges(root: Path, packages: Sequence[str]) -> Iterator[tuple[Path, int, str, str]]:
    """``(path relative to root, line, importer, imported)`` for every import in the ``.py`` files of the
    top-level ``packages`` under ``root``."""
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            importer = module_name(root, path)
            for line, imported in imported_modules(path, importer):
                yield path.relative_to(root), line, importer, imported


def _most_general(found: list[Violation]) -> list[Violation]:
    """Drops ``from a import b``'s ``a.b`` where ``a`` on the same line already breaks a rule."""
    return [
        v
        for v in found
        if not any(
            u.path == v.path and u.line == v.line and u.imported != v.imported and _within(v.imported, u.imported)
            for u in found
        )
    ]


def violations(
    root: Path,
    layers: Sequence[Sequence[str]] = LAYERS,
    kernel_package: str = KERNEL_PACKAGE,
    bridges: Sequence[str] = KERNEL_BRIDGES,
) -> list[Violation]:
    """Every import against the layering in the top-level packages of ``layers`` under ``root``, ordered by file
    and line."""
    top_level = sorted({package.split(".")[0] for group in layers for package in group})
    found = set()
    for path, line, importer, imported in import_edges(root, top_level):
        rule = check_import(importer, imported, layers, kernel_package, bridges)
        if rule is not None:
            found.add(Violation(path, line, importer, imported, rule))
    return sorted(_most_general(list(found)), key=lambda v: (str(v.path), v.line, v.imported))


def loaded_modules(path: Path, module: str, modules: set[str]) -> Iterator[str]:
    """The modules of ``modules`` that the imports of the source file ``path`` (of ``module``) load, wherever they
    stand: ``import a.b`` loads ``a.b``; ``from a import b`` loads ``a.b`` where that is a module, else ``a``."""

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (owner(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            package = _resolve(node, module, path.name == "__init__.py")
            for alias in node.names:
                full = f"{package}.{alias.name}"
                yield full if full in modules else owner(package)
        elif isinstance(node, ast.Call) and (name := _dynamic_name(node)) is not None:
            yield owner(name)


def module_edges(root: Path, packages: Sequence[str]) -> dict[str, set[str]]:
    """Which modules of ``packages`` each of their modules loads (`loaded_modules`), TYPE_CHECKING imports and
    imports inside functions included."""
    paths = {module_name(root, path): path for package in packages for path in (root / package).rglob("*.py")}
    modules = set(paths)
    return {
        module: {target for target in loaded_modules(path, module, modules) if target and target != module}
        for module, path in paths.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``edges``: each strongly connected component of more than one module (Tarjan's
    algorithm), its modules sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(edges.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return sorted(found)
