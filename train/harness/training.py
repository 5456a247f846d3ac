"""One training sequence for every task: `run_training(task)`.

A `Task` says what makes an entry point its own: its flags and defaults, and, for one run, a `TaskSetup` with the
model's initial parameters, the loss, the data stream, the FLOP count, the evaluation, the learning-rate schedule
and what the run record says about the model, batch and data. The harness owns the rest, the same for every task:
flags shared by all tasks, the run directory and ``--resume``, hardware, precision, data parallelism, the
optimizer, compilation, checkpoints, signals, the run log, the summary and the exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import optax

from ls_jax import backend as backend_lib
from train.harness import cli, peers, progress
from train.costs import memory
from train.records import runlog
from train.records.checkpoints import CHECKPOINT_DIR, Checkpoints
from train.data.stream import EpochStream
from train.costs.hardware import Hardware, detect_hardware
from train.harness.loop import LoopConfig, StopSignals, TrainResult, train
from train.harness import optimizer as optimizer_lib
from train.costs.compiled import optimizer_step_kernels
from ls_jax.optim import shard_optimizer
from train.harness.parallel import (DATA_AXIS, DataParallel, StateLayout, from_process_zero, initialize_distributed,
                            wait_for_processes)
from train.costs.precision import master_dtype, precision_signature
from train.records.rundir import load_saved_config, prepare_run_dir, save_config
from train.harness import config as config_lib
from train.harness import resume
from train.harness.config import Run, TrainingConfig
from train.records.runlog import RunLog
from train.harness.step import LossFn, TrainState, make_train_step
from train.harness.step_compiler import StepCompiler

BatchShapes = dict[str, tuple[tuple[int, ...], Any]]  # name -> (global shape, dtype)


@dataclasses.dataclass(frozen=True)
class TaskSetup:
    """What a task built for one run (data read, model configured): everything the harness needs to train it."""

    init_params: Callable[[jax.Array], Any]  # params from an init key; traced under jit, unless pretrained is given
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
    model_signature: dict[str, Any]  # what a checkpoint must agree on (the harness adds optimizer and precision)
    model_name: str  # the run record's model, batch, data and config
    batch_record: dict[str, Any]
    data_record: dict[str, Any]
    config_record: dict[str, Any]
    pretrained_params: Any = None


@dataclasses.dataclass(frozen=True)
class Task:
    """A training entry point, ``python -m train.<name>``, as `run_training` drives it."""

    name: str  # also the run record's task
    counted: tuple[str, ...]  # what a step counts (tokens, examples): the run log's throughput keys
    metric: str  # the quality metric the final summary names (BLEU, accuracy)
    build_parser: Callable[[], argparse.ArgumentParser]  # the task's flags and `cli.add_training_arguments`
    resolve_config: Callable[[Mapping[str, Any], Mapping[str, Any] | None], TrainingConfig]  # (given, saved)
    check_config: Callable[[Any], None]  # raises UsageError naming a flag out of range
    setup: Callable[[Run, str, DataParallel], TaskSetup]  # (run, precision, parallel)
    throughput: Callable[[Mapping[str, Any]], str]  # the summary's throughput in the task's units
    score: Callable[[Mapping[str, Any]], str]  # the metric of one eval record
    loss_name: str = "training loss"  # what the interval records' ``loss`` is, for the summary's final loss


def run_training(task: Task, argv: Sequence[str] | None = None) -> int:
    """Trains ``task`` as the command line ``argv`` (default ``sys.argv[1:]``) says; returns the exit code."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter, when tfds imports it
    return cli.run_command(lambda args: _start(task, args), argv)


def _start(task: Task, argv: list[str]) -> int:
    """Parses and checks the flags, joins the distributed job, prepares the run directory, then trains.

    The backend is selected (and, for ``--backend ffi``, the kernels loaded) before anything compiles, so a
    missing kernel library fails at once rather than mid-compilation.
    """
    started_at, started_utc = time.monotonic(), runlog.utc_now()
    given = vars(task.build_parser().parse_args(argv))
    saved = load_saved_config(given["resume"]) if given.get("resume") else None
    config_lib.check_task(saved, task.name, given.get("resume"))
    config = task.resolve_config(given, saved)
    config = config.replace(backend=cli.kernel_mode(config, given))
    task.check_config(config)
    cli.check_optimizer(config)
    if given.get("peer_timeout") is not None and not config.distributed:
        raise cli.UsageError("--peer-timeout applies only to a --distributed run; add --distributed or drop it")
    if config.distributed:
        if config.peer_timeout < 1:
            raise cli.UsageError(f"--peer-timeout must be >= 1 second, got {config.peer_timeout}")
        initialize_distributed(heartbeat_timeout_s=2 * config.peer_timeout)  # the peer watch speaks first
    run_id = saved["run_id"] if saved else from_process_zero("run_id", runlog.new_run_id())
    run_dir = prepare_run_dir(config.resume, config.run_dir, run_id)
    wait_for_processes("run directory checked")  # before process 0 starts the run log there
    command = shlex.join(["python", "-m", f"train.{task.name}", *argv])
    resume = f"python -m train.{task.name} --resume {shlex.quote(str(run_dir))} --distributed"
    with peers.watching(config.distributed, run_dir / CHECKPOINT_DIR, resume, config.peer_timeout):
        with backend_lib.use(config.backend):
            backend_lib.active_backend()
            return _train(task, Run(config, given, run_id, run_dir, command, started_at, started_utc))


