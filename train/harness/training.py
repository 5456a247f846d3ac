"""One training sequence for every task: `run_training(task)`.

A `Task` says what makes an entry point its own: its flags and defaults, and, for one run, a `TaskSetup` with the
model's initial parameters, the loss, the data stream, the FLOP count, the evaluation, the learning-rate schedule
and what the run record says about the model, batch and data. The harness owns the rest, the same for every task:
flags shared by all tasks, the run directory and ``--resume``, hardware, precision, data parallelism, the
optimizer, compilation, checkpoints, signals, the run log, the summary and the exit code.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from ls_jax import backend as backend_lib
from ls_jax.layers import fp8
from ls_jax.optim import shard_optimizer
from train.costs import memory, memory_budget
from train.costs.compiled import optimizer_step_kernels_later
from train.costs.hardware import Hardware, detect_hardware
from train.costs.precision import gradient_comm_dtype, master_dtype, precision_signature
from train.data.stream import EpochStream
from train.errors import Interrupted
from train.harness import cli, compile_cache, peers, progress, resume
from train.harness import config as config_lib
from train.harness import optimizer as optimizer_lib
from train.harness.config import Run, TrainingConfig
from train.harness.creation import StateCreation
from train.harness.executable_cache import StepExecutables, run_description
from train.harness.loop import Loop, LoopConfig, TrainResult
from train.harness.parallel import (
    DATA_AXIS,
    DataParallel,
    StateLayout,
    from_process_zero,
    initialize_distributed,
    wait_for_processes,
)
from train.harness.progress import Counters, format_value
from train.harness.signals import StopSignals
from train.harness.startup import StartupClock, tools_loaded_at, warm_up_devices
from train.harness.step import LossFn, TrainState, make_train_step
from train.harness.step_compiler import StepCompiler
from train.records import rundir, runlog
from train.records.checkpoints import CHECKPOINT_DIR, Checkpoints
from train.records.rundir import load_saved_config, save_config
from train.records.runlog import RunLog

BatchShapes = dict[str, tuple[tuple[int, ...], Any]]  # name -> (global shape, dtype)
PROFILE_DIR = "profile"  # under the run directory: the --profile-steps trace, one folder per process


@dataclasses.dataclass(frozen=True)
class TaskSetup:
    """What a task built for one run (data read, model configured): everything the harness needs to train it."""

    init_variables: Callable[[jax.Array], Any]  # the model's Flax variables from an init key ("params", and an FP8
    # model's scaling state), traced under jit; with pretrained params only the scaling state is taken
    init_rng: jax.Array  # split into the init key and the base key of the train state's dropout streams
    loss_fn: LossFn
    stream: EpochStream  # the training batches from the start; the harness moves it to a checkpoint's position
    batch_shapes: list[BatchShapes]  # every global batch shape the stream yields, compiled before training
    flops_fn: Callable[[Mapping[str, tuple[int, ...]]], float]
    evaluate: Callable[[TrainState, bool], list[dict[str, Any]]]
    learning_rate: optax.Schedule
    steps: int
    eval_every: int  # 0: only at the end
    checkpoint_every: int
    model_signature: dict[str, Any]  # what a checkpoint must agree on (the harness adds the implementation,
    # optimizer and precision)
    implementation: str  # the model's implementation, `cli.IMPLEMENTATIONS`: the run record's and the signature's
    model_name: str  # the run record's model, batch, data and config
    batch_record: dict[str, Any]
    data_record: dict[str, Any]
    config_record: dict[str, Any]
    pretrained_params: Any = None


@dataclasses.dataclass(frozen=True)
class Quality:
    """How a task's runs are judged: the eval records' ``key`` (its ``label`` for people), whether higher is
    better, and the quality gate's default ``threshold``, below which (above, for lower-is-better) a run has
    learned little (`train.compare.quality`)."""

    key: str
    label: str
    higher_is_better: bool
    threshold: float
    spec: str = ".4g"  # how the summary writes a value (format spec)

    def better_or_equal(self, value: float, bound: float) -> bool:
        return value >= bound if self.higher_is_better else value <= bound

    def describe(self, metrics: Mapping[str, Any]) -> str:
        """The metric's value among ``metrics`` (an eval record's)."""
        return format_value(metrics.get(self.key), self.spec)

    def gathered(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """A task's evaluation ``fields`` with its metric (when known) moved into ``metrics``, as eval records hold
        it (copied, for a metric every eval record holds anyway, such as ``loss``)."""
        value = fields.get(self.key)
        rest = {key: field for key, field in fields.items() if key != self.key or key in runlog.EVAL_KEYS}
        return {**rest, "metrics": {} if value is None else {self.key: value}}


@dataclasses.dataclass(frozen=True)
class Task:
    """A training entry point, ``python -m train.<name>``, as `run_training` drives it, and what the tools that
    compare and sweep runs need of it; `train.tasks` lists every task."""

    name: str  # also the run record's task
    counted: tuple[str, ...]  # what a step counts (tokens, examples): the run log's throughput keys
    quality: Quality  # the metric the final summary names and the reports rank by
    config_type: type[TrainingConfig]  # the typed configuration its flags fill (a saved config.json is checked on it)
    build_parser: Callable[[], argparse.ArgumentParser]  # the task's flags and `cli.add_training_arguments`
    resolve_config: Callable[[Mapping[str, Any], Mapping[str, Any] | None], TrainingConfig]  # (given, saved)
    check_config: Callable[[Any], None]  # raises UsageError naming a flag out of range
    setup: Callable[[Run, str, DataParallel], TaskSetup]  # (run, precision, parallel)
    loss_name: str = "training loss"  # what the interval records' ``loss`` is, for the summary's final loss
    memory_advice: str = "lower the batch size, or train a smaller model"  # the flags that make a step smaller
    batch_axes: tuple[str, ...] = ("batch_size",)  # the flags that size its batches (sweep axes of this task only)


def run_training(task: Task, argv: Sequence[str] | None = None) -> int:
    """Trains ``task`` as the command line ``argv`` (default ``sys.argv[1:]``) says; returns the exit code. Run as
    the program (no ``argv``), the run's start-up and wall time count from its first import
    (`train.harness.startup.tools_loaded_at`)."""
    started_at = tools_loaded_at() if argv is None else time.monotonic()
    return cli.run_command(lambda args: _start(task, args, StartupClock(started_at)), argv)


def _start(task: Task, argv: list[str], clock: StartupClock) -> int:
    """Parses and checks the flags, joins the distributed job, prepares the run directory, then trains.

    The backend is selected (and, for ``--backend ffi``, the kernels loaded) before anything compiles, so a
    missing kernel library fails at once rather than mid-compilation.
    """
    clock.mark("imports")
    started_utc = runlog.utc_now()
    given = vars(task.build_parser().parse_args(argv))
    saved, saved_path = None, None
    if given.get("resume"):
        check_resume_directory(given)
        saved = load_saved_config(given["resume"])
        saved_path = rundir.config_path(given["resume"])
        config_lib.check_task(saved, task.name, given["resume"])  # before its fields, which are another task's
        config_lib.check_saved(task.config_type, saved, saved_path, given)
    config = task.resolve_config(given, saved)
    cli.check_environment()
    cli.quiet_libraries(config.verbose)
    compile_cache.enable(config.compile_cache)
    try:
        task.check_config(config)
        cli.check_optimizer(config)
    except cli.UsageError as err:
        raise config_lib.where_refused_value_came_from(err, task.config_type, given, saved, saved_path) from None
    if given.get("peer_timeout") is not None and not config.distributed:
        raise cli.UsageError("--peer-timeout applies only to a --distributed run; add --distributed or drop it")
    if config.distributed:
        if config.peer_timeout < 1:
            raise cli.UsageError(f"--peer-timeout must be >= 1 second, got {config.peer_timeout}")
        initialize_distributed(heartbeat_timeout_s=2 * config.peer_timeout)  # the peer watch speaks first
    run_id = saved["run_id"] if saved else from_process_zero("run_id", runlog.new_run_id())
    command = shlex.join(["python", "-m", f"train.{task.name}", *argv])
    owner = jax.process_index() == 0  # the one process that writes the run directory, and holds its lock
    with rundir.claim(config.resume, config.run_dir, run_id, command=command, owner=owner) as claimed:
        if from_process_zero("restart", "yes" if claimed.restart else "no") == "yes":
            if owner:
                print(
                    f"{claimed.path}: its run stopped before its first checkpoint; starting it again from step 0",
                    file=sys.stderr,
                )
            config = config.replace(resume=None, lr_transition=None)  # starts over, on the schedule of its --steps
        wait_for_processes("run directory checked")  # before process 0 starts the run log there
        run_dir = claimed.path
        resume_command = f"python -m train.{task.name} --resume {shlex.quote(str(run_dir))} --distributed"
        with peers.watching(config.distributed, run_dir / CHECKPOINT_DIR, resume_command, config.peer_timeout):
            with backend_lib.use(config.backend):
                backend_lib.active_backend()
                warm_up_devices()
                clock.mark("run_directory")
                changed = tuple(resume.changed_flags(saved, config, given)) if saved else ()
                run = Run(config, frozenset(given), changed, run_id, run_dir, command, clock, started_utc)
                return _train(task, run)


def _warn_profile_past_the_end(profile_steps: Sequence[int] | None, steps: int) -> None:
    """One ``warning:`` line when ``--profile-steps`` reaches past the run's last step (with --epochs the step
    count is known only once the data is)."""
    if profile_steps is None or profile_steps[1] <= steps:
        return
    first, last = profile_steps
    traced = "nothing is traced" if first > steps else f"steps {first}-{steps} are traced"
    print(f"warning: --profile-steps {first}:{last} ends after the run's last step, {steps}: {traced}", file=sys.stderr)


def check_resume_directory(given: Mapping[str, Any]) -> None:
    """Raises UsageError for ``--run-dir`` beside ``--resume`` naming another directory: a resumed run goes on in
    its own."""
    run_dir = given.get("run_dir")
    if run_dir is not None and Path(run_dir).resolve() != Path(given["resume"]).resolve():
        raise cli.UsageError(
            f"--run-dir {run_dir} with --resume {given['resume']}: a resumed run goes on in its own directory; "
            "drop --run-dir"
        )


def state_builder(
    setup: TaskSetup, tx: optax.GradientTransformation, *, fp16: bool, param_dtype: Any, layout: StateLayout
) -> Callable[[Any], TrainState]:
    """``create(pretrained) -> TrainState``: the step-0 state from the pretrained params or ones drawn from the init
    key (and an FP8 model's initial scaling state); with a sharded optimizer its state is made shard by shard, so
    no device ever holds all of it."""
    init_key, train_key = jax.random.split(setup.init_rng)
    sharded = layout.sharded_optimizer
    init_optimizer = None if sharded is None else sharded.init

    def create(pretrained):
        variables, scaling = fp8.split_scaling(setup.init_variables(init_key))
        params = variables["params"] if pretrained is None else pretrained  # jit drops the unused draws
        return TrainState.create(
            params, tx, train_key, fp16=fp16, param_dtype=param_dtype, init_optimizer=init_optimizer, scaling=scaling
        )

    return create


def check_memory(task: Task, setup: TaskSetup, state: TrainState, layout: StateLayout) -> None:
    """Stops the start with one line when a step of the largest batch shape needs more memory than one device has
    (`train.costs.memory_budget`); ``state`` may be abstract, so this runs before anything is allocated."""
    limit = memory_budget.available(jax.local_devices()[0])
    if limit is None:
        return
    shards = layout.parallel.num_shards
    largest = max(setup.batch_shapes, key=lambda shapes: sum(np.prod(shape) for shape, _ in shapes.values()))
    micro_batch = {
        name: jax.ShapeDtypeStruct((shape[1] // shards, *shape[2:]), dtype) for name, (shape, dtype) in largest.items()
    }
    accumulated = next(iter(largest.values()))[0][0] > 1
    scaling = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), state.scaling)  # a few KiB

    def loss_of_params(params, batch, rng):
        return setup.loss_fn(fp8.with_scaling({"params": params}, scaling), batch, rng)

    need = memory_budget.estimate(
        loss_of_params,
        state.params,
        state.opt_state,
        micro_batch,
        accumulated=accumulated,
        optimizer_shards=shards if layout.sharded_optimizer else 1,
    )
    memory_budget.check(need, limit, task.memory_advice)


def make_layout(config: TrainingConfig, tx: optax.GradientTransformation, parallel: DataParallel) -> StateLayout:
    """Replicated state, or with ``--shard-optimizer`` the optimizer state split over the data axis (ZeRO-1)."""
    if not config.shard_optimizer:
        return StateLayout(parallel)
    return StateLayout(
        parallel, shard_optimizer(tx, DATA_AXIS, num_shards=parallel.num_shards, average_gradients=False)
    )


def optimizer_fields(config: TrainingConfig, kernels: int | None) -> dict[str, Any]:
    """The run record's ``optimizer*`` keys: name, implementation, hyperparameters and ``kernels`` per step."""
    name = config.optimizer
    return {
        "optimizer": name,
        "optimizer_implementation": optimizer_lib.implementation(name, backend_lib.active_backend()),
        "optimizer_hyperparameters": optimizer_lib.hyperparameters(name, cli.hyperparameters(config)),
        "optimizer_kernels_per_step": kernels,
    }


def param_count(params: Any) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))


