"""The training step compiled ahead of training, once per distinct batch shape, with XLA's FLOP count of each.

The FLOP count is XLA's cost analysis of the step as lowered, before optimization: there every matmul is still a
``dot``. After optimization a GPU's matmuls are cuBLAS library calls that the cost analysis counts as 0 FLOPs (on
the H100 the compiled step's count was 38-40% of the analytic one), so the compiled module's count is not the step's.
It is counted on a thread of its own once the step has compiled (a second or so for BERT-base on the host), so
compilation, and a run whose steps all come from the compilation cache, does not wait for it.

Every distinct batch shape is compiled before training (`StepCompiler.precompile`), so training time holds no
compilation; on a GPU each compiled step then runs once on a copy of the state (`StepCompiler.warm_up`), so neither
does the one-time work of a first execution. The step takes the state (placed as `train.harness.parallel.StateLayout`
says) and a batch sharded along its
row axis (axis 1, after the grad-accumulation axis), runs per device inside ``shard_map``, and donates the state.

Given `train.harness.executable_cache.StepExecutables`, a step found there is loaded without being traced, and a
step compiled here is kept there (after its FLOP count, on the counting thread) for later runs.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ls_jax.layers import fp8
from train.costs import metrics as metrics_lib
from train.harness import compile_cache
from train.harness.executable_cache import StepExecutables, keepable
from train.harness.parallel import StateLayout
from train.harness.step import TrainState


class StepCompiler:
    """Compiles the step once per distinct batch shape and remembers XLA's FLOP count for each."""

    def __init__(
        self, step_fn: Callable, layout: StateLayout, state: TrainState, executables: StepExecutables | None = None
    ):
        """``step_fn`` runs per device inside ``shard_map`` (`DataParallel.shard_step`); ``state`` gives the shape of
        the state's placement (whether it has a loss scale) and whether the step multiplies in FP8 (compiled with
        `ls_jax.layers.fp8.compiler_options`), ``layout`` where each part lives; ``executables`` the steps kept on
        disk (None: none)."""
        parallel = layout.parallel
        shardings = layout.shardings(state)
        self._step_fn = step_fn
        self._shardings = shardings
        self._executables = executables
        self._entries: dict[tuple, str] = {}  # the executables' entry of each step compiled here
        self._jitted = jax.jit(
            parallel.shard_step(step_fn, layout.specs(state)),
            in_shardings=(shardings, parallel.rows_sharding(1)),
            out_shardings=(shardings, parallel.replicated),
            donate_argnums=(0,),
        )
        self._parallel = parallel
        self._options = parallel.compiler_options()
        if state.scaling:
            self._options |= fp8.compiler_options(parallel.mesh.devices.flat[0].platform)
        self._copy_state = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=shardings)
        self._compiled: dict[tuple, Any] = {}
        self._flop_counts: dict[tuple, concurrent.futures.Future | None] = {}
        self._counting = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="flop-count")

    @staticmethod
    def key(batch: Mapping[str, Any]) -> tuple:
        return tuple(sorted((name, tuple(value.shape), str(value.dtype)) for name, value in batch.items()))

    def compiled(self, state: TrainState, batch: Mapping[str, Any]) -> Any:
        key = self.key(batch)
        if key not in self._compiled and not self._load(key, state, batch):
            lowered = self.lower(state, batch)
            self._store(key, lowered, *self._compile(lowered))
        return self._compiled[key]

    def precompile(self, state: TrainState, global_shapes: Iterable[Mapping[str, tuple[tuple[int, ...], Any]]]) -> None:
        """Compiles every given global batch shape ({name: (shape, dtype)}) ahead of training.

        Tracing runs here, one shape after another (it reads the kernel mode of this thread); the XLA
        compilations, which release the GIL, then run side by side in threads.
        """
        # Nothing runs while XLA compiles: on a 2-core CPU a collective still in flight from the state's
        # initialization once waited 5 minutes for its second device while the compilations ran, and aborted.
        jax.block_until_ready(state)
        lowered = {}
        for shapes in global_shapes:
            batch = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in shapes.items()}
            key = self.key(batch)
            if key not in self._compiled and key not in lowered and not self._load(key, state, batch):
                lowered[key] = self.lower(state, batch)
        if not lowered:
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(lowered), os.cpu_count() or 1)) as pool:
            for (key, before), (compiled, from_xla_cache) in zip(
                lowered.items(), pool.map(self._compile, lowered.values())
            ):
                self._store(key, before, compiled, from_xla_cache)

    def warm_up(self, state: TrainState) -> None:
        """Runs every compiled step once on a copy of ``state`` and a batch of ones, and drops the result.

        The first execution of a step does one-time work inside it: cuDNN builds the graphs of the attention
        handlers at their initialize stage (about 2 s of a BERT-base step's first execution on an H100), CUDA loads
        modules. Done here, that work stays out of the training steps and their time and energy. ``state`` itself is
        untouched (the step donates only the copy); while this runs the device holds the state twice.
        """
        scratch = self._copy_state(state)
        sharding = self._parallel.rows_sharding(1)
        for key, compiled in self._compiled.items():
            batch = {
                name: jax.make_array_from_callback(
                    shape, sharding, lambda index, s=shape, d=dtype: np.ones(s, d)[index]
                )
                for name, shape, dtype in key
            }
            scratch, _ = compiled(scratch, batch)
        jax.block_until_ready(scratch)

    def xla_flops(self, key: tuple) -> float | None:
        """XLA's FLOP count of the whole step, over every device, compiled for the batches of ``key`` (`key`), waited
        for; None where XLA has no count (or the step accumulates micro-batches)."""
        count = self._flop_counts[key]
        return None if count is None else count.result()

    def memory_analysis(self) -> Any | None:
        """XLA's memory analysis of the compiled step with the most temporaries, or None before any compiled."""
        analyses = [compiled.memory_analysis() for compiled in self._compiled.values()]
        analyses = [analysis for analysis in analyses if analysis is not None]
        return max(analyses, key=lambda analysis: analysis.temp_size_in_bytes, default=None)

    def lower(self, state: TrainState, batch: Mapping[str, Any]) -> Any:
        """The step lowered for ``batch``'s shapes (arrays or ShapeDtypeStructs), the batch sharded along its rows."""
        sharding = self._parallel.rows_sharding(1)
        abstract = {
            name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding) for name, value in batch.items()
        }
        return self._jitted.lower(state, abstract)

    def _load(self, key: tuple, state: TrainState, batch: Mapping[str, Any]) -> bool:
        """Whether the step for ``batch`` came from the executables (then it is compiled, with its FLOP count)."""
        if self._executables is None:
            return False
        abstract = {name: jax.ShapeDtypeStruct(value.shape, value.dtype) for name, value in batch.items()}
        devices = list(self._parallel.mesh.devices.flat)
        sharding = self._parallel.rows_sharding(1)
        entry = self._entries[key] = self._executables.key(
            self._step_fn, state, self._shardings, abstract, sharding, self._options, devices
        )
        loaded = self._executables.load(entry, (state, abstract), devices)
        if loaded is None:
            return False
        self._compiled[key] = loaded.compiled
        self._flop_counts[key] = counted = concurrent.futures.Future()
        counted.set_result(loaded.flops)
        compile_cache.count_loaded_step()
        return True

    def _compile(self, lowered: Any) -> tuple[Any, bool]:
        """``lowered`` compiled, and whether XLA's persistent cache answered it."""
        hits = compile_cache.hits_in_this_thread()
        compiled = lowered.compile(self._options)
        return compiled, compile_cache.hits_in_this_thread() > hits

    def _store(self, key: tuple, lowered: Any, compiled: Any, from_xla_cache: bool) -> None:
        self._compiled[key] = compiled
        # XLA's cost analysis counts a loop body once, so it cannot count accumulated micro-batches.
        single_micro_batch = all(shape[0] == 1 for _, shape, _ in key)
        count = self._counting.submit(self._count_flops, lowered) if single_micro_batch else None
        self._flop_counts[key] = count
        platform = self._parallel.mesh.devices.flat[0].platform
        if key in self._entries and keepable(platform, from_xla_cache):  # kept once counted, on the same thread
            self._counting.submit(
                lambda: self._executables.store(self._entries[key], compiled, None if count is None else count.result())
            )

    def _count_flops(self, lowered: Any) -> float | None:
        flops = metrics_lib.xla_flops(lowered)
        # Inside shard_map the lowered module is one device's program: its count is one device's share of the step.
        return None if flops is None else flops * self._parallel.num_shards