def initial_state(setup: TaskSetup, tx: optax.GradientTransformation, *, fp16: bool, param_dtype: Any,
                  layout: StateLayout) -> TrainState:
    """The step-0 state placed as ``layout`` says: the pretrained params or ones drawn from the init key; with a
    sharded optimizer its state is made shard by shard, so no device ever holds all of it."""
    init_key, train_key = jax.random.split(setup.init_rng)
    sharded = layout.sharded_optimizer
    init_optimizer = None if sharded is None else sharded.init

    def create(pretrained):
        params = setup.init_params(init_key) if pretrained is None else pretrained
        return TrainState.create(params, tx, train_key, fp16=fp16, param_dtype=param_dtype, init_optimizer=init_optimizer)

    abstract = jax.eval_shape(create, setup.pretrained_params)
    return jax.jit(create, out_shardings=layout.shardings(abstract))(setup.pretrained_params)


def make_layout(config: TrainingConfig, tx: optax.GradientTransformation, parallel: DataParallel) -> StateLayout:
    """Replicated state, or with ``--shard-optimizer`` the optimizer state split over the data axis (ZeRO-1)."""
    if not config.shard_optimizer:
        return StateLayout(parallel)
    return StateLayout(parallel, shard_optimizer(tx, DATA_AXIS, num_shards=parallel.num_shards, average_gradients=False))


def optimizer_fields(config: TrainingConfig, tx: optax.GradientTransformation, state: TrainState,
                     layout: StateLayout) -> dict[str, Any]:
    """The run record's ``optimizer*`` keys: name, implementation, hyperparameters, kernels per step (counted when
    the optimizer state is not sharded)."""
    name = config.optimizer
    kernels = None if layout.sharded_optimizer else optimizer_step_kernels(tx, state.params, state.opt_state)
    return {
        "optimizer": name,
        "optimizer_implementation": optimizer_lib.implementation(name, backend_lib.active_backend()),
        "optimizer_hyperparameters": optimizer_lib.hyperparameters(
            name, cli.hyperparameters(config)),
        "optimizer_kernels_per_step": kernels,
    }


def param_count(params: Any) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))


def _train(task: Task, run: Run) -> int:
    """Sets the run up, trains it and reports; SIGINT/SIGTERM are handled from here on (`train.harness.loop.StopSignals`):
    before training starts they stop the run at once, with nothing to save."""
    with StopSignals() as signals:
        with signals.interruptible():
            prepared = _prepare(task, run)
        if prepared is None:
            return 0
        setup, state, stream, counters, hardware, checkpoints, tx, signature, layout = prepared
        config, run_dir = run.config, run.run_dir
        run_log = RunLog(run_dir, task.counted, enabled=jax.process_index() == 0, tensorboard=config.tensorboard)
        save_config(run_dir, {"task": task.name, "run_id": run.run_id, **config.to_dict()})
        if not config.resume:
            run_log.write(progress.run_record(
                task.name, run, hardware, optimizer=optimizer_fields(config, tx, state, layout), model=setup.model_name,
                params=param_count(state.params), batch=setup.batch_record, data=setup.data_record,
                config=setup.config_record,
            ))
        if jax.process_index() == 0:
            shapes = f" for {len(setup.batch_shapes)} batch shapes" if len(setup.batch_shapes) > 1 else ""
            print(f"compiling the training step{shapes}", file=sys.stderr, flush=True)
        result = train(
            state,
            compiler=StepCompiler(
                make_train_step(setup.loss_fn, tx, axis_name=DATA_AXIS, sharded_optimizer=layout.sharded_optimizer),
                layout, state,
            ),
            parallel=layout.parallel,
            stream=stream,
            flops_fn=setup.flops_fn,
            lr_fn=optimizer_lib.on_host(setup.learning_rate),
            evaluate=setup.evaluate,
            hardware=hardware,
            run_log=run_log,
            checkpoints=checkpoints,
            model_signature=signature,
            config=LoopConfig(
                num_steps=setup.steps, log_every=config.log_every, eval_every=setup.eval_every,
                checkpoint_every=setup.checkpoint_every, progress_bar=config.progress, started_at=run.started_at,
            ),
            counters=counters,
            signals=signals,
            batch_shapes=setup.batch_shapes,
        )
    return _finish(task, run, result, run_log, checkpoints, hardware)


