"""A task-agnostic training loop: data-parallel steps, logging, evaluation, checkpoints and signals.

A task supplies
  - ``loss_fn(params, micro_batch, rng) -> (loss_sum, weight, sums)``: the summed loss of one micro-batch, the
    weight it is normalized by (target tokens, examples) and other sums to report per weight (e.g. ``nll``);
  - a batch stream yielding ``(batch, counts)``: numpy arrays with a leading grad-accumulation axis and this
    host's rows, and the step's global counts (e.g. ``tokens``), with a ``position`` to resume from;
  - ``flops_fn(batch_shapes) -> int``: the analytic FLOPs of one step;
  - ``evaluate(state, final) -> [eval record fields]``.

One step (`make_train_step`) scans over the micro-batches, summing gradients of the summed loss, and divides
by the total weight, so accumulation gives the gradient of the mean over every token of the step:

    g = sum_i grad(loss_sum_i) / sum_i weight_i

then applies the optimizer (``ls_jax.optim.fused_apply``). With fp16 the loss is multiplied by a dynamic
scale s before differentiation and the gradients by 1/s after; a step whose gradients are not finite is skipped
(parameters and optimizer state unchanged), the scale halves, and it doubles after ``growth_interval`` finite
steps in a row. Without loss scaling a non-finite loss or gradient stops the run (``stop_reason`` "nan").

Data parallelism: one mesh axis ``data`` over all devices; the state is replicated and batches are sharded
along their row axis, so the same code runs on one device, several GPUs or a multi-host TPU slice (XLA inserts
the gradient all-reduce).

Timing: every distinct batch shape is compiled before training (`StepCompiler.precompile`), so training time
holds no compilation. Steps are dispatched one ahead of the host: the host reads step n's metrics after it has
queued step n+1, and step n's time is the time between the completions of steps n-1 and n. Evaluations and
checkpoint writes stop the clock.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

import ls_jax.optim
from ls_jax import backend as backend_lib
from train import metrics as metrics_lib
from train import runlog
from train.checkpoints import CheckpointMismatchError, Checkpoints
from train.input_pipeline import DataError
from train.runlog import RunLog

Batch = dict[str, np.ndarray]
LossFn = Callable[[Any, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]

PRECISION_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


# ------------------------------------------------------------------------------------------------- state


@flax.struct.dataclass
class DynamicLossScale:
    """fp16 loss scale: halves on a non-finite step, doubles after ``growth_interval`` finite steps."""

    scale: jax.Array  # f32 scalar
    finite_steps: jax.Array  # int32 scalar: finite steps since the last change
    growth_interval: int = flax.struct.field(pytree_node=False, default=2000)

    @classmethod
    def create(cls, initial_scale: float = 2.0**7, growth_interval: int = 2000) -> DynamicLossScale:
        """Starts at 2**7 as fairseq does: the loss being scaled is a sum over thousands of tokens."""
        return cls(jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32), growth_interval)

    def update(self, finite: jax.Array) -> DynamicLossScale:
        grow = finite & (self.finite_steps + 1 >= self.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, self.scale * 2.0, self.scale), jnp.maximum(self.scale * 0.5, 1.0))
        finite_steps = jnp.where(finite & ~grow, self.finite_steps + 1, 0)
        return self.replace(scale=scale, finite_steps=finite_steps)


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes; a checkpoint saves exactly this."""

    step: jax.Array  # int32 scalar: steps taken (skipped fp16 steps included)
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2] base key; step n uses fold_in(rng, n)
    loss_scale: DynamicLossScale | None = None

    @classmethod
    def create(cls, params: Any, tx: optax.GradientTransformation, rng: jax.Array, *, fp16: bool,
               param_dtype: Any = None) -> TrainState:
        """The step-0 state; ``param_dtype`` casts the params after ``tx.init`` has seen them (master weights:
        the optimizer keeps the f32 values, the model trains the cast ones)."""
        opt_state = tx.init(params)
        if param_dtype is not None:
            params = jax.tree.map(lambda p: p.astype(param_dtype), params)
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            rng=rng,
            loss_scale=DynamicLossScale.create() if fp16 else None,
        )


