"""The loop driver: it runs the compiled step until the last step, a signal, or a non-finite loss, and in between
writes interval records, evaluates and checkpoints.

A task supplies, besides the loss of `train.harness.step`,
  - a batch stream yielding ``(batch, counts)``: numpy arrays with a leading grad-accumulation axis and this
    host's rows, and the step's global counts (e.g. ``tokens``), with a ``position`` to resume from;
  - ``flops_fn(batch_shapes) -> int``: the analytic FLOPs of one step;
  - ``evaluate(state, final) -> [eval record fields]``.

Timing: steps are dispatched one ahead of the host: the host reads step n's metrics after it has queued step n+1,
and step n's time is the time between the completions of steps n-1 and n. Evaluations and the start of a checkpoint
(the state copied off the devices; its files are written while training goes on) stop the clock. The energy meter
is read at the same instants as the clock (`train.costs.windows.Reading`): at every step's end, this host's meter,
and at the edges of compilation, evaluations and checkpoints, every host's, each time once the device has finished
the work before it. `Counters` hold the run's totals over every resumed segment; a checkpoint saves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import jax
from tqdm import tqdm

from train.costs import memory
from train.costs.hardware import Hardware
from train.costs.windows import Reading, Span, Tally, add_optional
from train.errors import Interrupted
from train.harness import progress
from train.harness.creation import StateCreation
from train.harness.parallel import DataParallel, wait_for_processes
from train.harness.progress import Counters, Interval
from train.harness.signals import StopSignals
from train.harness.startup import StartupClock
from train.harness.step import Batch, TrainState
from train.harness.step_compiler import StepCompiler
from train.records import runlog
from train.records.checkpoints import Checkpoints, is_finite
from train.records.runlog import RunLog

STEP_VALUES = ("grad_norm", "finite", "loss_scale", "fp8_overflows", "fp8_amax_ratio")
"""A step's metrics that are its own values, not sums an interval record divides by the weight."""


@dataclasses.dataclass
class LoopConfig:
    num_steps: int
    log_every: int = 100
    eval_every: int = 0  # 0: evaluate only at the end
    checkpoint_every: int = 1000
    progress_bar: bool = True
    startup: StartupClock = dataclasses.field(default_factory=StartupClock)  # from the start: wall_time_s
    profile_steps: tuple[int, int] | None = None  # (first, last): trace these steps with jax.profiler
    profile_dir: Path | None = None


