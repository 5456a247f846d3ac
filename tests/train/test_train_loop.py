"""The task-agnostic loop on a toy regression task: accumulation, loss scaling, NaN stop, signals, resume."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train.costs.hardware import Hardware
from train.costs.precision import parse_precision, precision_signature
from train.harness import loop
from train.harness.optimizer import inverse_sqrt_schedule
from train.harness.parallel import DATA_AXIS, DataParallel, StateLayout
from train.harness.progress import Counters
from train.harness.step import DynamicLossScale, TrainState, make_train_step
from train.harness.step_compiler import StepCompiler
from train.records import runlog
from train.records.checkpoints import Checkpoints

FEATURES = 4
TRUE_W = np.arange(1.0, FEATURES + 1, dtype=np.float32)


def make_toy_loss(noise):
    def toy_loss(variables, batch, rng):
        """Summed squared error of a linear model plus rng-drawn noise (so resuming must restore the RNG)."""
        params = variables["params"]
        prediction = batch["x"] @ params["w"] + params["b"] + noise * jax.random.normal(rng, batch["y"].shape)
        errors = (prediction - batch["y"]) ** 2 * batch["mask"]
        return jnp.sum(errors), jnp.sum(batch["mask"]), {"nll": jnp.sum(errors)}

    return toy_loss


toy_loss = make_toy_loss(noise=0.01)


def toy_batch(epoch, index, grad_accum=1, rows=8, poison=False):
    rng = np.random.default_rng([epoch, index])
    x = rng.normal(size=(grad_accum, rows, FEATURES)).astype(np.float32)
    if poison:
        x[...] = np.nan
    return {"x": x, "y": x @ TRUE_W + 0.5, "mask": np.ones((grad_accum, rows), np.float32)}


class ToyStream:
    """Endless toy batches, resumable at (epoch, index); ``on_step`` hooks let a test act at a given step."""

    def __init__(self, epoch=0, index=0, steps_per_epoch=5, grad_accum=1, poison_at=None, on_step=None):
        self.epoch, self.index = epoch, index
        self.steps_per_epoch, self.grad_accum = steps_per_epoch, grad_accum
        self.poison_at, self.on_step = poison_at, on_step
        self.served = 0

    @property
    def position(self):
        return {"epoch": self.epoch, "index": self.index}

    def __next__(self):
        if self.index == self.steps_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        batch = toy_batch(
            self.epoch,
            self.index,
            self.grad_accum,
            poison=self.poison_at == self.epoch * self.steps_per_epoch + self.index + 1,
        )
        self.index += 1
        self.served += 1
        if self.on_step:
            self.on_step(self.served)
        return batch, {"examples": 8 * self.grad_accum}


def new_state(tx, fp16=False):
    params = {"w": jnp.zeros((FEATURES,)), "b": jnp.zeros(())}
    return TrainState.create(params, tx, jax.random.PRNGKey(0), fp16=fp16)


def run_loop(
    tmp_path, stream, steps, *, tx=None, state=None, counters=None, checkpoint_every=2, log_every=1, hardware=None
):
    tx = tx or optax.sgd(0.05)
    tmp_path.mkdir(parents=True, exist_ok=True)
    parallel = DataParallel.over_all_devices()
    state = state if state is not None else parallel.replicate(new_state(tx))
    run_log = runlog.RunLog(tmp_path, ("examples",), tensorboard=False)
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=10)
    result = loop.Loop(
        state,
        compiler=StepCompiler(make_train_step(toy_loss, tx, axis_name=DATA_AXIS), StateLayout(parallel), state),
        parallel=parallel,
        stream=stream,
        flops_fn=lambda shapes: 2.0 * np.prod(shapes["x"]),
        lr_fn=lambda step: 0.05,
        evaluate=lambda state, final: [{"split": "valid", "loss": 1.0, "nll": 1.0}],
        hardware=hardware or Hardware.detect("fp32"),
        run_log=run_log,
        checkpoints=checkpoints,
        model_signature={"toy": 1},
        config=loop.LoopConfig(
            num_steps=steps, log_every=log_every, checkpoint_every=checkpoint_every, progress_bar=False
        ),
        counters=counters,
    ).run()
    run_log.close()
    return result, checkpoints


def test_accumulated_micro_batches_give_the_gradient_of_the_whole_step():
    tx = optax.sgd(1.0)
    exact_loss = make_toy_loss(noise=0.0)
    step = jax.jit(make_train_step(exact_loss, tx))
    batch = toy_batch(0, 0, grad_accum=3)
    accumulated, _ = step(new_state(tx), batch)
    whole = {k: v.reshape(1, -1, *v.shape[2:]) for k, v in batch.items()}
    single, metrics = step(new_state(tx), whole)
    any_key = jax.random.PRNGKey(9)  # the noise is off
    manual = jax.grad(lambda p: exact_loss({"params": p}, jax.tree.map(lambda v: v[0], whole), any_key)[0] / 24)(
        new_state(tx).params
    )
    for name in ("w", "b"):
        np.testing.assert_allclose(accumulated.params[name], single.params[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(single.params[name], -manual[name], rtol=1e-5, atol=1e-6)
    assert float(metrics["weight"]) == 24.0


def test_dynamic_loss_scale_halves_on_overflow_and_grows_after_the_interval():
    scale = DynamicLossScale.create(initial_scale=8.0, growth_interval=2)
    scale = scale.update(jnp.bool_(False))
    assert float(scale.scale) == 4.0
    scale = scale.update(jnp.bool_(True))
    assert float(scale.scale) == 4.0
    scale = scale.update(jnp.bool_(True))
    assert float(scale.scale) == 8.0 and int(scale.finite_steps) == 0


def test_fp16_step_with_non_finite_gradients_is_skipped():
    tx = optax.sgd(0.1)
    step = jax.jit(make_train_step(toy_loss, tx))
    state = new_state(tx, fp16=True)
    skipped, metrics = step(state, toy_batch(0, 0, poison=True))
    assert not bool(metrics["finite"])
    assert int(skipped.step) == 1
    assert float(skipped.loss_scale.scale) == float(state.loss_scale.scale) / 2
    np.testing.assert_array_equal(skipped.params["w"], state.params["w"])
    taken, metrics = step(skipped, toy_batch(0, 1))
    assert bool(metrics["finite"]) and not np.array_equal(taken.params["w"], state.params["w"])


def test_log_records_follow_the_schema_and_totals_add_up(tmp_path):
    result, _ = run_loop(tmp_path, ToyStream(), steps=6, log_every=3)
    records = runlog.read(tmp_path / runlog.LOG_FILENAME)
    assert [r["type"] for r in records] == ["interval", "interval", "eval", "summary"]
    for record in records:
        runlog.validate(record, ("examples",))
    assert records[0]["loss"] > records[1]["loss"]  # it learns
    summary = records[-1]
    assert summary["completed"] and summary["steps"] == 6 and summary["examples"] == 48
    assert summary["flops_per_step"] == 2.0 * 8 * FEATURES
    assert summary["train_time_s"] <= summary["wall_time_s"]
    assert summary["examples_per_s"] == pytest.approx(48 / summary["train_time_s"])
    assert result.stop_reason == "finished"


def test_resume_continues_exactly(tmp_path):
    straight, _ = run_loop(tmp_path / "straight", ToyStream(), steps=8)
    run_loop(tmp_path / "split", ToyStream(), steps=4)
    checkpoints = Checkpoints(tmp_path / "split" / "checkpoints")
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        DataParallel.over_all_devices().replicate(new_state(optax.sgd(0.05))),
    )
    state, progress = checkpoints.restore(checkpoints.latest_step(), template, {"toy": 1})
    assert progress["step"] == 4 and int(state.step) == 4
    resumed, _ = run_loop(
        tmp_path / "split",
        ToyStream(**progress["data"]),
        steps=8,
        state=state,
        counters=Counters.from_dict(progress["counters"]),
    )
    for name in ("w", "b"):
        np.testing.assert_allclose(resumed.state.params[name], straight.state.params[name], rtol=0, atol=1e-6)
    assert resumed.summary["examples"] == straight.summary["examples"] == 64


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    result, checkpoints = run_loop(tmp_path, ToyStream(poison_at=5), steps=10, checkpoint_every=2)
    assert result.stop_reason == "nan" and result.steps == 4
    assert checkpoints.all_steps() == [2, 4]
    summary = runlog.read(tmp_path / runlog.LOG_FILENAME)[-1]
    assert summary["type"] == "summary" and not summary["completed"] and summary["stop_reason"] == "nan"
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), result.state)
    state, _ = checkpoints.restore(4, template, {"toy": 1})
    assert np.isfinite(np.asarray(state.params["w"])).all()


def test_sigterm_writes_a_checkpoint_and_stops(tmp_path):
    stream = ToyStream(on_step=lambda served: served == 3 and os.kill(os.getpid(), signal.SIGTERM))
    previous = signal.getsignal(signal.SIGTERM)
    result, checkpoints = run_loop(tmp_path, stream, steps=50, checkpoint_every=1000)
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored
    assert result.stop_reason == "signal" and result.signal_number == signal.SIGTERM
    assert checkpoints.all_steps() == [result.steps] and result.steps == stream.served
    assert checkpoints.progress(result.steps)["data"] == stream.position
    summary = runlog.read(tmp_path / runlog.LOG_FILENAME)[-1]
    assert summary["stop_reason"] == "signal" and not summary["completed"]


def test_restore_refuses_another_model(tmp_path):
    _, checkpoints = run_loop(tmp_path, ToyStream(), steps=2)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), new_state(optax.sgd(0.05)))
    with pytest.raises(ValueError, match=r"toy: checkpoint 1 vs now 2"):
        checkpoints.restore(2, template, {"toy": 2})


def test_inverse_sqrt_schedule():
    schedule = inverse_sqrt_schedule(1.0, 100)
    assert float(schedule(0)) == 0.0
    assert float(schedule(50)) == pytest.approx(0.5)
    assert float(schedule(100)) == pytest.approx(1.0)
    assert float(schedule(400)) == pytest.approx(0.5)


def test_xla_flops_are_known_only_without_accumulation():
    tx = optax.sgd(0.1)
    parallel = DataParallel.over_all_devices()
    state = parallel.replicate(new_state(tx))
    compiler = StepCompiler(make_train_step(toy_loss, tx, axis_name=DATA_AXIS), StateLayout(parallel), state)
    single, accumulated = toy_batch(0, 0, grad_accum=1), toy_batch(0, 0, grad_accum=2)
    compiler.compiled(state, single)
    compiler.compiled(state, accumulated)
    assert compiler.xla_flops(StepCompiler.key(single)) > 0
    assert compiler.xla_flops(StepCompiler.key(accumulated)) is None  # XLA counts a loop body once


def test_warm_up_runs_each_compiled_step_once_and_leaves_the_state_as_it_was():
    seen = []

    def recording_loss(params, batch, rng):
        jax.debug.callback(lambda x: seen.append(x.shape), batch["x"])
        return toy_loss(params, batch, rng)

    tx = optax.sgd(0.1)
    parallel = DataParallel.over_all_devices()
    state = parallel.replicate(new_state(tx))
    compiler = StepCompiler(make_train_step(recording_loss, tx, axis_name=DATA_AXIS), StateLayout(parallel), state)
    shapes = [
        {name: (value.shape, value.dtype) for name, value in toy_batch(0, 0, rows=rows).items()} for rows in (8, 4)
    ]
    compiler.precompile(state, shapes)
    compiler.warm_up(state)
    jax.effects_barrier()
    assert sorted(seen) == [(4, FEATURES), (8, FEATURES)]  # one execution per shape, on a batch of each shape
    assert int(state.step) == 0 and float(jnp.sum(state.params["w"])) == 0.0  # the copy was trained, not the state
    next_state, _ = compiler.compiled(state, toy_batch(0, 0))(state, parallel.put_batch(toy_batch(0, 0), row_axis=1))
    assert int(next_state.step) == 1


def test_precision_choice_follows_the_device():
    from train.costs import devices as device_table

    v100, h100 = device_table.find_device("Tesla V100-SXM2-16GB"), device_table.find_device("NVIDIA H100 80GB HBM3")
    assert parse_precision("auto", "cpu", None) == "fp32"
    assert parse_precision("auto", "gpu", h100) == "bf16"
    assert parse_precision("auto", "gpu", v100) == "fp16"
    assert parse_precision("auto", "tpu", device_table.find_device("TPU v3")) == "bf16"
    assert parse_precision("fp16", "gpu", h100) == "fp16"
    with pytest.raises(ValueError, match="V100-SXM2 has no bf16 support"):
        parse_precision("bf16", "gpu", v100)
    assert parse_precision("fp8", "gpu", h100) == "fp8"
    with pytest.raises(ValueError, match="V100-SXM2 has no bf16 support"):
        parse_precision("fp8", "gpu", v100)  # fp8 computes in bf16 outside its GEMMs


def test_fp8_peaks_are_the_fp8_tensor_core_rates():
    from train.costs import devices as device_table

    h200, a100 = device_table.find_device("NVIDIA H200"), device_table.find_device("NVIDIA A100-SXM4-80GB")
    assert device_table.peak_tflops(h200, "fp8") == pytest.approx(2 * device_table.peak_tflops(h200, "bf16"), rel=1e-3)
    assert device_table.peak_tflops(a100, "fp8") is None


def test_checkpoint_signature_names_the_master_weights_form():
    """bf16 master weights are stored as int16 low halves: their checkpoints must not resume as (or from) the f32
    masters of earlier checkpoints, which were signed ``True``; f16 ones keep the f32 master and that signature."""
    assert precision_signature(True, "bf16") == {"fp16_loss_scaling": False, "master_weights": "int16 low halves"}
    assert precision_signature(True, "fp16") == {"fp16_loss_scaling": True, "master_weights": True}
    assert precision_signature(False, "bf16") == {"fp16_loss_scaling": False}
    # an fp8 checkpoint holds the scaling state: it resumes only as fp8, and older checkpoints keep their signature
    assert precision_signature(False, "fp8") == {"fp16_loss_scaling": False, "fp8_scaling": True}