def _sum_trees(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation) -> Callable[[TrainState, Batch], tuple]:
    """``step(state, batch) -> (state, metrics)``; batch leaves have shape (grad_accum, rows, ...).

    ``metrics`` holds the sums over the step (``loss``, ``weight`` and the task's sums), the global gradient
    norm before clipping, ``finite`` and the loss scale used (1 without fp16).
    """

    def train_step(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        step_rng = jax.random.fold_in(state.rng, state.step)
        scale = jnp.float32(1.0) if state.loss_scale is None else state.loss_scale.scale

        def micro_step(index, micro_batch):
            def scaled_loss(params):
                loss_sum, weight, sums = loss_fn(params, micro_batch, jax.random.fold_in(step_rng, index))
                totals = {"loss": loss_sum, "weight": weight, **sums}
                return loss_sum * scale, jax.tree.map(lambda x: x.astype(jnp.float32), totals)

            grads, totals = jax.grad(scaled_loss, has_aux=True)(state.params)
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads), totals

        def accumulate(carry, inputs):
            grads, totals = micro_step(*inputs)
            return (_sum_trees(carry[0], grads), _sum_trees(carry[1], totals)), None

        # The first micro-batch starts the sums, so one micro-batch needs no loop at all.
        grads, totals = micro_step(0, jax.tree.map(lambda x: x[0], batch))
        num_micro = jax.tree.leaves(batch)[0].shape[0]
        if num_micro > 1:
            rest = jax.tree.map(lambda x: x[1:], batch)
            (grads, totals), _ = jax.lax.scan(accumulate, (grads, totals), (jnp.arange(1, num_micro), rest))

        denominator = scale * jnp.maximum(totals["weight"], 1.0)
        grads = jax.tree.map(lambda g, p: (g / denominator).astype(p.dtype), grads, state.params)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(totals["loss"])
        params, opt_state = ls_jax.optim.fused_apply(tx, grads, state.opt_state, state.params)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        if state.loss_scale is not None:
            keep_old = lambda new, old: jnp.where(finite, new, old)  # noqa: E731 - skip a non-finite fp16 step
            new_state = new_state.replace(
                params=jax.tree.map(keep_old, params, state.params),
                opt_state=jax.tree.map(keep_old, opt_state, state.opt_state),
                loss_scale=state.loss_scale.update(finite),
            )
        return new_state, {**totals, "grad_norm": grad_norm, "finite": finite, "loss_scale": scale}

    return train_step


# ------------------------------------------------------------------------------------ data parallelism


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """A one-axis mesh over every device: replicated state, batches sharded along their row axis."""

    mesh: Mesh

    @classmethod
    def over_all_devices(cls) -> DataParallel:
        return cls(Mesh(np.asarray(jax.devices()), ("data",)))

    @property
    def num_shards(self) -> int:
        return self.mesh.size

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def rows_sharding(self, row_axis: int) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*([None] * row_axis), "data"))

    def put_batch(self, local_batch: Batch, row_axis: int) -> dict[str, jax.Array]:
        """Assembles the global batch from every host's rows (this host's given as numpy)."""
        sharding = self.rows_sharding(row_axis)
        return {
            key: jax.make_array_from_process_local_data(sharding, value) for key, value in local_batch.items()
        }

    def replicate(self, tree: Any) -> Any:
        return jax.device_put(tree, self.replicated)


class StepCompiler:
    """Compiles the step once per distinct batch shape and remembers XLA's FLOP count for each."""

    def __init__(self, step_fn: Callable, parallel: DataParallel):
        self._jitted = jax.jit(
            step_fn,
            in_shardings=(parallel.replicated, parallel.rows_sharding(1)),
            out_shardings=(parallel.replicated, parallel.replicated),
            donate_argnums=(0,),
        )
        self._parallel = parallel
        self._compiled: dict[tuple, Any] = {}
        self.xla_flops: dict[tuple, float | None] = {}

    @staticmethod
    def key(batch: Mapping[str, Any]) -> tuple:
        return tuple(sorted((name, tuple(value.shape), str(value.dtype)) for name, value in batch.items()))

    def compiled(self, state: TrainState, batch: Mapping[str, Any]) -> Any:
        key = self.key(batch)
        if key not in self._compiled:
            self._store(key, self._lower(state, batch).compile())
        return self._compiled[key]

    def precompile(self, state: TrainState, global_shapes: Iterable[Mapping[str, tuple[tuple[int, ...], Any]]]) -> None:
        """Compiles every given global batch shape ({name: (shape, dtype)}) ahead of training.

        Tracing runs here, one shape after another (it reads the kernel mode of this thread); the XLA
        compilations, which release the GIL, then run side by side in threads.
        """
        lowered = {}
        for shapes in global_shapes:
            batch = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in shapes.items()}
            key = self.key(batch)
            if key not in self._compiled and key not in lowered:
                lowered[key] = self._lower(state, batch)
        if not lowered:
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(lowered), os.cpu_count() or 1)) as pool:
            for key, compiled in zip(lowered, pool.map(lambda item: item.compile(), lowered.values())):
                self._store(key, compiled)

    def _lower(self, state: TrainState, batch: Mapping[str, Any]) -> Any:
        sharding = self._parallel.rows_sharding(1)
        abstract = {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding) for name, value in batch.items()}
        return self._jitted.lower(state, abstract)

    def _store(self, key: tuple, compiled: Any) -> None:
        self._compiled[key] = compiled
        # XLA's cost analysis counts a loop body once, so it cannot count accumulated micro-batches.
        single_micro_batch = all(shape[0] == 1 for _, shape, _ in key)
        self.xla_flops[key] = metrics_lib.xla_flops(compiled) if single_micro_batch else None


# -------------------------------------------------------------------------------------------- hardware