@dataclasses.dataclass(frozen=True)
class ReadyRun:
    """A run ready to train: its configuration (a resume may add its schedule's transition), the task's setup (the
    learning rate as the run follows it), the state (a new run's: its shapes, and its ``creation``, which runs once
    the training step has compiled), the batches from where it resumes, and what writes it."""

    run: Run
    setup: TaskSetup
    state: TrainState
    creation: StateCreation | None
    stream: EpochStream
    counters: Counters | None
    hardware: Hardware
    checkpoints: Checkpoints
    tx: optax.GradientTransformation
    signature: dict[str, Any]
    layout: StateLayout
    optimizer_kernels: Callable[[], int | None]  # kernels one optimizer step launches (None: not counted), waited for


def _train(task: Task, run: Run) -> int:
    """Sets the run up, trains it and reports; SIGINT/SIGTERM are handled from here on
    (`train.harness.signals.StopSignals`): during setup they stop the run once the work in hand (a compilation) has
    returned, with nothing to save."""
    with StopSignals() as signals:
        prepared = None
        try:
            with signals.deferred("setup"):
                prepared = _prepare(task, run)
        except Interrupted:
            if prepared is not None:  # what setup started stops before the process ends
                prepared.checkpoints.close()
                prepared.hardware.energy.close()
            raise
        if prepared is None:
            return 0
        run, setup, state, layout = prepared.run, prepared.setup, prepared.state, prepared.layout
        hardware = prepared.hardware
        config, run_dir = run.config, run.run_dir
        run_log = RunLog(run_dir, task.counted, enabled=jax.process_index() == 0, tensorboard=config.tensorboard)
        save_config(run_dir, {"task": task.name, "run_id": run.run_id, **config.to_dict()})
        if not config.resume:
            # Made and written once the optimizer step's kernels are counted (compiled on a thread), before any
            # later record.
            run_log.write_later(
                lambda: progress.run_record(
                    task.name,
                    run,
                    hardware,
                    optimizer=optimizer_fields(config, prepared.optimizer_kernels()),
                    implementation=setup.implementation,
                    model=setup.model_name,
                    params=param_count(state.params),
                    batch=setup.batch_record,
                    data=setup.data_record,
                    config=setup.config_record,
                )
            )
        run.startup.mark("run_record")
        if jax.process_index() == 0:
            _warn_profile_past_the_end(config.profile_steps, setup.steps)
            shapes = f" for {len(setup.batch_shapes)} batch shapes" if len(setup.batch_shapes) > 1 else ""
            print(f"compiling the training step{shapes}", file=sys.stderr, flush=True)
        result = Loop(
            state,
            compiler=StepCompiler(
                make_train_step(
                    setup.loss_fn,
                    prepared.tx,
                    axis_name=DATA_AXIS,
                    sharded_optimizer=layout.sharded_optimizer,
                    grad_bucket_bytes=int(config.grad_bucket_mb * 2**20),
                    grad_comm_dtype=gradient_comm_dtype(config.grad_comm_dtype, hardware.precision),
                ),
                layout,
                state,
                executables=_step_executables(task, prepared),
            ),
            parallel=layout.parallel,
            stream=prepared.stream,
            flops_fn=setup.flops_fn,
            lr_fn=optimizer_lib.on_host(setup.learning_rate),
            evaluate=reporting(task, setup.evaluate, setup.steps),
            hardware=hardware,
            run_log=run_log,
            checkpoints=prepared.checkpoints,
            model_signature=prepared.signature,
            config=LoopConfig(
                num_steps=setup.steps,
                log_every=config.log_every,
                eval_every=setup.eval_every,
                checkpoint_every=setup.checkpoint_every,
                progress_bar=config.progress,
                startup=run.startup,
                profile_steps=None if config.profile_steps is None else tuple(config.profile_steps),
                profile_dir=run_dir / PROFILE_DIR / f"process{jax.process_index()}",
            ),
            counters=prepared.counters,
            signals=signals,
            batch_shapes=setup.batch_shapes,
            creation=prepared.creation,
        ).run()
    return _finish(task, run, result, run_log, prepared.checkpoints, hardware)


