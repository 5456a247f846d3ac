"""ls_jax.backend (mode selection, kernel loading, fallback) and ls_jax.ops._common.dispatch on a CPU-only machine."""

import logging
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import pytest

from ls_jax import backend, ops
from ls_jax.ops import _common


@pytest.fixture(autouse=True)
def _fresh_backend_state(monkeypatch):
    """Each test sees no LS_JAX_KERNELS and loads (and warns about) the kernels afresh."""
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    backend._load_kernels.cache_clear()
    backend._warn_fallback.cache_clear()
    _common.log_fallback_once.cache_clear()
    yield
    backend._load_kernels.cache_clear()
    backend._warn_fallback.cache_clear()
    _common.log_fallback_once.cache_clear()


@pytest.mark.parametrize(
    "value, mode", [("auto", "auto"), ("ffi", "ffi"), ("xla", "xla"), ("XLA", "xla"), (" Ffi ", "ffi"), ("", "auto")]
)
def test_env_var_selects_mode(monkeypatch, value, mode):
    monkeypatch.setenv("LS_JAX_KERNELS", value)
    assert backend.requested_mode() == mode


def test_default_mode_is_auto():
    assert backend.requested_mode() == "auto"


@pytest.mark.parametrize("value", ["cuda", "on", "x la"])
def test_bad_env_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("LS_JAX_KERNELS", value)
    with pytest.raises(ValueError, match=r"LS_JAX_KERNELS=.* is not a kernel mode; expected one of auto, ffi, xla"):
        backend.requested_mode()


def test_use_nests_overrides_env_and_restores(monkeypatch):
    monkeypatch.setenv("LS_JAX_KERNELS", "ffi")
    with backend.use("xla"):
        assert backend.requested_mode() == "xla"
        with backend.use("auto"):
            assert backend.requested_mode() == "auto"
        assert backend.requested_mode() == "xla"
    assert backend.requested_mode() == "ffi"


def test_use_restores_after_an_exception():
    with pytest.raises(KeyError):
        with backend.use("xla"):
            raise KeyError("inside")
    assert backend.requested_mode() == "auto"


def test_use_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode='gpu' is not a kernel mode"):
        with backend.use("gpu"):
            pass


def test_no_cuda_here():
    assert not backend.cuda_visible()


def test_ffi_mode_without_cuda_raises_naming_cuda():
    with backend.use("ffi"):
        with pytest.raises(backend.KernelsUnavailableError, match="CUDA"):
            backend.kernels_enabled()


def _one_call_per_op():
    x, gamma = jnp.ones((2, 4)), jnp.ones(4)
    seed = ops.dropout_seed(jax.random.key(0))
    return {
        "layer_norm": lambda: ops.layer_norm(x, gamma, gamma),
        "attn_softmax": lambda: ops.attn_softmax(x),
        "dropout": lambda: ops.dropout(x, rate=0.1, seed=seed),
        "bias_dropout_residual": lambda: ops.bias_dropout_residual(x, gamma, x),
        "bias_act_dropout": lambda: ops.bias_act_dropout(x, gamma),
        "embed": lambda: ops.embed(jnp.zeros((2, 3), jnp.int32), x),
        "label_smoothed_cross_entropy": lambda: ops.label_smoothed_cross_entropy(x, jnp.zeros(2, jnp.int32)),
    }


@pytest.mark.parametrize("name", list(_one_call_per_op()))
def test_every_op_refuses_forced_ffi_without_kernels(name):
    """Forcing the kernels where they cannot load is an error for every op, never a silent XLA run."""
    call = _one_call_per_op()[name]
    with backend.use("ffi"), pytest.raises(backend.KernelsUnavailableError, match="CUDA"):
        call()


def test_auto_on_cpu_runs_xla_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for call in _one_call_per_op().values():
            jax.block_until_ready(jax.jit(call)())
        assert not backend.kernels_enabled()
    assert backend.active_backend() == "xla"


def _fake_kernel_module(monkeypatch, error=None):
    """Installs a stand-in ``ffi_kernels`` whose load() raises ``error`` (or succeeds) and counts its calls."""
    module = types.ModuleType("ffi_kernels")
    module.calls = 0

    def load():
        module.calls += 1
        if error is not None:
            raise error

    module.load = load
    monkeypatch.setitem(sys.modules, "ffi_kernels", module)
    return module


