"""``--optimizer``: ls_jax.optim's fused AdamW/Adan and optax's unfused baselines, their hyperparameter flags, the
run record naming what ran, and the kernel count of one optimizer step."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ls_jax.optim
from ls_jax.optim import registry
from train.costs import compiled
from train.errors import UsageError
from train.harness import cli
from train.harness.config import TrainingConfig
from train.harness.optimizer import (
    hyperparameters,
    implementation,
    linear_warmup_decay,
    make_optimizer,
    on_host,
)
from train.harness.training import run_training
from train.imdb import task as imdb
from train.records import runlog

SCHEDULE = optax.constant_schedule(1e-2)


def _params():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return {
        "w": jax.random.normal(keys[0], (6, 4)),
        "b": jax.random.normal(keys[1], (4,)),
        "v": jax.random.normal(keys[2], (4, 3)),
    }


def _trajectory(tx, steps=5):
    """Params after ``steps`` updates with gradients that change every step."""
    params = _params()
    state = tx.init(params)
    for step in range(steps):
        grads = jax.tree.map(lambda p: jnp.sin(p * (step + 1)), params)
        params, state = ls_jax.optim.fused_apply(tx, grads, state, params)
    return params


@pytest.mark.parametrize(
    "fused, unfused, given",
    [
        ("adamw", "optax-adamw", {"b1": 0.8, "b2": 0.95, "eps": 1e-6}),
        ("adan", "optax-adan", {"b1": 0.9, "b2": 0.9, "b3": 0.95, "eps": 1e-6}),
    ],
)
def test_fused_and_unfused_follow_the_same_math_with_the_given_hyperparameters(fused, unfused, given):
    options = dict(weight_decay=0.1, clip_norm=1.0, **given)
    ours = _trajectory(make_optimizer(fused, SCHEDULE, **options))
    baseline = _trajectory(make_optimizer(unfused, SCHEDULE, **options))
    defaults = _trajectory(make_optimizer(unfused, SCHEDULE, weight_decay=0.1, clip_norm=1.0))
    for name in ours:
        np.testing.assert_allclose(ours[name], baseline[name], rtol=1e-5, atol=1e-6)
    # The flags reach the update: the default hyperparameters give other params.
    assert max(float(jnp.max(jnp.abs(baseline[n] - defaults[n]))) for n in ours) > 1e-4


def test_unfused_optimizer_is_plain_optax():
    tx = make_optimizer("optax-adamw", SCHEDULE, weight_decay=0.0, clip_norm=None)
    assert not isinstance(tx, ls_jax.optim.FusedGradientTransformation)
    reference = optax.adamw(SCHEDULE, b1=0.9, b2=0.98, eps=1e-8, weight_decay=0.0)
    ours, theirs = _trajectory(tx), _trajectory(reference)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])


def test_hyperparameters_defaults_and_bad_values():
    adan_defaults = {"b1": 0.98, "b2": 0.92, "b3": 0.99, "eps": 1e-8}
    assert hyperparameters("optax-adan", {"b3": 0.9}) == {**adan_defaults, "b3": 0.9}
    assert hyperparameters("adamw", {"b1": None}) == {"b1": 0.9, "b2": 0.98, "eps": 1e-8}
    with pytest.raises(ValueError, match="--b3 is Adan's hyperparameter; adamw has only b1, b2, eps"):
        hyperparameters("adamw", {"b3": 0.9})
    with pytest.raises(ValueError, match="--b1 1 is out of range"):
        hyperparameters("adan", {"b1": 1.0})
    with pytest.raises(ValueError, match="eps must be > 0"):
        hyperparameters("adan", {"eps": 0.0})
    with pytest.raises(ValueError, match="keeps no master weights"):
        make_optimizer("optax-adan", SCHEDULE, weight_decay=0.0, clip_norm=None, master_dtype=jnp.bfloat16)


def test_implementation_names_what_runs():
    assert implementation("adan", "ffi") == "ls_jax.optim.adan (fused multi-tensor, CUDA kernel)"
    assert implementation("adan", "xla") == "ls_jax.optim.adan (fused multi-tensor, XLA)"
    assert implementation("optax-adamw", "ffi") == "optax.adamw (unfused, per-leaf XLA ops)"


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"optimizer": "adamw", "b3": 0.9}, "--optimizer adamw: --b3 is Adan's hyperparameter"),
        ({"optimizer": "optax-adamw", "master_weights": True}, "--master-weights needs a fused optimizer"),
        ({"optimizer": "optax-adan", "shard_optimizer": True}, "--shard-optimizer needs a fused optimizer"),
    ],
)
def test_check_optimizer_rejects_what_cannot_run(flags, message):
    config = TrainingConfig(**flags)
    with pytest.raises(UsageError, match=message):
        cli.check_optimizer(config)


HLO = """HloModule step

fused_computation {
  p = f32[4]{0} parameter(0)
  ROOT n = f32[4]{0} negate(p)
}

