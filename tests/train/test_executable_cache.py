"""The training step kept on disk and loaded without tracing (`train.harness.executable_cache`): a loaded step
computes what the compiled one does, any change to what shapes the step makes a new key, and a damaged or foreign
entry is one warning and a compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.flop_step import tiny_transformer_step

from ls_jax import backend
from train.harness import compile_cache
from train.harness.config import TrainingConfig, field_names
from train.harness.executable_cache import (
    HOST_ONLY_FIELDS,
    StepExecutables,
    describe,
    keepable,
    run_description,
    source_digest,
)
from train.harness.parallel import DATA_AXIS, DataParallel, StateLayout
from train.harness.step import TrainState, make_train_step
from train.harness.step_compiler import StepCompiler


@pytest.fixture(autouse=True)
def nothing_written_to_xla_cache():
    """These steps compile in XLA every time: one from XLA's persistent cache is not kept on a CPU (`keepable`)."""
    name = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, name)
    jax.config.update(name, 1e9)
    yield
    jax.config.update(name, before)


RUN = run_description("toy", {"lr": 0.1, "run_dir": "runs/a"}, 10, {"features": 4}, "xla")


def linear_loss(variables, batch, rng):
    del rng
    errors = (batch["x"] @ variables["params"]["w"] - batch["y"]) ** 2
    return jnp.sum(errors), jnp.float32(errors.size), {"nll": jnp.sum(errors)}


def weighted_loss(weight):
    def loss(variables, batch, rng):
        total, count, sums = linear_loss(variables, batch, rng)
        return weight * total, count, sums

    return loss


def setup(directory, run=RUN, tx=None):
    tx = tx or optax.adamw(0.1)
    parallel = DataParallel.over_all_devices()
    state = parallel.replicate(TrainState.create({"w": jnp.zeros((4,))}, tx, jax.random.PRNGKey(0), fp16=False))
    step = make_train_step(linear_loss, tx, axis_name=DATA_AXIS)
    compiler = StepCompiler(step, StateLayout(parallel), state, executables=StepExecutables(directory, run))
    return compiler, state, parallel


def batch(rows=8):
    x = np.random.default_rng(rows).normal(size=(1, rows, 4)).astype(np.float32)
    return {"x": x, "y": x @ np.arange(1.0, 5.0, dtype=np.float32)}


def train_once(compiler, state, parallel, data):
    copy = jax.tree.map(jnp.copy, state)  # the step donates its state
    new_state, metrics = compiler.compiled(copy, data)(copy, parallel.put_batch(data, row_axis=1))
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(new_state.params)]), float(metrics["loss"])


def entries(directory):
    return sorted((directory / "ls_jax_steps").glob("*.pkl"))


def test_a_kept_step_loads_untraced_and_computes_what_the_compiled_one_did(tmp_path):
    compiler, state, parallel = setup(tmp_path)
    compiled_result = train_once(compiler, state, parallel, batch())
    flops = compiler.xla_flops(StepCompiler.key(batch()))
    compiler._counting.shutdown(wait=True)  # the entry is written after the FLOP count, on that thread
    assert len(entries(tmp_path)) == 1

    loaded_before = compile_cache.use().steps_loaded
    again, state, parallel = setup(tmp_path)
    again._jitted = None  # tracing the step again would fail
    loaded_result = train_once(again, state, parallel, batch())
    assert compile_cache.use().steps_loaded == loaded_before + 1
    np.testing.assert_array_equal(loaded_result[0], compiled_result[0])
    assert loaded_result[1] == compiled_result[1]
    assert again.xla_flops(StepCompiler.key(batch())) == flops > 0
    assert again.memory_analysis() is not None


def test_what_shapes_the_step_changes_its_key(tmp_path):
    compiler, state, parallel = setup(tmp_path)
    devices = list(parallel.mesh.devices.flat)
    sharding = parallel.rows_sharding(1)

    def key(executables=compiler._executables, state=state, rows=8, options=None, step=compiler._step_fn):
        shapes = {name: jax.ShapeDtypeStruct(v.shape, v.dtype) for name, v in batch(rows).items()}
        return executables.key(step, state, compiler._shardings, shapes, sharding, options or {}, devices)

    base = key()
    assert key() == base
    assert key(step=make_train_step(linear_loss, optax.adamw(0.1), axis_name=DATA_AXIS)) == base  # built alike
    assert key(step=make_train_step(linear_loss, optax.adamw(0.2), axis_name=DATA_AXIS)) != base
    assert key(step=make_train_step(linear_loss, optax.adamw(0.1, b2=0.98), axis_name=DATA_AXIS)) != base
    assert key(step=make_train_step(weighted_loss(2.0), optax.adamw(0.1), axis_name=DATA_AXIS)) != base
    assert key(rows=16) != base
    assert key(options={"xla_gpu_enable_fast_min_max": True}) != base
    assert key(state=jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, state)) != base
    other_lr = run_description("toy", {"lr": 0.2, "run_dir": "runs/a"}, 10, {"features": 4}, "xla")
    assert key(StepExecutables(tmp_path, other_lr)) != base
    assert key(StepExecutables(tmp_path, run_description("toy", {"lr": 0.1}, 20, {"features": 4}, "xla"))) != base
    assert key(StepExecutables(tmp_path, run_description("toy", {"lr": 0.1}, 10, {"features": 4}, "ffi"))) != base
    # Where the run writes is not the step's: another run directory finds the same entry.
    elsewhere = run_description("toy", {"lr": 0.1, "run_dir": "runs/b"}, 10, {"features": 4}, "xla")
    assert key(StepExecutables(tmp_path, elsewhere)) == base