def test_auto_with_cuda_but_failing_load_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(backend, "cuda_visible", lambda: True)
    module = _fake_kernel_module(monkeypatch, OSError("libls_kernels.so: cannot open shared object file"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [backend.kernels_enabled() for _ in range(3)] == [False] * 3
        assert backend.active_backend() == "xla"
        for call in _one_call_per_op().values():
            jax.block_until_ready(jax.jit(call)())
    assert module.calls == 1
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    message = str(caught[0].message)
    assert "OSError: libls_kernels.so" in message and "LS_JAX_KERNELS=xla" in message


def test_ffi_with_cuda_but_failing_load_raises_the_reason(monkeypatch):
    monkeypatch.setattr(backend, "cuda_visible", lambda: True)
    _fake_kernel_module(monkeypatch, ImportError("undefined symbol: XlaFfiApi"))
    with backend.use("ffi"), pytest.raises(backend.KernelsUnavailableError, match="ImportError: undefined symbol"):
        backend.kernels_enabled()


def test_auto_with_loadable_kernels_enables_them(monkeypatch):
    monkeypatch.setattr(backend, "cuda_visible", lambda: True)
    module = _fake_kernel_module(monkeypatch)
    assert backend.kernels_enabled() and backend.kernels_enabled()
    assert module.calls == 1
    assert backend.active_backend() == "xla"  # enabled, but JAX's default platform here is the CPU
    with backend.use("xla"):
        assert not backend.kernels_enabled()


# ---- dispatch -----------------------------------------------------------------------------------------------

XLA_MARK, FFI_MARK = "stablehlo.cosine", "stablehlo.sine"


def _xla_impl(x, unused):
    assert unused is None
    return jnp.cos(x)


def _ffi_impl(x, unused):
    assert unused is None
    return jnp.sin(x)


def _lowered_text(unsupported=None, platform=None):
    """StableHLO of dispatch(xla=cos, ffi=sin) lowered for ``platform`` (the default backend when None)."""
    fn = jax.jit(lambda x: _common.dispatch("fake_op", _xla_impl, _ffi_impl, (x, None), unsupported))
    traced = fn.trace(jnp.ones(3))
    lowered = traced.lower() if platform is None else traced.lower(lowering_platforms=(platform,))
    return lowered.as_text()


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setattr(backend, "kernels_enabled", lambda: True)


def test_dispatch_lowers_ffi_branch_only_for_cuda(kernels_on):
    cpu = _lowered_text()
    assert XLA_MARK in cpu and FFI_MARK not in cpu
    cuda = _lowered_text(platform="cuda")
    assert FFI_MARK in cuda and XLA_MARK not in cuda


def test_dispatch_runs_xla_on_cpu_with_kernels_enabled(kernels_on):
    x = jnp.linspace(0.0, 1.0, 5)
    assert jnp.allclose(_common.dispatch("fake_op", _xla_impl, _ffi_impl, (x, None)), jnp.cos(x))


def test_dispatch_unsupported_shape_runs_xla_even_for_cuda_and_logs_once(kernels_on, caplog):
    with caplog.at_level(logging.WARNING, logger="ls_jax.ops"):
        for _ in range(2):
            cuda = _lowered_text(unsupported="hidden size 9000 exceeds the kernel limit of 8192", platform="cuda")
            assert XLA_MARK in cuda and FFI_MARK not in cuda
    records = [r for r in caplog.records if "fake_op" in r.getMessage()]
    assert len(records) == 1 and "hidden size 9000" in records[0].getMessage()


def test_dispatch_with_kernels_disabled_never_traces_ffi():
    with backend.use("xla"):
        cuda = _lowered_text(platform="cuda")
    assert XLA_MARK in cuda and FFI_MARK not in cuda


def test_dispatch_without_kernels_traces_the_xla_implementation_once_and_stores_16_bits_on_cuda():
    traced = []

    def xla_impl(x, unused):
        traced.append(x)
        return jnp.cos(x)

    fn = jax.jit(lambda x: _common.dispatch("fake_op", xla_impl, _ffi_impl, (x, None)))
    with backend.use("xla"):
        lowered = fn.trace(jnp.ones(3, jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert len(traced) == 1
    assert XLA_MARK in lowered and "optimization_barrier" in lowered
