"""XLA's persistent compilation cache for the training tools, on unless ``--no-compile-cache``.

A compiled program is written to the cache directory and loaded again by a later process that compiles the same
program on the same devices and versions: a re-run, a resumed run, a sweep's runs of repeated shapes skip most of
their compilation. The directory is ``$JAX_COMPILATION_CACHE_DIR`` when set, else
``${XDG_CACHE_HOME:-~/.cache}/ls_jax/xla``. Every program is written, however fast it compiled (unless
``$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise): under JAX's default threshold of one second a
run's dozen small programs (state creation, evaluation, metrics) compile again on every re-run. The cache is left
unbounded, as JAX leaves it: JAX's size limit (``jax_compilation_cache_max_size``) keeps a second file per entry,
and a process stopped between writing the two (a Ctrl-C during compilation) leaves every later write to that
directory failing with a warning. Delete the directory to empty it.

`CacheUse` counts, through ``jax.monitoring``, the compilations that asked the cache and those it answered, and sums
the seconds JAX spent tracing, lowering and compiling (or loading from the cache) every program of the process, so
the summary can say how much of the compilation came from the cache and what a cached program still costs: JAX
traces and lowers a program before it can look it up. The training step is also kept whole in a folder of the same
directory (`train.harness.executable_cache`), loaded without tracing; `count_loaded_step` counts those loads.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import jax

REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Durations JAX records per program: its trace to a jaxpr, the jaxpr lowered to StableHLO, and XLA's compilation
# (a cached program: its load from the cache).
DURATION_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "backend_compile_s",
}


def default_directory() -> Path:
    """Where the cache lives unless ``$JAX_COMPILATION_CACHE_DIR`` says otherwise."""
    root = os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()
    return Path(root) / "ls_jax" / "xla"


def enable(on: bool) -> Path | None:
    """Turns the cache on in its directory (made if missing) or off, and starts counting its use (`use`); returns
    the directory, None when off."""
    use()
    if not on:
        jax.config.update("jax_enable_compilation_cache", False)
        _use.directory = None
        return None
    directory = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_directory())
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _use.directory = str(directory)
    return directory


@dataclasses.dataclass
class CacheUse:
    """The cache's ``directory`` (None: off), the compilations of this process that asked it (``requests``) and
    that it answered (``hits``), the training steps loaded whole without tracing (``steps_loaded``, not among the
    requests), and the seconds of `DURATION_EVENTS` over every program of the process."""

    directory: str | None = None
    requests: int = 0
    hits: int = 0
    steps_loaded: int = 0
    trace_s: float = 0.0
    lower_s: float = 0.0
    backend_compile_s: float = 0.0


def use() -> CacheUse:
    """This process's running counts (listening from the first call on)."""
    global _registered
    with _listening:
        if not _registered:
            jax.monitoring.register_event_listener(_count)
            jax.monitoring.register_event_duration_secs_listener(_add_duration)
            _registered = True
    return _use


_use = CacheUse()
_this_thread = threading.local()
_listening = threading.Lock()
_registered = False


def hits_in_this_thread() -> int:
    """How many of this thread's compilations the cache has answered: read before and after a compilation, whether
    that one came from the cache (JAX reports a hit on the thread that compiles)."""
    return getattr(_this_thread, "hits", 0)


def count_loaded_step() -> None:
    """Counts a training step loaded from `train.harness.executable_cache`."""
    with _listening:
        _use.steps_loaded += 1


def _count(event: str, **_: object) -> None:
    with _listening:  # programs compile on more than one thread (`train.costs.compiled`)
        if event == REQUEST_EVENT:
            _use.requests += 1
        elif event == HIT_EVENT:
            _use.hits += 1
            _this_thread.hits = hits_in_this_thread() + 1


def _add_duration(event: str, duration: float, **_: object) -> None:
    field = DURATION_EVENTS.get(event)
    if field is not None:
        with _listening:
            setattr(_use, field, getattr(_use, field) + duration)
