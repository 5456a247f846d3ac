"""Which implementation the fused ops run: the CUDA kernels ("ffi") or plain XLA ("xla").

The mode is read when an op is traced, in this order:
  1. the innermost ``with ls_jax.backend.use(mode):`` block,
  2. the environment variable ``LS_JAX_KERNELS`` (auto | ffi | xla),
  3. ``"auto"``.

``auto`` uses the kernels when JAX sees a CUDA device and the kernel library loads; if a CUDA device is
present but the library cannot load, it warns once and runs XLA. ``ffi`` insists on the kernels and raises
``KernelsUnavailableError`` naming the reason when they cannot load. ``xla`` never touches the kernels.
Even with the kernels loaded, a computation lowered for a non-CUDA platform (CPU, TPU) runs the XLA code:
ops choose per platform with ``jax.lax.platform_dependent``.

The mode is a trace-time decision: a function jitted under one mode keeps it for its cached compilations.
Wrap a fresh function (or call ``jax.clear_caches()``) when switching modes inside one process.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings
from typing import Iterator, Literal, cast

KernelMode = Literal["auto", "ffi", "xla"]
MODES: tuple[KernelMode, ...] = ("auto", "ffi", "xla")
ENV_VAR = "LS_JAX_KERNELS"

_scoped_mode: contextvars.ContextVar[KernelMode | None] = contextvars.ContextVar("ls_jax_kernels", default=None)


class KernelsUnavailableError(RuntimeError):
    """The CUDA kernels were required (mode ``ffi``) but cannot be used here."""


def _validate(mode: str, source: str) -> KernelMode:
    if mode not in MODES:
        raise ValueError(f"{source}={mode!r} is not a kernel mode; expected one of {', '.join(MODES)}")
    return cast(KernelMode, mode)


def requested_mode() -> KernelMode:
    """The mode in force: the innermost ``use`` block, else ``$LS_JAX_KERNELS``, else ``auto``."""
    scoped = _scoped_mode.get()
    if scoped is not None:
        return scoped
    return _validate(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


@contextlib.contextmanager
def use(mode: KernelMode) -> Iterator[None]:
    """Run ops traced inside this block with ``mode`` (auto | ffi | xla)."""
    token = _scoped_mode.set(_validate(mode, "mode"))
    try:
        yield
    finally:
        _scoped_mode.reset(token)


def cuda_visible() -> bool:
    """Whether JAX has a CUDA backend with at least one device."""
    import jax

    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


@functools.cache
def _load_kernels() -> str | None:
    """Loads and registers the kernel library once; returns None on success or the reason it failed."""
    if not cuda_visible():
        return "JAX sees no CUDA device (jax.devices('cuda') is empty or the CUDA plugin is not installed)"
    try:
        import ffi_kernels

        ffi_kernels.load()
    except Exception as err:  # noqa: BLE001 - any load failure is reported to the user as the reason
        return f"{type(err).__name__}: {err}"
    return None


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f"ls_jax: a CUDA device is present but the fused kernels could not be loaded ({reason}); "
        f"running the XLA implementations. Set {ENV_VAR}=xla to silence this, or {ENV_VAR}=ffi to make it an error.",
        RuntimeWarning,
        stacklevel=3,
    )


def kernels_enabled() -> bool:
    """Whether ops traced now dispatch to the CUDA kernels on CUDA platforms.

    Raises:
      KernelsUnavailableError: the mode is ``ffi`` and the kernels cannot be loaded.
    """
    mode = requested_mode()
    if mode == "xla":
        return False
    reason = _load_kernels()
    if reason is None:
        return True
    if mode == "ffi":
        raise KernelsUnavailableError(f"{ENV_VAR}=ffi (or backend.use('ffi')) requires the CUDA kernels: {reason}")
    if cuda_visible():
        _warn_fallback(reason)
    return False


def kernel_targets() -> tuple[str, ...]:
    """The FFI targets of the kernel library, loaded (and built) on first use.

    Raises:
      KernelsUnavailableError: the kernels cannot be loaded (the reason is in the message).
    """
    reason = _load_kernels()
    if reason is not None:
        raise KernelsUnavailableError(f"the CUDA kernels cannot be loaded: {reason}")
    import ffi_kernels

    return ffi_kernels.load()  # loaded already: the names


def active_backend() -> Literal["ffi", "xla"]:
    """The implementation that ops traced now run on JAX's default platform: ``"ffi"`` or ``"xla"``."""
    import jax

    return "ffi" if kernels_enabled() and jax.default_backend() == "gpu" else "xla"
