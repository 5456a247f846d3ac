"""Compiles the kernel library: every ``csrc/*.cu`` plus ``csrc/module.cc`` into one Python extension module.

``python -m ffi_kernels.build [--arch sm_90 ...] [--force] [--verbose]`` builds (or finds) the library and
prints its path, GPU architectures, build seconds, FFI target names and whether cuDNN attention is in it.

``csrc/attention_cudnn.cu`` (cuDNN's fused attention) is compiled only where its headers and libraries are found
(``cudnn_config``): cuDNN from the ``nvidia-cudnn-cu13`` or ``-cu12`` wheel JAX's CUDA plugin installs, the header-only
cuDNN frontend from ``nvidia-cudnn-frontend`` (``pip install ls-jax[gpu]``; a ``pip install --target`` directory on
PYTHONPATH works too) and NVRTC, which the frontend's headers reference, from ``nvidia-cuda-nvrtc`` or the CUDA
toolkit. Without them the library is built without that file and attention falls back to XLA beyond the
short-sequence kernels, naming the missing package.

Builds are cached in ``${LS_JAX_CACHE:-~/.cache/ls_jax}/kernels/<key>/`` where the key hashes everything the
binary depends on: the jaxlib version (its FFI headers), the Python version and ABI, the nvcc version, the
GPU architectures, the compiler flags and the bytes of every file in ``csrc/``. Editing a kernel therefore
rebuilds it; a second process building the same key waits on a file lock and reuses the result.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Sequence

from ffi_kernels.library import MODULE_NAME, KernelBuildError, NvccNotFoundError, import_library

logger = logging.getLogger("ffi_kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
DEFAULT_ARCHS = ("sm_80", "sm_90")
_ARCH_PATTERN = re.compile(r"^sm_\d+[a-z]?$")
_DEFAULT_CUDA_HOME = Path("/usr/local/cuda")
_MANIFEST = "manifest.json"
CUDNN_SOURCES = ("attention_cudnn.cu",)
_CUDNN_DISTRIBUTIONS = ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")
_NVRTC_DISTRIBUTIONS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12")


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """A built library: the extension module file, its architectures, how long building took, and why cuDNN
    attention is not in it (None when it is)."""

    path: Path
    archs: tuple[str, ...]
    seconds: float
    cached: bool
    cudnn_missing: str | None = None


@dataclasses.dataclass(frozen=True)
class CudnnConfig:
    """Where cuDNN attention's headers and libraries are: include directories and the shared libraries to link
    (each with an rpath to its directory)."""

    include_dirs: tuple[str, ...]
    libraries: tuple[Path, ...]

    def compile_flags(self) -> list[str]:
        return [flag for path in self.include_dirs for flag in ("-isystem", path)]

    def link_flags(self) -> list[str]:
        flags = []
        for library in self.libraries:
            flags += [f"-L{library.parent}", f"-l:{library.name}", f"-Xlinker=-rpath={library.parent}"]
        return flags


class CudnnNotFoundError(KernelBuildError):
    """cuDNN attention cannot be built here; the message names the missing package."""


def find_nvcc() -> Path:
    """nvcc from ``$CUDA_HOME``/``$CUDA_PATH``, else ``PATH``, else ``/usr/local/cuda``."""
    candidates = [Path(os.environ[var]) / "bin" / "nvcc" for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var)]
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(_DEFAULT_CUDA_HOME / "bin" / "nvcc")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise NvccNotFoundError(
        "nvcc not found (looked in $CUDA_HOME/bin, $CUDA_PATH/bin, PATH and /usr/local/cuda/bin): install the CUDA "
        "toolkit or set CUDA_HOME to build the ls-jax kernels, or set LS_JAX_KERNELS=xla to run without them"
    )


def detect_archs() -> tuple[str, ...]:
    """The ``sm_XY`` of every local GPU (from nvidia-smi), or ``DEFAULT_ARCHS`` when none can be queried."""
    try:
        output = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return DEFAULT_ARCHS
    archs = sorted({"sm_" + line.strip().replace(".", "") for line in output.splitlines() if line.strip()})
    return tuple(archs) or DEFAULT_ARCHS


def _arch_number(arch: str) -> int:
    return int(re.sub(r"\D", "", arch))


def validate_archs(archs: Sequence[str]) -> tuple[str, ...]:
    """The distinct architectures in ascending order (one cache key per set); ValueError unless all are sm_XY."""
    bad = [arch for arch in archs if not _ARCH_PATTERN.match(arch)]
    if bad or not archs:
        raise ValueError(f"GPU architectures must look like sm_90, got {list(archs)}")
    return tuple(sorted(set(archs), key=lambda arch: (_arch_number(arch), arch)))


def sources(with_cudnn: bool = False) -> list[Path]:
    """Every kernel translation unit (``csrc/*.cu``; ``CUDNN_SOURCES`` only ``with_cudnn``) followed by the Python
    module (``csrc/module.cc``)."""
    kernels = [path for path in sorted(CSRC.glob("*.cu")) if with_cudnn or path.name not in CUDNN_SOURCES]
    return kernels + [CSRC / "module.cc"]


def _distribution_file(distributions: Sequence[str], suffix: str) -> Path | None:
    """The first installed file of the first of ``distributions`` (pip package names, found through
    importlib.metadata, so site-packages and PYTHONPATH directories alike) whose path ends with ``suffix``."""
    for name in distributions:
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for file in distribution.files or ():
            if file.as_posix().endswith(suffix):
                located = Path(distribution.locate_file(file))
                if located.is_file():
                    return located
    return None


def _library_file(distributions: Sequence[str], directory_suffix: str, stem: str) -> Path | None:
    """The versioned shared library ``<stem>.so.<major>`` in a distribution's ``directory_suffix`` directory."""
    for name in distributions:
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for file in distribution.files or ():
            posix = file.as_posix()
            if re.search(rf"{re.escape(directory_suffix)}/{re.escape(stem)}\.so\.\d+$", posix):
                located = Path(distribution.locate_file(file))
                if located.is_file():
                    return located
    return None


def _nvrtc(nvcc: Path) -> tuple[Path, Path] | None:
    """(directory of nvrtc.h, libnvrtc.so.N): the nvidia-cuda-nvrtc wheel's, else the CUDA toolkit's of nvcc."""
    header = _distribution_file(_NVRTC_DISTRIBUTIONS, "include/nvrtc.h")
    library = _library_file(_NVRTC_DISTRIBUTIONS, "lib", "libnvrtc")
    if header is not None and library is not None:
        return header.parent, library
    toolkit = nvcc.resolve().parent.parent
    libraries = sorted((toolkit / "lib64").glob("libnvrtc.so.[0-9]*"), key=lambda path: len(path.name))
    if (toolkit / "include" / "nvrtc.h").is_file() and libraries:
        return toolkit / "include", libraries[0]
    return None


def cudnn_config(nvcc: Path) -> CudnnConfig:
    """Headers and libraries for ``CUDNN_SOURCES``.

    Raises:
      CudnnNotFoundError: naming the package to install.
    """
    cudnn_header = _distribution_file(_CUDNN_DISTRIBUTIONS, "include/cudnn.h")
    cudnn_library = _library_file(_CUDNN_DISTRIBUTIONS, "lib", "libcudnn")
    if cudnn_header is None or cudnn_library is None:
        raise CudnnNotFoundError(
            "cuDNN attention needs cuDNN's headers and library from the nvidia-cudnn-cu13 (or -cu12) package that "
            "jax[cuda13] installs; it is not installed for this Python"
        )
    frontend_header = _distribution_file(("nvidia-cudnn-frontend",), "include/cudnn_frontend.h")
    if frontend_header is None:
        raise CudnnNotFoundError(
            "cuDNN attention needs the cuDNN frontend headers: pip install nvidia-cudnn-frontend (or ls-jax[gpu])"
        )
    nvrtc = _nvrtc(nvcc)
    if nvrtc is None:
        raise CudnnNotFoundError(
            "cuDNN attention needs NVRTC (nvrtc.h and libnvrtc), which the cuDNN frontend headers reference: "
            "pip install nvidia-cuda-nvrtc (jax[cuda13] installs it) or a CUDA toolkit with NVRTC"
        )
    include_dirs = (str(cudnn_header.parent), str(frontend_header.parent), str(nvrtc[0]))
    return CudnnConfig(include_dirs, (cudnn_library, nvrtc[1]))


def _cudnn_or_reason(nvcc: Path) -> CudnnConfig | str:
    try:
        return cudnn_config(nvcc)
    except CudnnNotFoundError as err:
        return str(err)


def include_dirs() -> list[str]:
    """XLA's FFI headers (from the installed jaxlib), pybind11's and Python's."""
    import jax.ffi

    try:
        import pybind11
    except ImportError as err:
        raise KernelBuildError("building the kernels needs pybind11: pip install pybind11 (or ls-jax[gpu])") from err
    python = sysconfig.get_paths()["include"]
    if not (Path(python) / "Python.h").is_file():
        raise KernelBuildError(
            f"Python headers not found in {python}: install the python{sys.version_info.major}."
            f"{sys.version_info.minor} development package to build the kernels"
        )
    return [jax.ffi.include_dir(), pybind11.get_include(), python]


def compile_flags(archs: Sequence[str]) -> list[str]:
    """nvcc flags shared by every translation unit: SASS for each arch plus PTX of the newest for later GPUs."""
    gencode = [f"-gencode=arch=compute_{arch[3:]},code={arch}" for arch in archs]
    newest = max(archs, key=_arch_number)
    gencode.append(f"-gencode=arch=compute_{newest[3:]},code=compute_{newest[3:]}")
    headers = [flag for path in include_dirs() for flag in ("-isystem", path)]
    return ["-std=c++17", "-O3", "-lineinfo", "-Xcompiler=-fPIC", *gencode, *headers]


def _nvcc_version(nvcc: Path) -> str:
    return subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout


def cache_key(nvcc: Path, archs: Sequence[str], cudnn: CudnnConfig | str) -> str:
    digest = hashlib.sha256()
    parts = [
        metadata.version("jaxlib"),
        sys.version,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        _nvcc_version(nvcc),
        " ".join(compile_flags(archs)),
        repr(cudnn),  # installing the cuDNN packages later (or moving them) gives a new build
    ]
    for part in parts:
        digest.update(part.encode() + b"\0")
    for path in sorted(CSRC.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def cache_root() -> Path:
    return Path(os.environ.get("LS_JAX_CACHE", "~/.cache/ls_jax")).expanduser() / "kernels"


def library_name() -> str:
    return MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def _run(command: list[str], what: str) -> None:
    process = subprocess.run(command, capture_output=True, text=True)
    if process.returncode != 0:
        raise KernelBuildError(
            f"{what} failed (exit {process.returncode}):\n$ {' '.join(command)}\n{process.stdout}{process.stderr}"
        )
    if process.stderr.strip():
        logger.info("%s:\n%s", what, process.stderr)


def _compile_and_link(
    nvcc: Path, archs: Sequence[str], work: Path, output: Path, verbose: bool, cudnn: CudnnConfig | None
) -> None:
    flags = compile_flags(archs) + (["-Xptxas=-v"] if verbose else [])
    units = sources(with_cudnn=cudnn is not None)
    objects = [work / (source.name + ".o") for source in units]
    jobs = []
    for source, obj in zip(units, objects):
        extra = cudnn.compile_flags() if cudnn is not None and source.name in CUDNN_SOURCES else []
        jobs.append(([str(nvcc), "-c", str(source), "-o", str(obj), *flags, *extra], f"compiling {source.name}"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for future in [pool.submit(_run, *job) for job in jobs]:
            future.result()
    link = cudnn.link_flags() if cudnn is not None else []
    _run([str(nvcc), "-shared", "-o", str(output), *map(str, objects), *link], "linking the kernel library")


def build(
    archs: Sequence[str] | None = None,
    *,
    force: bool = False,
    verbose: bool = False,
    cache_dir: Path | None = None,
) -> BuildResult:
    """Builds the library for ``archs`` (default: the local GPUs', else sm_80 + sm_90) unless it is cached.

    Raises:
      NvccNotFoundError: no nvcc.
      KernelBuildError: a compile or link step failed; the message holds the command and compiler output.
    """
    nvcc = find_nvcc()
    archs = validate_archs(archs or detect_archs())
    cudnn = _cudnn_or_reason(nvcc)
    cudnn_missing = cudnn if isinstance(cudnn, str) else None
    target_dir = (cache_dir or cache_root()) / cache_key(nvcc, archs, cudnn)
    target_dir.mkdir(parents=True, exist_ok=True)
    library = target_dir / library_name()
    manifest = target_dir / _MANIFEST
    with open(target_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists() and manifest.exists() and not force:
            recorded = json.loads(manifest.read_text())
            return BuildResult(
                library, tuple(recorded["archs"]), recorded["seconds"], cached=True, cudnn_missing=cudnn_missing
            )
        logger.warning(
            "ls_jax: compiling the CUDA kernels for %s into %s (once per version and GPU)", ", ".join(archs), target_dir
        )
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=target_dir) as work:
            staged = Path(work) / library.name
            _compile_and_link(nvcc, archs, Path(work), staged, verbose, None if cudnn_missing else cudnn)
            os.replace(staged, library)
        seconds = time.perf_counter() - start
        manifest.write_text(json.dumps({"archs": list(archs), "seconds": seconds, "nvcc": str(nvcc)}) + "\n")
    if cudnn_missing:
        logger.warning("ls_jax: built without cuDNN attention: %s", cudnn_missing)
    return BuildResult(library, archs, seconds, cached=False, cudnn_missing=cudnn_missing)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ffi_kernels.build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch",
        action="append",
        metavar="SM",
        help=f"GPU architecture to compile for, e.g. sm_90 (repeatable; default: the local GPUs', "
        f"else {' '.join(DEFAULT_ARCHS)})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    parser.add_argument("--verbose", action="store_true", help="print ptxas register and spill reports")
    parser.add_argument("--cache-dir", type=Path, help="cache root (default: $LS_JAX_CACHE/kernels)")
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = build(args.arch, force=args.force, verbose=args.verbose, cache_dir=args.cache_dir)
    except (KernelBuildError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    names = sorted(import_library(result.path).targets())
    print(f"library: {result.path}")
    print(f"archs:   {' '.join(result.archs)}")
    print(f"seconds: {result.seconds:.1f}{' (cached build)' if result.cached else ''}")
    print(f"targets: {' '.join(names)}")
    print(f"cudnn:   {'built in' if result.cudnn_missing is None else 'left out: ' + result.cudnn_missing}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
