"""The built kernel library as Python sees it: its module name, how it is imported, and the errors of building
and importing it (shared by the package and ``ffi_kernels.build``)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

MODULE_NAME = "_ls_kernels"


class KernelBuildError(RuntimeError):
    """The kernel library could not be built; the message carries the compiler output."""


class NvccNotFoundError(KernelBuildError, FileNotFoundError):
    """No CUDA compiler (nvcc) was found."""


class KernelImportError(ImportError):
    """The built kernel library exists but Python cannot import it."""


def import_library(path: Path) -> ModuleType:
    """Imports the extension module at ``path`` (it registers nothing by itself)."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    if spec is None:
        raise KernelImportError(f"{path} is not an importable extension module")
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as err:
        raise KernelImportError(f"cannot import the ls-jax kernel library {path}: {err}") from err
    return module
