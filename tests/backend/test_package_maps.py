"""Each package docstring that maps its modules (a ``name   what it holds`` line per module) names every module
of the package, and only modules that exist."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(
    path.parent for top in ("ls_jax", "train", "ffi_kernels", "tpu") for path in (ROOT / top).rglob("__init__.py")
)
_ENTRY = re.compile(r"^ {0,2}([\w./]+(?: [\w./]+)*?) {2,}\S")
_SOURCES = (".py", ".h", ".cc", ".cu", ".cuh", ".toml")


def mapped_names(package: Path) -> set[str]:
    """The module names of the package docstring's map lines (``<...>`` templates left out)."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    names: set[str] = set()
    for line in docstring.splitlines():
        match = _ENTRY.match(line)
        if match:
            names.update(name.rstrip("/").removesuffix(".py") for name in match.group(1).split())
    return names


def modules(package: Path) -> set[str]:
    """The package's modules and subpackages (what a map line names)."""
    found = {path.stem for path in package.glob("*.py") if path.stem != "__init__" and not path.stem.startswith("_")}
    found |= {path.name for path in package.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    return found


def exists(package: Path, name: str) -> bool:
    if name.endswith(_SOURCES) or "/" in name:
        return (package / name).exists()
    return (package / f"{name}.py").exists() or (package / name).is_dir()


MAPPED = [package for package in PACKAGES if len(mapped_names(package)) >= 2]


@pytest.mark.parametrize("package", MAPPED, ids=[str(p.relative_to(ROOT)) for p in MAPPED])
def test_the_map_names_every_module_and_only_modules_that_exist(package):
    names = mapped_names(package)
    assert not {name for name in names if not exists(package, name)}, "named but missing"
    assert not modules(package) - names, "modules the map leaves out"


def test_the_maps_are_found():
    assert {"train/harness", "train/records", "train/costs", "train"} <= {str(p.relative_to(ROOT)) for p in MAPPED}