@dataclasses.dataclass
class Hardware:
    """The devices a run uses and what the tables in `train.metrics` know about them."""

    devices: list[Any]  # all devices (every host)
    local_devices: list[Any]
    spec: metrics_lib.DeviceSpec | None
    precision: str
    peak_tflops_per_device: float | None
    price_per_device_hour: float | None
    price_source: str | None
    energy: metrics_lib.EnergyMeter

    @classmethod
    def detect(cls, precision: str, *, device_name: str | None = None, price_override: float | None = None) -> Hardware:
        """The devices JAX sees and their table entry; ``precision`` may be ``auto`` (see `parse_precision`).

        Raises:
          ValueError: an unknown ``device_name`` or precision, or bf16 on a device without it.
        """
        devices = jax.devices()
        spec = metrics_lib.find_device(devices[0].device_kind, device_name)
        precision = parse_precision(precision, devices[0].platform, spec)
        price, price_source = metrics_lib.resolve_price(spec, price_override)
        local = jax.local_devices()
        return cls(
            devices=devices,
            local_devices=local,
            spec=spec,
            precision=precision,
            peak_tflops_per_device=metrics_lib.peak_tflops(spec, precision),
            price_per_device_hour=price,
            price_source=price_source,
            energy=metrics_lib.energy_meter(local, spec),
        )

    @property
    def device_count(self) -> int:
        return len(self.devices)

    def record_fields(self) -> dict[str, Any]:
        """The hardware part of the ``run`` record."""
        return {
            "platform": self.devices[0].platform,
            "device_kind": self.devices[0].device_kind,
            "device_count": self.device_count,
            "peak_tflops_per_device": self.peak_tflops_per_device,
            "peak_source": None if self.spec is None or self.peak_tflops_per_device is None else self.spec.peak_source,
            "price_per_device_hour_usd": self.price_per_device_hour,
            "price_source": self.price_source,
            "energy_method": self.energy.method,
        }

    def energy_joules(self) -> float | None:
        """Energy of every host's devices since the meter started (a collective when there are several hosts)."""
        local = self.energy.joules()
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        gathered = multihost_utils.process_allgather(np.asarray(np.nan if local is None else local, np.float64))
        return None if np.isnan(gathered).any() else float(np.sum(gathered))


# ---------------------------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class LoopConfig:
    num_steps: int
    log_every: int = 100
    eval_every: int = 0  # 0: evaluate only at the end
    checkpoint_every: int = 1000
    progress_bar: bool = True
    started_at: float = dataclasses.field(default_factory=time.monotonic)  # process start, for wall_time_s


@dataclasses.dataclass
class Counters:
    """Totals over the whole run (all resumed segments): saved in checkpoints, reported in the summary."""

    train_time_s: float = 0.0
    wall_time_s: float = 0.0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    flops: float = 0.0
    xla_flops: float = 0.0
    xla_flops_known: bool = True
    energy_j: float | None = 0.0
    step_times: list[float] = dataclasses.field(default_factory=list)
    last_loss: float | None = None
    last_eval: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Counters:
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Interval:
    """Sums over the steps since the last interval record."""

    steps: int = 0
    time_s: float = 0.0
    flops: float = 0.0
    totals: dict[str, float] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, step_time: float, flops: float, totals: Mapping[str, float], counts: Mapping[str, int]) -> None:
        self.steps += 1
        self.time_s += step_time
        self.flops += flops
        for key, value in totals.items():
            self.totals[key] = self.totals.get(key, 0.0) + value
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value


class BatchStream(Protocol):
    position: Mapping[str, int]

    def __next__(self) -> tuple[Batch, dict[str, int]]: ...


class StopSignals:
    """While active, SIGINT and SIGTERM set ``received`` (the loop then checkpoints and stops) instead of killing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __enter__(self) -> StopSignals:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    stop_reason: str  # "finished", "signal" or "nan"
    steps: int  # steps whose results are in ``state`` (for "nan": the last good step)
    summary: dict[str, Any]
    signal_number: int | None = None


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics the host has not read yet."""

    step: int
    metrics: dict[str, jax.Array]
    counts: dict[str, int]
    flops: float
    xla_flops: float | None