def _step_executables(task: Task, prepared: ReadyRun) -> StepExecutables | None:
    """Where a single process keeps its training steps between runs (`train.harness.executable_cache`): in the
    compilation cache's directory; None with the cache off."""
    directory = compile_cache.use().directory
    if directory is None or jax.process_count() > 1:
        return None
    setup = prepared.setup
    description = run_description(
        task.name, setup.config_record, setup.steps, prepared.signature, backend_lib.active_backend()
    )
    return StepExecutables(Path(directory), description)


def _optimizer(
    config: TrainingConfig, schedule: optax.Schedule, param_dtype: Any, parallel: DataParallel
) -> tuple[optax.GradientTransformation, StateLayout]:
    tx = optimizer_lib.make_optimizer(
        config.optimizer,
        schedule,
        weight_decay=config.weight_decay,
        clip_norm=config.clip_norm,
        master_dtype=param_dtype,
        **cli.hyperparameters(config),
    )
    return tx, make_layout(config, tx, parallel)


def _prepare(task: Task, run: Run) -> ReadyRun | None:
    """The task's setup, the optimizer and the state to train from (restored on ``--resume``); None when a resumed
    run finished at or beyond ``--steps`` (it says so, and its run log is left as it is). A run stopped at its
    last step before its final evaluation ended resumes into that evaluation. A run resumed with another --steps
    (or --lr) goes on from the learning rate it had (`train.harness.optimizer.continued`)."""
    config, run_dir = run.config, run.run_dir
    hardware = detect_hardware(config.precision, config.device_name, config.price_per_hour)
    precision = hardware.precision
    parallel = DataParallel.over_all_devices()
    run.startup.mark("hardware")
    setup = task.setup(run, precision, parallel)
    run.startup.mark("data_and_model")
    plan = setup.learning_rate
    setup = dataclasses.replace(setup, learning_rate=optimizer_lib.continued(plan, config.lr_transition, setup.steps))
    signature = {
        **setup.model_signature,
        "implementation": setup.implementation,
        "optimizer": config.optimizer,
        **precision_signature(config.master_weights, precision),
    }
    param_dtype = master_dtype(config.master_weights, precision)
    tx, layout = _optimizer(config, setup.learning_rate, param_dtype, parallel)
    create = state_builder(setup, tx, fp16=precision == "fp16", param_dtype=param_dtype, layout=layout)
    abstract = jax.eval_shape(create, setup.pretrained_params)
    check_memory(task, setup, abstract, layout)
    # One thread compiles, in this order, what comes later: the run record's count of one optimizer step's kernels
    # (for a new run with the optimizer state whole), which the run record waits for, then a new run's state, which
    # runs once the training step has compiled (`StateCreation`).
    compiles = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="setup-compiles")
    optimizer_kernels = (
        optimizer_step_kernels_later(tx, abstract.params, abstract.opt_state, compiles)
        if not config.resume and layout.sharded_optimizer is None
        else lambda: None
    )
    creation = (
        None
        if config.resume
        else StateCreation(create, setup.pretrained_params, abstract, layout.shardings(abstract), compiles)
    )
    compiles.shutdown(wait=False)
    checkpoints = Checkpoints(run_dir / CHECKPOINT_DIR, keep=config.keep_checkpoints, saved_form=layout.to_saved)
    stream, counters = setup.stream, None
    if not config.resume:
        state = abstract
    else:  # the checkpoint's state, restored onto the shapes of a new one: nothing is drawn
        saved, step, position, counters, rate = resume.restore_latest(
            checkpoints, layout.saved_abstract(abstract), signature, run_dir
        )
        state = layout.from_saved(saved)
        if step >= setup.steps and rundir.finished(run_dir):
            resume.say_nothing_to_do(task.name, run_dir, step, setup.steps)
            checkpoints.close()
            hardware.energy.close()
            return None
        transition = resume.transition(
            None if rate is None else (step, rate), optimizer_lib.on_host(setup.learning_rate), config.lr_transition
        )
        changed = transition != config.lr_transition
        if changed:  # the same optimizer state, with the schedule the run goes on with
            config = config.replace(lr_transition=transition)
            run = dataclasses.replace(run, config=config)
            setup = dataclasses.replace(setup, learning_rate=optimizer_lib.continued(plan, transition, setup.steps))
            tx, layout = _optimizer(config, setup.learning_rate, param_dtype, parallel)
        if jax.process_index() == 0:
            ended_here = runlog.truncate_for_resume(run_dir, step)
            if ended_here is not None:
                counters.add_work_after_checkpoint(ended_here)
            moved = f"; its learning rate goes on from {rate:.3g} into the schedule of --steps {setup.steps}"
            print(
                f"resuming {run_dir} at step {step}{' with ' + ', '.join(run.changed) if run.changed else ''}"
                f"{moved if changed else ''}",
                file=sys.stderr,
            )
        stream = stream.at(position)
    run.startup.mark("state")
    return ReadyRun(
        run, setup, state, creation, stream, counters, hardware, checkpoints, tx, signature, layout, optimizer_kernels
    )