def test_a_description_holds_the_closed_over_constants_and_never_an_address():
    class Opaque:  # no fields to describe: its repr names its address
        __slots__ = ()

    assert describe(weighted_loss(2.0)) == describe(weighted_loss(2.0)) != describe(weighted_loss(3.0))
    assert describe(np.arange(3)) != describe(np.arange(1, 4))
    first, second = Opaque(), Opaque()
    assert describe(lambda x, o=first: x) != describe(lambda x, o=second: x)  # never found again, never wrongly

    class Silent:
        __slots__ = ()

        def __repr__(self):
            raise RuntimeError("deleted")

    assert describe(Silent())[0] == "unrepresentable"

    def before_bound():
        return later

    assert describe(before_bound)[-1][-1] == ["list", ["list", "empty cell"]]
    later = 1
    assert describe(before_bound)[-1][-1] == ["list", 1]


def test_off_a_gpu_only_a_step_xla_compiled_here_is_kept():
    assert keepable("gpu", from_xla_cache=True) and keepable("cpu", from_xla_cache=False)
    assert not keepable("cpu", from_xla_cache=True) and not keepable("tpu", from_xla_cache=True)


def test_the_fields_left_out_of_the_key_are_flags_of_every_task():
    assert HOST_ONLY_FIELDS <= field_names(TrainingConfig)  # a renamed flag would otherwise stay in the key unnoticed


def test_the_source_digest_follows_every_source_file_and_nothing_else(tmp_path):
    package = tmp_path / "package"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "kernel.cu").write_text("// kernel\n")
    before = source_digest([package])
    (package / "notes.md").write_text("not code")
    assert source_digest([package]) == before
    (package / "sub" / "kernel.cu").write_text("// kernel, changed\n")
    assert source_digest([package]) != before


def test_a_damaged_entry_is_one_warning_and_a_compilation_that_replaces_it(tmp_path, capfd):
    compiler, state, parallel = setup(tmp_path)
    expected = train_once(compiler, state, parallel, batch())
    compiler._counting.shutdown(wait=True)
    (entry,) = entries(tmp_path)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)  # a run of zeroed bytes inside the executable
    entry.write_bytes(bytes(data[: len(data) * 3 // 4]))  # and the file cut short
    capfd.readouterr()

    again, state, parallel = setup(tmp_path)
    result = train_once(again, state, parallel, batch())
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {entry}: the cached training step could not be loaded")
    np.testing.assert_array_equal(result[0], expected[0])
    again._counting.shutdown(wait=True)
    third, state, parallel = setup(tmp_path)
    before = compile_cache.use().steps_loaded
    train_once(third, state, parallel, batch())
    assert compile_cache.use().steps_loaded == before + 1  # the compilation wrote a sound entry again


def test_an_entry_for_other_arguments_is_refused(tmp_path, capfd):
    compiler, state, parallel = setup(tmp_path)
    train_once(compiler, state, parallel, batch(rows=8))
    compiler._counting.shutdown(wait=True)
    (rows_8,) = entries(tmp_path)
    again, state, parallel = setup(tmp_path)
    shapes = {name: jax.ShapeDtypeStruct(v.shape, v.dtype) for name, v in batch(16).items()}
    key_16 = again._executables.key(
        again._step_fn,
        state,
        again._shardings,
        shapes,
        parallel.rows_sharding(1),
        again._options,
        list(parallel.mesh.devices.flat),
    )
    rows_8.rename(again._executables.path(key_16))  # as if two steps shared a key
    capfd.readouterr()
    train_once(again, state, parallel, batch(rows=16))
    err = capfd.readouterr().err
    assert "could not be loaded (ValueError: its arguments' shapes or dtypes are not this step's)" in err


def test_a_blocked_folder_is_one_warning_and_the_step_still_runs(tmp_path, capfd):
    (tmp_path / "ls_jax_steps").write_text("a file where the folder goes")
    compiler, state, parallel = setup(tmp_path)
    capfd.readouterr()
    weights, loss = train_once(compiler, state, parallel, batch())
    compiler._counting.shutdown(wait=True)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the training step was not kept for later runs (FileExistsError" in err[0]
    assert np.isfinite(loss) and np.any(weights != 0)


@pytest.mark.gpu
def test_a_step_of_the_cuda_kernels_loads_and_trains_as_compiled(tmp_path):
    """The kernels' FFI calls resolve in a loaded executable: the loaded step gives the compiled step's loss."""
    executables = StepExecutables(tmp_path, RUN)
    with backend.use("ffi"):
        compiler, state, batch_shapes, _ = tiny_transformer_step(executables)
        data = {name: np.full(s.shape, 3, s.dtype) for name, s in batch_shapes.items()}
        parallel = compiler._parallel
        compiled_result = train_once(compiler, state, parallel, data)
        assert 'custom_call_target="ls_' in compiler.compiled(state, data).as_text()  # the step calls the kernels
        compiler._counting.shutdown(wait=True)
        before = compile_cache.use().steps_loaded
        again, state, _, _ = tiny_transformer_step(executables)
        loaded_result = train_once(again, state, parallel, data)
    assert compile_cache.use().steps_loaded == before + 1
    np.testing.assert_allclose(loaded_result[0], compiled_result[0], rtol=1e-6)
    assert loaded_result[1] == pytest.approx(compiled_result[1], rel=1e-6)