class _Loop:
    """One segment of a run (from start or from a checkpoint); see `train`."""

    def __init__(self, state, *, compiler, parallel, stream, flops_fn, lr_fn, evaluate, hardware, run_log,
                 checkpoints, model_signature, config, counters):
        self.state = state
        self.compiler, self.parallel, self.stream = compiler, parallel, stream
        self.flops_fn, self.lr_fn, self.evaluate = flops_fn, lr_fn, evaluate
        self.hardware, self.run_log, self.checkpoints = hardware, run_log, checkpoints
        self.model_signature, self.config = model_signature, config
        self.counters = counters
        self.step = int(jax.device_get(state.step))
        self.saved_step: int | None = None
        self.interval = _Interval()
        self.wall_start = config.started_at
        self.wall_before = counters.wall_time_s
        self.energy_before = counters.energy_j
        hardware.energy.start()
        self.fp16 = state.loss_scale is not None
        self.progress = tqdm(
            total=config.num_steps,
            initial=self.step,
            disable=not config.progress_bar or jax.process_index() != 0,
            dynamic_ncols=True,
            unit="step",
        )

    # -- time, energy, records

    def _energy(self) -> float | None:
        measured = self.hardware.energy_joules()
        return None if measured is None or self.energy_before is None else self.energy_before + measured

    def _close_counters(self) -> None:
        self.counters.wall_time_s = self.wall_before + time.monotonic() - self.wall_start
        self.counters.energy_j = self._energy()

    def _log_interval(self, step: int, metrics: Mapping[str, float]) -> None:
        interval, hardware = self.interval, self.hardware
        weight = max(interval.totals.get("weight", 0.0), 1.0)
        tflops = interval.flops / interval.time_s / 1e12 if interval.time_s > 0 else None
        record = {
            "type": "interval",
            "step": step,
            "elapsed_s": self.counters.train_time_s,
            "step_time_s": interval.time_s / interval.steps,
            **{f"{name}_per_s": count / interval.time_s for name, count in interval.counts.items()},
            "tflops_per_s": tflops,
            "mfu": metrics_lib.mfu(tflops, hardware.peak_tflops_per_device, hardware.device_count),
            "loss": None,  # stays null if every step of the interval was skipped (fp16 overflow)
            "nll": None,
            **{key: value / weight for key, value in interval.totals.items() if key != "weight"},
            "lr": float(self.lr_fn(step - 1)),
            "grad_norm": metrics["grad_norm"],
            "loss_scale": metrics["loss_scale"] if self.fp16 else None,
            "peak_memory_bytes": metrics_lib.peak_memory_bytes(hardware.local_devices),
            **energy_fields(self._energy(), hardware.energy.source),
            "cost_usd": metrics_lib.cost_usd(
                self.counters.train_time_s, hardware.device_count, hardware.price_per_device_hour
            ),
        }
        self.counters.last_loss = record["loss"]
        self.run_log.write(record)
        if record.get("loss") is not None:
            self.progress.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
        self.interval = _Interval()

    def _evaluate(self, final: bool) -> None:
        for fields in self.evaluate(self.state, final):
            record = {"type": "eval", "step": self.step, "loss": None, "nll": None, "bleu": None, "accuracy": None}
            record.update(fields)
            self.run_log.write(record)
            self.counters.last_eval = {key: record[key] for key in ("bleu", "accuracy")}

    def _save(self) -> None:
        if self.checkpoints is None or self.saved_step == self.step:
            return
        self._close_counters()
        progress = {
            "step": self.step,
            "model": self.model_signature,
            "data": dict(self.stream.position),
            "counters": self.counters.to_dict(),
        }
        self.checkpoints.save(self.step, self.state, progress)
        self.saved_step = self.step

    # -- steps

    def _dispatch(self) -> _Pending:
        local_batch, counts = next(self.stream)
        batch = self.parallel.put_batch(local_batch, row_axis=1)
        compiled = self.compiler.compiled(self.state, batch)
        self.state, step_metrics = compiled(self.state, batch)
        self.step += 1
        return _Pending(
            self.step,
            step_metrics,
            counts,
            self.flops_fn({name: value.shape for name, value in batch.items()}),
            self.compiler.xla_flops[StepCompiler.key(batch)],
        )

    def _finish(self, pending: _Pending, step_time: float) -> bool:
        """Accounts for a finished step; False when it was not finite (and fp16 did not skip it)."""
        metrics = {key: float(value) for key, value in jax.device_get(pending.metrics).items()}
        if not metrics["finite"] and not self.fp16:
            return False
        counters = self.counters
        counters.train_time_s += step_time
        counters.step_times.append(step_time)
        counters.flops += pending.flops
        if pending.xla_flops is None:
            counters.xla_flops_known = False
        else:
            counters.xla_flops += pending.xla_flops
        for name, count in pending.counts.items():
            counters.counts[name] = counters.counts.get(name, 0) + count
        # An fp16 step skipped for overflow has no meaningful loss; its time and tokens still count.
        totals = {key: value for key, value in metrics.items() if key not in ("grad_norm", "finite", "loss_scale")}
        self.interval.add(step_time, pending.flops, totals if metrics["finite"] else {}, pending.counts)
        self.progress.update(1)
        if pending.step % self.config.log_every == 0:
            self._log_interval(pending.step, metrics)
        return True

    def _sync_point(self) -> bool:
        config = self.config
        return (
            self.step % config.checkpoint_every == 0
            or (config.eval_every > 0 and self.step % config.eval_every == 0)
            or self.step == config.num_steps
        )

    def run(self) -> TrainResult:
        signals = StopSignals()
        stop_reason = "finished"
        pending: _Pending | None = None
        bad_step = None
        clock = time.monotonic()  # when the oldest unaccounted step could start
        with signals:
            while self.step < self.config.num_steps and signals.received is None:
                current = self._dispatch()
                if pending is not None:  # read step n-1 while step n runs
                    done = time.monotonic()
                    if not self._finish(pending, done - clock):
                        stop_reason = "nan"
                        bad_step = pending.step
                        break
                    clock = done
                pending = current
                if self._sync_point() or signals.received is not None:
                    jax.block_until_ready(self.state)
                    pending, ok = None, self._finish(current, time.monotonic() - clock)
                    if not ok:
                        stop_reason, bad_step = "nan", current.step
                        break
                    if self.config.eval_every > 0 and self.step % self.config.eval_every == 0 and self.step < self.config.num_steps:
                        self._evaluate(final=False)
                    if self.step % self.config.checkpoint_every == 0:
                        self._save()
                    clock = time.monotonic()
            if stop_reason == "finished" and pending is not None:  # a signal came after the last check
                jax.block_until_ready(self.state)
                if not self._finish(pending, time.monotonic() - clock):
                    stop_reason, bad_step = "nan", pending.step
            if stop_reason == "finished" and signals.received is not None:
                stop_reason = "signal"
        self.progress.close()

        steps_done = bad_step - 1 if stop_reason == "nan" else self.step
        if stop_reason != "nan":
            self._save()
        if stop_reason == "finished":
            self._evaluate(final=True)
        if self.checkpoints is not None:
            self.checkpoints.wait()
        self._close_counters()
        summary = summary_record(self.counters, self.hardware, stop_reason, steps_done)
        self.run_log.write(summary)
        return TrainResult(self.state, stop_reason, steps_done, summary, signals.received)