def format_rate(value: float | None) -> str:
    """A throughput, in one format for every task: whole numbers with thousands separated (28,821), three
    significant digits below 100 (41.3)."""
    return format_value(value, ",.0f" if value is not None and value >= 100 else ".3g")


def throughput(counted: Sequence[str], summary: Mapping[str, Any]) -> str:
    """The summary's rate of each thing a step counts: ``28,821 tokens/s, 14,350 target tokens/s``."""
    return ", ".join(f"{format_rate(summary.get(f'{name}_per_s'))} {name.replace('_', ' ')}/s" for name in counted)


def reporting(
    task: Task, evaluate: Callable[[TrainState, bool], list[dict[str, Any]]], steps: int
) -> Callable[[TrainState, bool], list[dict[str, Any]]]:
    """``evaluate`` with the task's metric gathered into each result's ``metrics`` (`Quality.gathered`), which also
    prints each evaluation during training as one line, ``step 100/300  evaluation: valid perplexity 12.345`` (the
    final one is in the summary), on the main host."""

    def run(state: TrainState, final: bool) -> list[dict[str, Any]]:
        records = [task.quality.gathered(fields) for fields in evaluate(state, final)]
        if not final and jax.process_index() == 0:
            scores = ", ".join(
                f"{record['split']} {task.quality.label} {task.quality.describe(record['metrics'])}"
                for record in records
            )
            tqdm.write(f"step {int(jax.device_get(state.step))}/{steps}  evaluation: {scores}", file=sys.stderr)
        return records

    return run