class StepBatches(Protocol):
    """What the loop takes each step's batch from: ``next()`` gives (batch, counts); ``position`` resumes it."""

    position: Mapping[str, int]

    def __next__(self) -> tuple[Batch, dict[str, int]]: ...


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    stop_reason: str  # "finished", "signal", "nan" or "io_error"
    steps: int  # steps whose results are in ``state`` (for "nan": the last good step)
    summary: dict[str, Any]
    signal_number: int | None = None
    error: str | None = None  # for "io_error": what could not be written and what to do


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics the host has not read yet."""

    step: int
    metrics: dict[str, jax.Array]
    counts: dict[str, int]
    flops: float
    shape_key: tuple  # the batch's `StepCompiler.key`: which compiled step ran it


def _write_error(err: OSError) -> str:
    """One line for a failed write: a `CheckpointWriteError` says what to do; others name the file."""
    if err.filename is None:
        return err.strerror or str(err)
    return f"cannot write {err.filename}: {err.strerror}; free space there, then resume the run"


def progress_line(record: Mapping[str, Any], num_steps: int) -> str:
    """One plain line for an interval record, printed instead of the progress bar when stderr is not a terminal:
    ``step 40/320  loss 3.214  0.052 s/step  elapsed 2.1 s``, and in an fp8 run what its quantization clipped
    (``fp8 clipped 12, amax 1.01x range``: the interval's overflows and the last step's largest amax ratio)."""
    loss = "n/a" if record["loss"] is None else f"{record['loss']:.4g}"
    line = (
        f"step {record['step']}/{num_steps}  loss {loss}  {record['step_time_s']:.3g} s/step  "
        f"elapsed {record['elapsed_s']:.1f} s"
    )
    if record.get("fp8_amax_ratio") is not None:
        line += f"  fp8 clipped {record['fp8_overflows']}, amax {record['fp8_amax_ratio']:.3g}x range"
    return line


class Loop:
    """One segment of a run (from the start or from a checkpoint): ``Loop(state, ...).run()``.

    Trains until ``config.num_steps``, a signal, or a non-finite loss, then writes the summary record.

    First compiles the step for every global batch shape in ``batch_shapes`` ({name: (shape, dtype)}); a new run
    passes its state's shapes as ``state`` and its ``creation``, which runs once the step has compiled.
    Finished: writes a final checkpoint and evaluates with ``final=True``. Signal (SIGINT/SIGTERM, ``signals``
    when the caller already handles them): in the step loop it finishes the step in flight; during compilation it
    stops once the compilation returns, during an evaluation at once; either way it writes a checkpoint if a step
    was taken since the last one, and stops. Non-finite loss or state: stops without writing a checkpoint, and no
    checkpoint is ever written of a non-finite state, so the latest one on disk is finite. A checkpoint or log write
    that fails stops the run (``"io_error"``). ``counters`` continue a resumed run's totals. The summary record says
    which of these ended it.
    """

    def __init__(
        self,
        state: TrainState,
        *,
        compiler: StepCompiler,
        parallel: DataParallel,
        stream: StepBatches,
        flops_fn: Callable[[Mapping[str, tuple[int, ...]]], float],
        lr_fn: Callable[[int], float],
        evaluate: Callable[[TrainState, bool], list[dict[str, Any]]],
        hardware: Hardware,
        run_log: RunLog,
        checkpoints: Checkpoints | None,
        model_signature: dict[str, Any],
        config: LoopConfig,
        counters: Counters | None = None,
        signals: StopSignals | None = None,
        batch_shapes: Sequence[Mapping[str, tuple[tuple[int, ...], Any]]] = (),
        creation: StateCreation | None = None,
    ):
        counters = counters or Counters()
        self.state, self.creation = state, creation
        self.signals, self.batch_shapes = signals, list(batch_shapes)
        self.compiler, self.parallel, self.stream = compiler, parallel, stream
        self.flops_fn, self.lr_fn, self.evaluate = flops_fn, lr_fn, evaluate
        self.hardware, self.run_log, self.checkpoints = hardware, run_log, checkpoints
        self.model_signature, self.config = model_signature, config
        self.counters = counters
        self.step = 0 if creation is not None else int(jax.device_get(state.step))
        # A fresh run has nothing to save at step 0; a resumed one already has its checkpoint.
        self.saved_step: int | None = (
            self.step
            if self.step == 0 or checkpoints is None
            else (self.step if self.step in checkpoints.all_steps() else None)
        )
        self.interval = Interval()
        self.profiling = False
        self.wall_start = config.startup.started_at
        self.wall_before = counters.wall_time_s
        self.energy_before = counters.energy_j
        self.wall_energy_before = counters.wall_energy_j
        self.loop_started = hardware.energy_joules()  # every host's meter, started at device detection
        self.step_energies: list[float | None] = []  # this host's, of the steps since `_close_counters`
        self.fp16 = state.loss_scale is not None
        shown = config.progress_bar and jax.process_index() == 0
        # A bar redraws itself with carriage returns, which a file or pipe keeps as one ever-growing line.
        self.log_lines = shown and not sys.stderr.isatty()
        self.progress = tqdm(
            total=config.num_steps,
            initial=self.step,
            disable=not shown or self.log_lines,
            dynamic_ncols=True,
            unit="step",
        )

    # -- time, energy, records

    def _loop_energy(self, meter: float | None) -> float | None:
        """The energy from each segment's compilation on (every host's), given the meter's reading now."""
        since_start = None if meter is None or self.loop_started is None else meter - self.loop_started
        return add_optional(self.energy_before, since_start)

    def _energy(self) -> float | None:
        return self._loop_energy(self.hardware.energy_joules())

    def _step_reading(self) -> Reading:
        """The clock and this host's meter, at the end of a step (no collective: every step reads it)."""
        return Reading(time.monotonic(), self.hardware.energy.joules())

    def _edge_reading(self) -> Reading:
        """The clock and every host's meter, at an edge of one-time work (a collective on several hosts)."""
        return Reading(time.monotonic(), self.hardware.energy_joules())

    @contextlib.contextmanager
    def _window(self, tally: Tally, *, counted: bool = True) -> Iterator[None]:
        """Adds the time and energy of the work inside to ``tally`` (nothing when it raises); ``counted=False``:
        the work finishes one the tally has already counted."""
        before = self._edge_reading()
        yield
        span = self._edge_reading().since(before)
        if counted:
            tally.add(span)
        else:
            tally.extend(span)

    def _close_counters(self) -> None:
        """Brings the counters up to now: wall time, the hosts' step energies and the energy totals."""
        counters = self.counters
        counters.wall_time_s = self.wall_before + time.monotonic() - self.wall_start
        meter, *steps = self.hardware.sum_over_hosts([self.hardware.energy.joules(), *self.step_energies])
        self.step_energies = []
        counters.add_step_energies(steps)
        counters.energy_j = self._loop_energy(meter)
        counters.wall_energy_j = add_optional(self.wall_energy_before, meter)

    def _log_interval(self, step: int, metrics: Mapping[str, float]) -> None:
        record = progress.interval_record(
            step,
            self.interval,
            elapsed_s=self.counters.train_time_s,
            lr=float(self.lr_fn(step - 1)),
            grad_norm=metrics["grad_norm"],
            loss_scale=metrics["loss_scale"] if self.fp16 else None,
            fp8_amax_ratio=metrics.get("fp8_amax_ratio"),
            hardware=self.hardware,
            energy_j=self._energy(),
        )
        self.counters.last_loss = record["loss"]
        self.run_log.write(record)
        if record.get("loss") is not None:
            self.progress.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
        if self.log_lines:
            print(progress_line(record, self.config.num_steps), file=sys.stderr, flush=True)
        self.interval = Interval()

    def _evaluate(self, final: bool) -> None:
        with self._window(self.counters.evaluation), self.signals.interruptible():
            results = self.evaluate(self.state, final)
        for fields in results:
            record = runlog.eval_record(self.step, fields)
            self.run_log.write(record)
            self.counters.last_eval = dict(record["metrics"])

    def _save(self) -> bool:
        """Starts a checkpoint of the state unless it is already saved; False (nothing written) when it is not
        finite. The files are written while training goes on (`_wait_for_checkpoint`).

        Raises:
          CheckpointWriteError: this checkpoint, or the one before it, could not be written.
        """
        if self.checkpoints is None or self.saved_step == self.step:
            return True
        if not is_finite(self.state):  # this also waits for the device, before the window opens
            return False
        with self._window(self.counters.checkpoints):
            self._close_counters()
            progress = {
                "step": self.step,
                "model": self.model_signature,
                "data": dict(self.stream.position),
                "counters": self.counters.to_dict(),
                "lr": float(self.lr_fn(self.step)),  # the next step's rate: a resume with other --steps goes on from it
            }
            self.checkpoints.save(self.step, self.state, progress)
        self.saved_step = self.step
        return True

    def _wait_for_checkpoint(self) -> None:
        """Returns once the checkpoint being written in the background is on disk (`Checkpoints.save`); the wait
        is the checkpoints' time.

        Raises:
          CheckpointWriteError: it could not be written.
        """
        if self.checkpoints is not None:
            with self._window(self.counters.checkpoints, counted=False):
                self.checkpoints.wait()

    # -- steps

    def _dispatch(self) -> _Pending:
        host = self.counters.host
        with host.timing("batch"):
            local_batch, counts = next(self.stream)
        with host.timing("transfer"):
            batch = self.parallel.put_batch(local_batch, row_axis=1)
        with host.timing("launch"):
            compiled = self.compiler.compiled(self.state, batch)
            self.state, step_metrics = compiled(self.state, batch)
        host.count_step()
        self.step += 1
        return _Pending(
            self.step,
            step_metrics,
            counts,
            self.flops_fn({name: value.shape for name, value in batch.items()}),
            StepCompiler.key(batch),
        )

    def _profile_due(self, next_step: int) -> bool:
        """Whether the ``--profile-steps`` trace starts before ``next_step`` (its first) or stops (after its last)."""
        steps = self.config.profile_steps
        if steps is None or self.config.profile_dir is None:
            return False
        return next_step == steps[1] + 1 if self.profiling else next_step == steps[0]

    def _toggle_profile(self) -> None:
        if self.profiling:
            self._stop_profile()
        else:
            jax.profiler.start_trace(str(self.config.profile_dir), create_perfetto_trace=True)
            self.profiling = True
        # The next step's collectives would otherwise wait for the slowest process's profiler and put that wait in
        # the other processes' step times.
        wait_for_processes(f"profiler-{self.step}")

    def _stop_profile(self) -> None:
        if self.profiling:
            jax.profiler.stop_trace()
            self.profiling = False

    def _finish(self, pending: _Pending, span: Span) -> bool:
        """Accounts for a finished step that took ``span``; False when it was not finite (and fp16 did not skip it)."""
        metrics = {key: float(value) for key, value in jax.device_get(pending.metrics).items()}
        if not metrics["finite"] and not self.fp16:
            return False
        counters = self.counters
        counters.add_step(span.time_s, pending.flops, pending.counts)
        self.step_energies.append(span.energy_j)
        xla_flops = self.compiler.xla_flops(pending.shape_key)
        if xla_flops is None:
            counters.xla_flops_known = False
        else:
            counters.xla_flops += xla_flops
        # An fp16 step skipped for overflow has no meaningful loss; its time and tokens still count.
        totals = {key: value for key, value in metrics.items() if key not in STEP_VALUES}
        self.interval.add(span.time_s, pending.flops, totals if metrics["finite"] else {}, pending.counts)
        if "fp8_overflows" in metrics:
            self.interval.fp8_overflows += int(metrics["fp8_overflows"])
        self.progress.update(1)
        # The last step closes an interval too, so the summary's final loss is the end of training.
        if pending.step % self.config.log_every == 0 or pending.step == self.config.num_steps:
            self._log_interval(pending.step, metrics)
        return True

    def _sync_point(self) -> bool:
        config = self.config
        return (
            self.step % config.checkpoint_every == 0
            or (config.eval_every > 0 and self.step % config.eval_every == 0)
            or self.step == config.num_steps
        )

    def _steps(self) -> tuple[str, int | None]:
        """Runs steps until the last one, a signal or a non-finite loss: (stop reason, first bad step or None)."""
        signals = self.signals
        self.counters.segment_starts.append(len(self.counters.step_times))  # a warm-up starts here
        pending: _Pending | None = None
        last = self._step_reading()  # when the oldest unaccounted step could start
        while self.step < self.config.num_steps and signals.received is None:
            if self._profile_due(self.step + 1):
                # Starting or stopping the profiler takes the host up to seconds: no step is in flight meanwhile,
                # and its time is no step's.
                if pending is not None:
                    jax.block_until_ready(self.state)
                    if not self._finish(pending, self._step_reading().since(last)):
                        return "nan", pending.step
                    pending = None
                self._toggle_profile()
                last = self._step_reading()
            current = self._dispatch()
            host = self.counters.host
            if pending is not None:  # read step n-1 while step n runs
                with host.timing("wait"):
                    jax.block_until_ready(pending.metrics)  # the clock and meter read once step n-1 is done
                with host.timing("account"):
                    done = self._step_reading()
                    if not self._finish(pending, done.since(last)):
                        return "nan", pending.step
                last = done
            pending = current
            if self._sync_point() or signals.received is not None:
                with host.timing("wait"):
                    jax.block_until_ready(self.state)
                pending = None
                with host.timing("account"):
                    if not self._finish(current, self._step_reading().since(last)):
                        return "nan", current.step
                if (
                    self.config.eval_every > 0
                    and self.step % self.config.eval_every == 0
                    and self.step < self.config.num_steps
                ):
                    self._evaluate(final=False)
                if self.step % self.config.checkpoint_every == 0 and not self._save():
                    return "nan", self.step
                last = self._step_reading()
        if pending is not None:  # a signal came after the last check
            jax.block_until_ready(self.state)
            if not self._finish(pending, self._step_reading().since(last)):
                return "nan", pending.step
        return ("finished" if signals.received is None else "signal"), None

    def _train_and_close(self) -> tuple[str, int | None, str | None]:
        """Compiles, trains, writes the last checkpoint and runs the final evaluation, until one of them stops the
        run: (stop reason, first bad step or None, what could not be written or None)."""
        # Start-up: imports, data, model and state, from the process's start; its energy from device detection on.
        startup = self.config.startup
        self.counters.startup.add(Span(startup.mark("loop") - self.wall_start, self.loop_started))
        self.counters.add_startup_parts(startup.parts)
        try:
            with self._window(self.counters.compilation), self.signals.deferred("compilation"):
                self.compiler.precompile(self.state, self.batch_shapes)
                if self.creation is not None:
                    self.state = self.creation.result()
                if self.checkpoints is not None:  # the check before every checkpoint compiles here, not in a save
                    is_finite(self.state)
            if jax.default_backend() != "cpu":  # a CPU's first execution holds no one-time work worth a step
                with self._window(self.counters.first_execution), self.signals.deferred("compilation"):
                    self.compiler.warm_up(self.state)
            try:
                stop_reason, bad_step = self._steps()
            finally:
                self._stop_profile()
            self.progress.close()
            if stop_reason != "nan" and not self._save():
                stop_reason, bad_step = "nan", self.step
            self._wait_for_checkpoint()
            if stop_reason == "finished":
                self._evaluate(final=True)
            return stop_reason, bad_step, None
        except Interrupted:  # compilation or an evaluation was cut short: save the steps taken since the last save
            try:
                saved = self._save()
                self._wait_for_checkpoint()
                return ("signal", None, None) if saved else ("nan", self.step, None)
            except OSError as err:
                return "io_error", None, _write_error(err)
        except OSError as err:  # a checkpoint or log write failed: training must not go on unsaved
            return "io_error", None, _write_error(err)

    def run(self) -> TrainResult:
        """Trains, then writes the summary record (see the class docstring)."""
        if self.signals is None:
            with StopSignals() as self.signals:
                return self._run()
        return self._run()

    def _run(self) -> TrainResult:
        stop_reason, bad_step, error = self._train_and_close()
        self.progress.close()
        steps_done = bad_step - 1 if stop_reason == "nan" else self.step
        self._close_counters()
        for name in self.run_log.counted:  # a run stopped before its first step counted nothing
            self.counters.counts.setdefault(name, 0)
        summary = progress.summary_record(self.counters, self.hardware, stop_reason, steps_done)
        summary["memory"] = memory.anatomy(
            self.state.params, self.state.opt_state, self.compiler.memory_analysis(), summary["peak_memory_bytes"]
        )
        try:
            self.run_log.write(summary)
        except OSError as err:
            print(
                f"warning: the summary record could not be written to the run log: {err.strerror or err}",
                file=sys.stderr,
            )
        return TrainResult(self.state, stop_reason, steps_done, summary, self.signals.received, error)