def train(
    state: TrainState,
    *,
    compiler: StepCompiler,
    parallel: DataParallel,
    stream: BatchStream,
    flops_fn: Callable[[Mapping[str, tuple[int, ...]]], float],
    lr_fn: Callable[[int], float],
    evaluate: Callable[[TrainState, bool], list[dict[str, Any]]],
    hardware: Hardware,
    run_log: RunLog,
    checkpoints: Checkpoints | None,
    model_signature: dict[str, Any],
    config: LoopConfig,
    counters: Counters | None = None,
) -> TrainResult:
    """Trains until ``config.num_steps``, a signal, or a non-finite loss, then writes the summary record.

    Finished: writes a final checkpoint and evaluates with ``final=True``. Signal (SIGINT/SIGTERM): finishes
    the step in flight, writes a checkpoint and stops. Non-finite loss: stops without writing a checkpoint, so
    the latest one on disk is the last good state. ``counters`` continue a resumed run's totals.
    """
    loop = _Loop(
        state, compiler=compiler, parallel=parallel, stream=stream, flops_fn=flops_fn, lr_fn=lr_fn,
        evaluate=evaluate, hardware=hardware, run_log=run_log, checkpoints=checkpoints,
        model_signature=model_signature, config=config, counters=counters or Counters(),
    )
    return loop.run()


def energy_fields(joules: float | None, source: str | None) -> dict[str, Any]:
    """``energy_j`` and ``energy_source``, both null when the energy is not known (e.g. a segment without it)."""
    return {"energy_j": joules, "energy_source": source if joules is not None else None}


def summary_record(counters: Counters, hardware: Hardware, stop_reason: str, steps: int) -> dict[str, Any]:
    """The ``summary`` record of docs/run-log.md from the run's totals."""
    train_time = counters.train_time_s
    measured_steps = len(counters.step_times)
    tflops = counters.flops / train_time / 1e12 if train_time > 0 else None
    return {
        "type": "summary",
        "completed": stop_reason == "finished",
        "stop_reason": stop_reason,
        "steps": steps,
        "train_time_s": train_time,
        "wall_time_s": counters.wall_time_s,
        "step_time_s": statistics.median(counters.step_times) if counters.step_times else None,
        **{name: count for name, count in counters.counts.items()},
        **{f"{name}_per_s": (count / train_time if train_time > 0 else 0.0) for name, count in counters.counts.items()},
        "flops_per_step": counters.flops / measured_steps if measured_steps else None,
        "xla_flops_per_step": (
            counters.xla_flops / measured_steps if measured_steps and counters.xla_flops_known else None
        ),
        "tflops_per_s": tflops,
        "mfu": metrics_lib.mfu(tflops, hardware.peak_tflops_per_device, hardware.device_count),
        "peak_memory_bytes": metrics_lib.peak_memory_bytes(hardware.local_devices),
        **energy_fields(counters.energy_j, hardware.energy.source),
        "energy_estimated": counters.energy_j is not None and hardware.energy.source == "estimated",
        "cost_usd": metrics_lib.cost_usd(train_time, hardware.device_count, hardware.price_per_device_hour),
        "final_loss": counters.last_loss,
        "bleu": counters.last_eval.get("bleu"),
        "accuracy": counters.last_eval.get("accuracy"),
    }


# ------------------------------------------------------------------------------- optimizer and schedule