def _finish(
    task: Task, run: Run, result: TrainResult, run_log: RunLog, checkpoints: Checkpoints, hardware: Hardware
) -> int:
    """Closes the run, prints its summary on the main host and returns the process exit code (`cli.exit_code`)."""
    run_log.close()
    checkpoints.close()
    hardware.energy.close()
    run_dir = run.run_dir
    # A run stopped before its first step trained nothing to report: the line of `cli.exit_code` says what happened.
    if jax.process_index() == 0 and result.summary["train_time_s"] > 0:
        s = result.summary
        log_path = run_dir / runlog.LOG_FILENAME
        evals = (
            [r for r in runlog.read(log_path) if r["type"] == "eval" and r["step"] == s["steps"]]
            if log_path.exists()
            else []
        )
        scores = ", ".join(f"{r['split']} {task.quality.describe(r['metrics'])}" for r in evals) or "n/a"
        source = s["energy_source"]
        energy = {None: "not measured on this device", "estimated": "estimated (power x time)"}.get(
            source, f"measured ({source})"
        )
        lines = [
            f"\n{s['stop_reason']} after {s['steps']} steps in {s['train_time_s']:.1f} s of training "
            f"({s['wall_time_s']:.1f} s wall); energy {energy}",
            *progress.describe_windows(s, lambda record: throughput(task.counted, record)),
            f"  final loss  {format_value(s['final_loss'], '.4f')} ({task.loss_name}), {task.quality.label} {scores}",
            f"  memory      {memory.describe(s['memory'])}",
            f"  run log     {log_path}",
            f"  compare     python -m train.compare {shlex.quote(str(log_path))} OTHER_RUN/run.jsonl",
        ]
        if s["stop_reason"] != "nan":  # a non-finite loss goes on from a checkpoint with other flags (its own line)
            longer = f" --steps {2 * s['steps']}" if s["stop_reason"] == "finished" else ""
            lines.append(f"  resume      python -m train.{task.name} --resume {shlex.quote(str(run_dir))}{longer}")
        print("\n".join(lines))
    return cli.exit_code(result, checkpoints, f"python -m train.{task.name} --resume {shlex.quote(str(run_dir))}")
