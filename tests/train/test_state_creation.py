"""The step-0 state is drawn with JAX's threefry kernel on a GPU (`train.harness.step.threefry_kernel`): the same
parameters as XLA's threefry draws, from a kernel instead of inlined rounds."""

import concurrent.futures
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax import backend
from ls_jax.layers import LayerConfig
from ls_jax.models import BertConfig, BertForSequenceClassification
from train.harness.creation import StateCreation
from train.harness.step import threefry_kernel

KERNEL_CALL = re.compile(r"custom_call @\S*threefry")  # JAX's kernel, e.g. @cu_threefry2x32_ffi


def test_threefry_kernel_restores_the_setting_it_found():
    before = jax.config.jax_threefry_gpu_kernel_lowering
    with pytest.raises(RuntimeError), threefry_kernel():
        assert jax.config.jax_threefry_gpu_kernel_lowering
        raise RuntimeError("leaves the block")
    assert jax.config.jax_threefry_gpu_kernel_lowering == before


def test_threefry_kernel_holds_for_its_thread_only():
    """A program compiled on another thread meanwhile (the optimizer's kernel count) keeps XLA's threefry, so its
    compilation-cache key is the same in every run whatever the threads' timing."""
    seen = []
    with threefry_kernel():
        other = threading.Thread(target=lambda: seen.append(jax.config.jax_threefry_gpu_kernel_lowering))
        other.start()
        other.join()
        seen.append(jax.config.jax_threefry_gpu_kernel_lowering)
    assert seen == [False, True]


@pytest.mark.gpu
def test_threefry_kernel_draws_the_same_parameters_from_a_kernel():
    layer = LayerConfig.preset("bert-base", hidden_size=256, intermediate_size=1024, nhead=4)
    model = BertForSequenceClassification(BertConfig(layer=layer, vocab_size=512, num_layers=2))
    key = jax.random.PRNGKey(3)
    plain = jax.jit(lambda key: model.init(key, jnp.ones((1, 16), jnp.int32))["params"])
    with threefry_kernel():
        drawn = jax.jit(lambda key: model.init(key, jnp.ones((1, 16), jnp.int32))["params"])
        assert KERNEL_CALL.search(drawn.lower(key).as_text())
        from_kernel = drawn(key)
    assert not KERNEL_CALL.search(plain.lower(key).as_text())
    for a, b in zip(jax.tree.leaves(plain(key)), jax.tree.leaves(from_kernel), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_state_creation_compiles_on_a_thread_of_its_own_as_the_caller_set_it_up():
    """The creation compiles beside the caller (which goes on to compile the training step), on the thread it is
    given, under the caller's kernel backend and with JAX's threefry kernel on there; its state is jit's."""
    traced = []

    def create(offset):
        traced.append(
            (threading.current_thread(), backend.requested_mode(), jax.config.jax_threefry_gpu_kernel_lowering)
        )
        return {"w": jax.random.normal(jax.random.PRNGKey(5), (3, 4)) + offset, "step": jnp.zeros((), jnp.int32)}

    offset = jnp.float32(2.0)
    abstract = jax.eval_shape(create, offset)
    traced.clear()
    with backend.use("xla"), concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
        creation = StateCreation(create, offset, abstract, jax.sharding.SingleDeviceSharding(jax.devices()[0]), thread)
    state = creation.result()
    [(thread, mode, threefry)] = traced
    assert thread is not threading.current_thread() and mode == "xla" and threefry
    assert creation.abstract is abstract
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(jax.jit(create)(offset)["w"]))


def test_state_creation_raises_what_its_compilation_raised():
    def create(_):
        raise ValueError("no state of this shape")

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
        creation = StateCreation(create, None, {}, jax.sharding.SingleDeviceSharding(jax.devices()[0]), thread)
    with pytest.raises(ValueError, match="no state of this shape"):
        creation.result()