def inverse_sqrt_schedule(peak_lr: float, warmup_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``peak_lr`` over ``warmup_steps``, then ``peak_lr * sqrt(warmup_steps / step)``."""
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
    # join_schedules evaluates both pieces everywhere (then selects), so keep the decay finite before warmup ends.
    decay = lambda count: peak_lr * jnp.sqrt(warmup_steps / jnp.maximum(count + warmup_steps, warmup_steps))  # noqa: E731
    return optax.join_schedules([optax.linear_schedule(0.0, peak_lr, warmup_steps), decay], [warmup_steps])


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only: no decay for biases and LayerNorm scales (leaves with fewer than 2 axes)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


OPTIMIZERS = ("adamw", "adan")


def make_optimizer(
    name: str, schedule: optax.Schedule, *, weight_decay: float, clip_norm: float | None, master_dtype: Any = None
) -> optax.GradientTransformation:
    """ls_jax.optim's fused AdamW (betas 0.9, 0.98 as in fairseq's Transformer recipe) or Adan (paper defaults);
    with ``master_dtype`` (bf16 or f16) it keeps f32 master weights and trains params of that dtype."""
    options = dict(weight_decay=weight_decay, mask=decay_mask, max_grad_norm=clip_norm if clip_norm else None,
                   storage_dtype=master_dtype, master_weights=master_dtype is not None)
    if name == "adamw":
        return ls_jax.optim.adamw(schedule, b1=0.9, b2=0.98, **options)
    if name == "adan":
        return ls_jax.optim.adan(schedule, **options)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")


def precision_signature(config: Mapping[str, Any], precision: str) -> dict[str, Any]:
    """The entries of a checkpoint's model signature that change the train state's structure with the precision.

    ``master_weights`` appears only when set, so checkpoints written before the flag existed still resume; for
    bf16 params it names the master's form, int16 low halves (``ls_jax.optim.master``), which the f32 masters of
    checkpoints written before that form do not restore into."""
    signature: dict[str, Any] = {"fp16_loss_scaling": precision == "fp16"}
    if config["master_weights"]:
        split = ls_jax.optim.master.is_split(master_dtype(config, precision))
        signature["master_weights"] = "int16 low halves" if split else True
    return signature


def master_dtype(config: Mapping[str, Any], precision: str) -> Any:
    """The 16-bit param dtype of ``--master-weights`` (the compute dtype), or None without it.

    Raises:
      UsageError: ``--master-weights`` with fp32 compute.
    """
    if not config["master_weights"]:
        return None
    if precision == "fp32":
        raise UsageError("--master-weights needs --precision bf16 or fp16: with fp32 compute the params are f32")
    return PRECISION_DTYPES[precision]


def parse_precision(value: str, platform: str, spec: metrics_lib.DeviceSpec | None) -> str:
    """The compute precision for ``--precision value`` on ``platform`` / device ``spec``.

    ``auto`` is fp32 on CPU (where bf16 matmuls are emulated and slow), else bf16, or fp16 on GPUs without
    bf16 tensor cores (V100, T4).

    Raises:
      ValueError: an unknown value, or bf16 on a device the table knows has no bf16 support.
    """
    no_bf16 = spec is not None and spec.peak_tflops.get("bf16") is None and platform == "gpu"
    if value == "auto":
        return "fp32" if platform == "cpu" else ("fp16" if no_bf16 else "bf16")
    if value not in PRECISION_DTYPES:
        raise ValueError(f"--precision must be auto, {', '.join(PRECISION_DTYPES)}; got {value!r}")
    if value == "bf16" and no_bf16:
        raise ValueError(f"{spec.name} has no bf16 support; use --precision fp16 or fp32")
    return value


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every training entry point shares (task flags are added by the task)."""
    group = parser.add_argument_group("training")
    group.add_argument("--steps", type=int, help="optimizer steps to train for")
    group.add_argument("--optimizer", choices=OPTIMIZERS, help="ls_jax.optim fused optimizer (default adamw)")
    group.add_argument("--lr", type=float, help="peak learning rate")
    group.add_argument("--warmup-steps", type=int, help="linear warmup steps of the learning-rate schedule")
    group.add_argument("--weight-decay", type=float, help="decoupled weight decay on matrices")
    group.add_argument("--clip-norm", type=float, help="clip gradients to this global L2 norm (0: no clipping)")
    group.add_argument("--grad-accum", type=int, help="micro-batches accumulated per optimizer step")
    group.add_argument("--precision", choices=("auto", *PRECISION_DTYPES),
                       help="compute dtype; auto = fp32 on CPU, bf16 on TPU and GPUs (fp16 on GPUs without bf16); "
                            "fp16 uses dynamic loss scaling")
    group.add_argument("--master-weights", action="store_const", const=True,
                       help="bf16/fp16 params trained from f32 master weights kept by the optimizer (mixed precision "
                            "as in Apex O2): the model computes with the optimizer's 16-bit copies, no per-step cast")
    group.add_argument("--backend", choices=("auto", "ffi", "xla"),
                       help="fused-op implementation: CUDA kernels (ffi), plain XLA, or auto-detect")
    group.add_argument("--seed", type=int, help="seed of initialization, dropout and data order")

    group = parser.add_argument_group("logging and checkpoints")
    group.add_argument("--run-dir", help="run directory (default runs/<run_id>)")
    group.add_argument("--resume", metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its latest checkpoint, exactly; flags given now "
                            "override its saved configuration (e.g. --steps to train longer)")
    group.add_argument("--log-every", type=int, help="steps per interval record")
    group.add_argument("--eval-every", type=int, help="steps between evaluations (0: only at the end)")
    group.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (one is always written at the end)")
    group.add_argument("--keep-checkpoints", type=int, help="how many recent checkpoints to keep")
    group.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                       help="no progress bar")
    group.add_argument("--no-tensorboard", dest="tensorboard", action="store_const", const=False,
                       help="no TensorBoard event files")

    group = parser.add_argument_group("cost and hardware")
    group.add_argument("--price-per-hour", type=float,
                       help="USD per device-hour for the cost estimate (overrides the built-in table)")
    group.add_argument("--device-name", choices=metrics_lib.DEVICE_NAMES,
                       help="use this entry of the device table (peak FLOP/s, price, power) instead of matching "
                            "JAX's device_kind")
    group.add_argument("--distributed", action="store_const", const=True,
                       help="call jax.distributed.initialize() first (multi-host GPU clusters, TPU pod slices)")


