"""ls-jax CUDA kernels, exposed to JAX as typed XLA FFI custom-call targets.

Layout
  csrc/registry.h    the target table; ``LS_REGISTER_TARGET(symbol)`` appends an extern "C" handler to it
  csrc/common.cuh    what every kernel shares: ``LS_FFI_TARGET`` (define + register a command-buffer-compatible
                     handler), ``LS_RETURN_IF_ERROR`` / ``require`` / ``launch_error`` (ffi::Error, never abort),
                     shape helpers, ``dispatch_float`` (F32/BF16/F16 -> float/__nv_bfloat16/__half) and
                     ``dispatch_param`` (f32 or the activation dtype), ``load_floats`` / ``store_floats``
                     (16-byte vectors converted to f32 registers), ``warp_reduce`` / ``group_reduce`` (sum, max;
                     deterministic), Philox ``Dropout`` bit-exact with ls_jax/ops/random.py, ``sm_count`` and
                     ``stride_grid`` (launch sizing, SM count cached per device)
  csrc/rows.cuh      row-streaming layouts and the deterministic reduction of per-block column partials
  csrc/module.cc     the pybind11 module ``_ls_kernels``: ``targets()`` -> {name: PyCapsule or {stage: PyCapsule}}
  csrc/<op>.cu       one file per op family, each registering its own targets (dropout.cu is the worked example)
  csrc/attention_cudnn.cu  cuDNN's fused attention from FFI handlers (cuDNN frontend graphs); built only where the
                     cuDNN packages are found (``cudnn_attention_missing`` says why not)
  library.py         the built module's name, how it is imported, the build and import errors
  build.py           nvcc build, cache and CLI (``python -m ffi_kernels.build [--arch sm_90] [--force] [--verbose]``)

Adding a kernel: create ``csrc/<name>.cu`` that includes ``common.cuh``, writes a handler returning
``ffi::Error`` and ends with ``LS_FFI_TARGET(ls_<name>, handler, ffi::Ffi::Bind()...)``. Nothing else changes:
the build compiles every ``csrc/*.cu`` and ``load()`` registers every target the module reports.

Calling it from an op (``ls_jax/ops/<op>.py``): ``jax.ffi.ffi_call("ls_<name>", out_types,
vmap_method="sequential")(*arrays, **attributes)`` with attributes as numpy scalars (``np.float32``,
``np.uint32``, ``np.int64``, ``bool``) so their types match the handler's ``Attr<T>``. Scratch memory is an extra
output the wrapper drops. The op passes that function as ``ffi_impl`` to ``ls_jax.ops._common.dispatch``,
which only traces it when lowering for CUDA with the kernels loaded.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from types import ModuleType

import jax

from ffi_kernels.library import KernelBuildError, KernelImportError, NvccNotFoundError, import_library

__all__ = [
    "KernelBuildError",
    "KernelImportError",
    "NvccNotFoundError",
    "cudnn_attention_missing",
    "import_library",
    "load",
    "sm_count",
]


_lock = threading.Lock()
_library: ModuleType | None = None
_cudnn_missing: str | None = None


def load() -> tuple[str, ...]:
    """Builds the library if needed, imports it and registers every target with XLA for CUDA (once per process).

    Returns:
      The registered target names.

    Raises:
      NvccNotFoundError, KernelBuildError, KernelImportError: as named; the message says what to do.
    """
    global _library, _cudnn_missing
    with _lock:
        if _library is None:
            from ffi_kernels import build  # not at the top: `python -m ffi_kernels.build` imports this package first

            result = build.build()
            library = import_library(result.path)
            for name, handlers in library.targets().items():  # a PyCapsule, or {stage name: PyCapsule}
                jax.ffi.register_ffi_target(name, handlers, platform="CUDA")
            _library, _cudnn_missing = library, result.cudnn_missing
        return tuple(sorted(_library.targets()))


def cudnn_attention_missing() -> str | None:
    """Why the loaded library has no cuDNN attention targets (the missing package), or None when it has them."""
    load()
    return _cudnn_missing


def cudnn_workspace_peak_bytes(device: int = 0) -> int | None:
    """The most bytes cuDNN attention's workspace pool on CUDA ``device`` had in use at once since the previous read
    (reading resets the mark); None when the library has no cuDNN attention or none ran on that device. The pool
    lies outside XLA's allocator, so XLA's memory statistics do not count it."""
    if cudnn_attention_missing() is not None:
        return None
    assert _library is not None
    peak = ctypes.CDLL(_library.__file__).ls_attention_cudnn_workspace_peak  # the loaded library: dlopen reuses it
    peak.restype, peak.argtypes = ctypes.c_int64, [ctypes.c_int]
    value = int(peak(device))
    return None if value < 0 else value


def cudnn_graphs_built_in_execute() -> int | None:
    """How many cuDNN attention graphs the execute handlers built themselves in this process (0 while the initialize
    stage built every one); None when the library has no cuDNN attention."""
    if cudnn_attention_missing() is not None:
        return None
    assert _library is not None
    count = ctypes.CDLL(_library.__file__).ls_attention_cudnn_graphs_built_in_execute
    count.restype, count.argtypes = ctypes.c_int64, []
    return int(count())


@functools.cache
def sm_count() -> int:
    """Streaming multiprocessors of CUDA device 0 of this process."""
    load()
    assert _library is not None
    return int(_library.multiprocessor_count(0))