ENTRY main {
  a = f32[4]{0} parameter(0)
  c = f32[] constant(1)
  f = f32[4]{0} fusion(a), kind=kLoop, calls=fused_computation
  k = f32[4]{0} custom-call(f), custom_call_target="ls_adan_update"
  b = f32[2,2]{1,0} bitcast(k)
  y = f32[2,2]{1,0} copy(b)
  ROOT t = (f32[2,2]{1,0}) tuple(y)
}
"""


def test_entry_kernels_counts_instructions_that_do_work():
    assert compiled.entry_kernels(HLO) == 3  # fusion, custom-call, copy
    with pytest.raises(ValueError, match="no ENTRY"):
        compiled.entry_kernels("HloModule empty")


def test_optimizer_step_kernels_counts_the_compiled_update():
    params = _params()
    tx = make_optimizer("optax-adan", SCHEDULE, weight_decay=0.1, clip_norm=None)
    count = compiled.optimizer_step_kernels(tx, params, tx.init(params))
    assert count >= 1
    bigger = {**params, "extra": jnp.ones((5, 5)), "more": jnp.ones((7,))}
    # optax updates leaf by leaf: more leaves, more kernels.
    assert compiled.optimizer_step_kernels(tx, bigger, tx.init(bigger)) > count


def test_run_record_names_the_optimizer_that_ran(tmp_path):
    run_dir = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        code = run_training(
            imdb.TASK,
            [
                "--steps",
                "2",
                "--log-every",
                "1",
                "--no-progress",
                "--no-tensorboard",
                "--batch-size",
                "4",
                "--max-seq-len",
                "16",
                "--optimizer",
                "optax-adan",
                "--b3",
                "0.95",
                "--run-dir",
                str(run_dir),
            ],
        )
    assert code == 0
    run = runlog.read(run_dir / "run.jsonl")[0]
    assert run["optimizer"] == "optax-adan"
    assert run["optimizer_implementation"] == "optax.adan (unfused, per-leaf XLA ops)"
    assert run["optimizer_hyperparameters"] == {"b1": 0.98, "b2": 0.92, "b3": 0.95, "eps": 1e-8}
    assert isinstance(run["optimizer_kernels_per_step"], int) and run["optimizer_kernels_per_step"] > 0


def test_bad_optimizer_flag_is_one_line(tmp_path, capsys):
    code = run_training(
        imdb.TASK, ["--steps", "1", "--optimizer", "adamw", "--b3", "0.9", "--run-dir", str(tmp_path / "r")]
    )
    assert code == 2
    assert "error: --optimizer adamw: --b3 is Adan's hyperparameter" in capsys.readouterr().err


def test_the_logged_learning_rate_is_the_schedules_value_as_a_float():
    schedule = linear_warmup_decay(0.5, 4, 12)
    lr = on_host(schedule)
    assert [lr(0), lr(4), lr(12)] == [float(schedule(0)), 0.5, 0.0]
    assert all(type(lr(step)) is float for step in (1, 7))


def test_the_logged_learning_rate_compiles_at_setup_not_at_the_first_record(caplog):
    """Evaluated eagerly, the schedule compiled each of its ops at the first interval record, charged to the steps
    of the second interval; `on_host` compiles it once when it is made."""
    schedule = linear_warmup_decay(0.5, 4, 12)
    lr = on_host(schedule)

    def compilations(evaluate) -> int:
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"):
            evaluate()
        return sum("Compiling" in record.getMessage() for record in caplog.records)

    assert compilations(lambda: [lr(3), lr(8)]) == 0
    assert compilations(lambda: jax.jit(lambda step: schedule(step) + 1)(5)) == 1  # a compilation is seen
    assert [lr(3), lr(8)] == pytest.approx([0.375, 0.25])


def test_a_registered_optimizer_gets_its_hyperparameters_help_and_errors(monkeypatch):
    """The entry alone gives a new optimizer its hyperparameter checks, their help and the unfused refusals."""
    spec = registry.OptimizerSpec(
        "optax-sgd",
        "SGD",
        False,
        {"b1": registry.Hyperparameter(0.5, "momentum")},
        lambda lr, values, **_: optax.sgd(lr, momentum=values["b1"]),
    )
    monkeypatch.setitem(registry.OPTIMIZERS, "optax-sgd", spec)
    assert "optax-sgd" in registry.names(fused=False)
    assert registry.meaning("b1") == "AdamW: first-moment decay; Adan: first-moment decay; SGD: momentum"
    with pytest.raises(ValueError, match="--eps is AdamW and Adan's hyperparameter; optax-sgd has only b1"):
        spec.hyperparameters({"eps": 1e-6})
    with pytest.raises(ValueError, match=r"needs a fused optimizer \(adamw, adan\); optax-sgd keeps no master"):
        spec.build(0.1, {"b1": 0.5}, weight_decay=0.0, master_weights=True)
    tx = spec.build(0.1, spec.hyperparameters({"b1": 0.0}), weight_decay=0.0)
    updates, _ = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
    np.testing.assert_allclose(updates["w"], -0.1 * np.ones(2))