TRAINING_DEFAULTS: dict[str, Any] = {
    "steps": 1000,
    "optimizer": "adamw",
    "lr": 5e-4,
    "warmup_steps": 4000,
    "weight_decay": 1e-4,
    "clip_norm": 0.0,
    "grad_accum": 1,
    "precision": "auto",
    "master_weights": False,
    "backend": "auto",
    "seed": 0,
    "run_dir": None,
    "resume": None,
    "log_every": 100,
    "eval_every": 0,
    "checkpoint_every": 1000,
    "keep_checkpoints": 3,
    "progress": True,
    "tensorboard": True,
    "price_per_hour": None,
    "device_name": None,
    "distributed": False,
}


def param_count(params: Any) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))


# ------------------------------------------------------------------------------ run directory and resume

CONFIG_FILENAME = "config.json"


class UsageError(Exception):
    """Bad input from the user: an entry point reports it as one message and exit code 2, without a traceback."""


def load_saved_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved configuration a run saved in its directory (what ``--resume`` starts from)."""
    path = Path(run_dir) / CONFIG_FILENAME
    if not path.is_file():
        raise UsageError(f"--resume {run_dir}: no {CONFIG_FILENAME} there; is it a run directory?")
    return json.loads(path.read_text(encoding="utf-8"))


def prepare_run_dir(config: Mapping[str, Any], run_id: str) -> Path:
    """The run directory (``--resume``, ``--run-dir`` or runs/<run_id>), created and proven writable.

    Raises:
      UsageError: a new run would overwrite an existing one, or the directory cannot be written.
    """
    if config["resume"]:
        run_dir = Path(config["resume"])
    else:
        run_dir = Path(config["run_dir"] or Path("runs") / run_id)
        if (run_dir / runlog.LOG_FILENAME).exists():
            raise UsageError(f"{run_dir} already holds a run; pass --resume {run_dir} or another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"cannot write the run directory {run_dir}: {err.strerror or err}") from err
    return run_dir


def save_config(run_dir: Path, config: Mapping[str, Any]) -> None:
    if jax.process_index() == 0:
        (run_dir / CONFIG_FILENAME).write_text(json.dumps(dict(config), indent=2) + "\n", encoding="utf-8")


def restore_latest(
    checkpoints: Checkpoints, state: TrainState, model_signature: dict[str, Any], run_dir: Path
) -> tuple[TrainState, dict[str, int], Counters]:
    """(state, data position, counters) of the latest checkpoint, restored onto ``state``'s shardings.

    The run log is cut back to the checkpoint's step (`train.runlog.truncate_for_resume`).

    Raises:
      UsageError: no checkpoint, or one written for another model or vocabulary.
    """
    step = checkpoints.latest_step()
    if step is None:
        raise UsageError(f"--resume {run_dir}: no checkpoint in {checkpoints.directory}")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    try:
        state, progress = checkpoints.restore(step, abstract, model_signature)
    except CheckpointMismatchError as err:
        raise UsageError(f"{err}; a resumed run needs the vocabulary and model it was trained with") from err
    if jax.process_index() == 0:
        runlog.truncate_for_resume(run_dir, step)
        print(f"resuming {run_dir} at step {step}", file=sys.stderr)
    return state, progress["data"], Counters.from_dict(progress["counters"])


def exit_code(result: TrainResult, checkpoints: Checkpoints) -> int:
    """0 finished; 1 NaN (saying which checkpoint is the last good one); 128 + signal number after a signal."""
    if result.stop_reason == "nan":
        saved = checkpoints.all_steps()
        kept = f"the last good checkpoint is step {saved[-1]} in {checkpoints.directory}" if saved else "no checkpoint was written"
        print(f"error: the loss became NaN after step {result.steps}; {kept}", file=sys.stderr)
        return 1
    if result.stop_reason == "signal":
        return 128 + int(result.signal_number)
    return 0


# --------------------------------------------------------------------------------------- entry points


def defaults_epilog(defaults: Mapping[str, Any], synthetic: Mapping[str, Any], real: Mapping[str, Any],
                    notes: str = "") -> str:
    """The ``--help`` epilog of an entry point: its defaults, those that depend on the data, then ``notes``."""

    def line(values: Mapping[str, Any]) -> str:
        return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())

    by_data = set(synthetic) | set(real)
    common = {k: v for k, v in defaults.items() if v is not None and not isinstance(v, bool) and k not in by_data}
    return (
        f"defaults: {line(common)}\n"
        f"with --data synthetic: {line(synthetic)}\n"
        f"with real data: {line(real)}\n"
        f"{notes}on --resume RUN_DIR the saved configuration replaces the defaults"
    )


def check_ranges(config: Mapping[str, Any], *, at_least_one: Iterable[str] = (), non_negative: Iterable[str] = (),
                 fractions: Iterable[str] = ()) -> None:
    """Raises UsageError naming the flag when a set option is < 1, < 0, or outside [0, 1); ``lr`` must be > 0."""
    def flag(key: str) -> str:
        return "--" + key.replace("_", "-")

    for key in at_least_one:
        if config[key] is not None and config[key] < 1:
            raise UsageError(f"{flag(key)} must be >= 1, got {config[key]}")
    for key in non_negative:
        if config[key] is not None and config[key] < 0:
            raise UsageError(f"{flag(key)} must be >= 0, got {config[key]}")
    for key in fractions:
        if config[key] is not None and not 0.0 <= config[key] < 1.0:
            raise UsageError(f"{flag(key)} must be in [0, 1), got {config[key]}")
    if config["lr"] <= 0:
        raise UsageError(f"--lr must be > 0, got {config['lr']}")


@dataclasses.dataclass(frozen=True)
class Run:
    """What an entry point's training function starts from."""

    config: dict[str, Any]  # resolved: defaults < saved (on --resume) < given
    given: dict[str, Any]  # the flags of this invocation
    run_id: str
    run_dir: Path
    command: str  # the command line, for the run record
    started_at: float  # time.monotonic() at start, for wall_time_s
    started_utc: str