def _prepare(task: Task, run: Run):
    """The task's setup, the optimizer and the state to train from (restored on ``--resume``); None when a resumed
    run finished at or beyond ``--steps`` (it says so, and its run log is left as it is). A run stopped at its
    last step before its final evaluation ended resumes into that evaluation."""
    config, run_dir = run.config, run.run_dir
    hardware = detect_hardware(config.precision, config.device_name, config.price_per_hour)
    precision = hardware.precision
    parallel = DataParallel.over_all_devices()

    setup = task.setup(run, precision, parallel)
    signature = {**setup.model_signature, "optimizer": config.optimizer, **precision_signature(config.master_weights, precision)}
    param_dtype = master_dtype(config.master_weights, precision)
    tx = optimizer_lib.make_optimizer(config.optimizer, setup.learning_rate, weight_decay=config.weight_decay,
                                      clip_norm=config.clip_norm, master_dtype=param_dtype,
                                      **cli.hyperparameters(config))
    layout = make_layout(config, tx, parallel)
    state = initial_state(setup, tx, fp16=precision == "fp16", param_dtype=param_dtype, layout=layout)
    checkpoints = Checkpoints(run_dir / CHECKPOINT_DIR, keep=config.keep_checkpoints, saved_form=layout.to_saved)
    stream, counters = setup.stream, None
    if config.resume:
        saved, step, position, counters = resume.restore_latest(checkpoints, layout.saved_abstract(state), signature, run_dir)
        state = layout.from_saved(saved)
        if step >= setup.steps and resume.finished(run_dir):
            resume.say_nothing_to_do(task.name, run_dir, step, setup.steps)
            checkpoints.close()
            hardware.energy.close()
            return None
        if jax.process_index() == 0:
            runlog.truncate_for_resume(run_dir, step)
            print(f"resuming {run_dir} at step {step}", file=sys.stderr)
        stream = stream.at(position)
    return setup, state, stream, counters, hardware, checkpoints, tx, signature, layout


def format_value(value: float | None, spec: str = ".3g", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _finish(task: Task, run: Run, result: TrainResult, run_log: RunLog, checkpoints: Checkpoints,
            hardware: Hardware) -> int:
    """Closes the run, prints its summary on the main host and returns the process exit code (`cli.exit_code`)."""
    run_log.close()
    checkpoints.close()
    hardware.energy.close()
    run_dir = run.run_dir
    if jax.process_index() == 0:
        s = result.summary
        log_path = run_dir / runlog.LOG_FILENAME
        evals = [r for r in runlog.read(log_path) if r["type"] == "eval" and r["step"] == s["steps"]] if log_path.exists() else []
        scores = ", ".join(f"{r['split']} {task.score(r)}" for r in evals) or "n/a"
        print(
            f"\n{s['stop_reason']} after {s['steps']} steps in {s['train_time_s']:.1f} s of training "
            f"({s['wall_time_s']:.1f} s wall)\n"
            f"  throughput  {task.throughput(s)}, step {format_value(s['step_time_s'], '.3f', ' s')}\n"
            f"  compute     {format_value(s['tflops_per_s'])} TFLOP/s, MFU {format_value(s['mfu'], '.1%')}\n"
            f"  energy      {format_value(s['energy_j'], '.4g', ' J')} "
            f"({s['energy_source'] or 'not measured on this device'}), cost {format_value(s['cost_usd'], '.4f', ' USD')}\n"
            f"  final loss  {format_value(s['final_loss'], '.4f')} ({task.loss_name}), {task.metric} {scores}\n"
            f"  memory      {memory.describe(s['memory'])}\n"
            f"  run log     {log_path}\n"
            f"  compare     python -m train.compare {shlex.quote(str(log_path))} OTHER_RUN/run.jsonl\n"
            f"  resume      python -m train.{task.name} --resume {shlex.quote(str(run_dir))}"
            f"{'' if s['stop_reason'] != 'finished' else ' --steps ' + str(2 * s['steps'])}"
        )
    return cli.exit_code(result, checkpoints, f"python -m train.{task.name} --resume {shlex.quote(str(run_dir))}")