def run_entry_point(
    task: str,
    argv: Sequence[str],
    parser: argparse.ArgumentParser,
    resolve_config: Callable[[Mapping[str, Any], Mapping[str, Any] | None], dict[str, Any]],
    check_config: Callable[[Mapping[str, Any]], None],
    train_fn: Callable[[Run], int],
) -> int:
    """Parses and checks the flags, joins the distributed job, prepares the run directory, then ``train_fn``.

    The backend is selected (and, for ``--backend ffi``, the kernels loaded) before anything compiles, so a
    missing kernel library fails at once rather than mid-compilation.
    """
    started_at, started_utc = time.monotonic(), runlog.utc_now()
    given = vars(parser.parse_args(argv))
    saved = load_saved_config(given["resume"]) if given.get("resume") else None
    config = resolve_config(given, saved)
    check_config(config)
    if config["distributed"]:
        jax.distributed.initialize()
    run_id = saved["run_id"] if saved else runlog.new_run_id()
    run_dir = prepare_run_dir(config, run_id)
    command = shlex.join(["python", "-m", f"train.{task}", *argv])
    with backend_lib.use(config["backend"]):
        backend_lib.active_backend()
        return train_fn(Run(config, given, run_id, run_dir, command, started_at, started_utc))


def detect_hardware(config: Mapping[str, Any]) -> Hardware:
    """`Hardware.detect` for the flags ``--precision``, ``--device-name`` and ``--price-per-hour``."""
    try:
        return Hardware.detect(config["precision"], device_name=config["device_name"],
                               price_override=config["price_per_hour"])
    except ValueError as err:
        raise UsageError(str(err)) from err


def run_record(task: str, run: Run, hardware: Hardware, state: TrainState, *, model: str, batch: Mapping[str, Any],
               data: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``run`` record that opens a run log (docs/run-log.md)."""
    return {
        **runlog.identity(task, run.run_id, run.command, run.started_utc),
        **hardware.record_fields(),
        "backend": backend_lib.active_backend(),
        "precision": hardware.precision,
        "optimizer": run.config["optimizer"],
        "model": model,
        "params": param_count(state.params),
        "batch": dict(batch),
        "data": dict(data),
        "config": dict(config),
    }


def format_value(value: float | None, spec: str = ".3g", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def finish(result: TrainResult, run_dir: Path, run_log: RunLog, checkpoints: Checkpoints, hardware: Hardware,
           throughput: Callable[[Mapping[str, Any]], str], metric: str, score: Callable[[Mapping[str, Any]], str]) -> int:
    """Closes the run, prints its summary on the main host and returns the process exit code (`exit_code`).

    ``throughput(summary)`` words the task's throughput, ``score(eval_record)`` its ``metric`` on one split.
    """
    run_log.close()
    checkpoints.close()
    hardware.energy.close()
    if jax.process_index() == 0:
        s = result.summary
        evals = [r for r in runlog.read(run_dir / runlog.LOG_FILENAME) if r["type"] == "eval" and r["step"] == s["steps"]]
        scores = ", ".join(f"{r['split']} {score(r)}" for r in evals) or "n/a"
        print(
            f"\n{s['stop_reason']} after {s['steps']} steps in {s['train_time_s']:.1f} s of training "
            f"({s['wall_time_s']:.1f} s wall)\n"
            f"  throughput  {throughput(s)}, step {format_value(s['step_time_s'], '.3f', ' s')}\n"
            f"  compute     {format_value(s['tflops_per_s'])} TFLOP/s, MFU {format_value(s['mfu'], '.1%')}\n"
            f"  energy      {format_value(s['energy_j'], '.4g', ' J')} "
            f"({s['energy_source'] or 'not measured on this device'}), cost {format_value(s['cost_usd'], '.4f', ' USD')}\n"
            f"  final loss  {format_value(s['final_loss'], '.4f')}, {metric} {scores}\n"
            f"  run dir     {run_dir}"
        )
    return exit_code(result, checkpoints)


def main(run: Callable[[list[str]], int], argv: Sequence[str] | None) -> int:
    """Runs an entry point; bad input (flags, data, files, a missing optional package or kernel library) is one
    ``error:`` line and exit code 2."""
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except (UsageError, DataError, FileNotFoundError, ImportError, backend_lib.KernelsUnavailableError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
